"""A task from a JSON-lines file: one ``{"prompt": ..., "answer": ...}`` object per line.

Seeds map to rows: held-out seeds (>= EVAL_SEED_BASE) to every tenth row, training seeds to the others, so the
evaluation never sees a prompt that training did. Rewards: ``exact`` (normalised exact match: case, surrounding
whitespace and inner runs of whitespace, a trailing period ignored), ``numeric`` (the last number in the
completion equals the answer), or ``module:function`` (``function(completion, answer) -> float in [0, 1]``).
"""

from __future__ import annotations

import importlib
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from trainer.errors import UserError

NUMBER = re.compile(r"[-+]?(?:\d+(?:[.,]\d+)*(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?")
MAX_ROWS = 10_000_000


def normalise(text: str) -> str:
    return " ".join(text.strip().lower().split()).rstrip(".")


def exact_reward(completion: str, answer: str) -> float:
    return float(normalise(completion) == normalise(answer))


def last_number(text: str) -> float | None:
    found = NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def numeric_reward(completion: str, answer: str) -> float:
    got, want = last_number(completion), last_number(answer)
    if got is None or want is None:
        return 0.0
    return float(math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9))


def load_reward(spec: str) -> Callable[[str, str], float]:
    builtin = {"exact": exact_reward, "numeric": numeric_reward}
    if spec in builtin:
        return builtin[spec]
    if ":" not in spec:
        raise UserError(f"unknown reward {spec!r}: use exact, numeric or 'module:function'")
    module, attr = spec.split(":", 1)
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise UserError(f"cannot load reward {spec!r}: {exc}") from None


def read_rows(path: Path) -> list[tuple[str, str]]:
    """(prompt, answer) of every line; the first bad line is a clear error naming it."""
    if not path.is_file():
        raise UserError(f"dataset {path} does not exist")
    rows = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise UserError(f"{path}:{n}: each line must be a JSON object with 'prompt' and 'answer'")
            prompt, answer = obj.get("prompt"), obj.get("answer")
            if not isinstance(prompt, str) or not prompt:
                raise UserError(f"{path}:{n}: 'prompt' must be a non-empty string")
            if isinstance(answer, (int, float)) and not isinstance(answer, bool):
                answer = str(answer)
            if not isinstance(answer, str):
                raise UserError(f"{path}:{n}: 'answer' must be a string or a number")
            rows.append((prompt, answer))
            if len(rows) > MAX_ROWS:
                raise UserError(f"{path}: more than {MAX_ROWS} rows")
    if len(rows) < 2:
        raise UserError(f"{path}: needs at least 2 rows (one is held out for evaluation)")
    return rows


@dataclass
class JsonlTask:
    path: Path
    reward_spec: str = "exact"
    name: str = "jsonl"
    rows: list[tuple[str, str]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        from trainer.tasks import EVAL_SEED_BASE

        self.rows = read_rows(Path(self.path))
        self.score = load_reward(self.reward_spec)
        self.eval_base = EVAL_SEED_BASE
        self.held_out = list(range(0, len(self.rows), 10))
        self.train_rows = [i for i in range(len(self.rows)) if i % 10] or self.held_out
        self.name = f"jsonl:{Path(self.path).name}"[:64]

    def row(self, seed: int) -> tuple[str, str]:
        if seed >= self.eval_base:
            return self.rows[self.held_out[(seed - self.eval_base) % len(self.held_out)]]
        return self.rows[self.train_rows[seed % len(self.train_rows)]]

    def prompt(self, seed: int) -> str:
        return self.row(seed)[0]

    def answer(self, seed: int) -> str:
        return self.row(seed)[1]

    def reward(self, seed: int, completion: str) -> float:
        return min(1.0, max(0.0, float(self.score(completion, self.answer(seed)))))

    def solved(self, seed: int, completion: str) -> bool:
        return self.reward(seed, completion) >= 1.0
