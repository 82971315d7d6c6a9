"""Reverse a string of digits: learnable by a tiny model from random init with partial credit."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class ReverseDigitsTask:
    digits: int = 5
    name: str = "reverse"

    def _digits(self, seed: int) -> str:
        rng = random.Random(seed)
        return "".join(rng.choice("0123456789") for _ in range(self.digits))

    def prompt(self, seed: int) -> str:
        return self._digits(seed) + ">"

    def answer(self, seed: int) -> str:
        return self._digits(seed)[::-1]

    def reward(self, seed: int, completion: str) -> float:
        """Fraction of positions right, over the longer of answer and completion (extra chars cost)."""
        want = self.answer(seed)
        right = sum(a == b for a, b in zip(want, completion, strict=False))
        return right / max(len(want), len(completion))

    def solved(self, seed: int, completion: str) -> bool:
        return completion == self.answer(seed)
