"""Add two small numbers: a second built-in task, with digit-level partial credit."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class AdditionTask:
    max_operand: int = 99
    name: str = "add"

    def _operands(self, seed: int) -> tuple[int, int]:
        rng = random.Random(seed)
        return rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)

    def prompt(self, seed: int) -> str:
        a, b = self._operands(seed)
        return f"{a}+{b}="

    def answer(self, seed: int) -> str:
        a, b = self._operands(seed)
        return str(a + b)

    def reward(self, seed: int, completion: str) -> float:
        want = self.answer(seed)
        right = sum(a == b for a, b in zip(want, completion, strict=False))
        return right / max(len(want), len(completion))

    def solved(self, seed: int, completion: str) -> bool:
        return completion == self.answer(seed)
