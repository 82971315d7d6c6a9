"""Verifiable tasks: a prompt from a seed, a reward the trainer computes itself. Plug-ins load as 'module:attr'."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Protocol, runtime_checkable

from trainer.errors import UserError


@runtime_checkable
class Task(Protocol):
    """A task maps a seed to a prompt and scores a completion; both must be deterministic."""

    name: str

    def prompt(self, seed: int) -> str: ...

    def reward(self, seed: int, completion: str) -> float:
        """A score in [0, 1]; partial credit lets a model learn from random init."""
        ...

    def solved(self, seed: int, completion: str) -> bool: ...


EVAL_SEED_BASE = 10**12  # seeds from here on are held out: evaluation only, never handed out for training


def load_task(spec: str, reward: str = "exact") -> Task:
    """A built-in task name, ``jsonl:PATH`` (a dataset; ``reward`` scores it), or 'package.module:factory'."""
    from trainer.tasks.arithmetic import AdditionTask
    from trainer.tasks.dataset import JsonlTask
    from trainer.tasks.reverse import ReverseDigitsTask

    builtins = {"reverse": ReverseDigitsTask, "add": AdditionTask}
    if spec in builtins:
        return builtins[spec]()
    if spec.startswith("jsonl:"):
        return JsonlTask(Path(spec[len("jsonl:") :]), reward)
    if ":" not in spec:
        raise UserError(f"unknown task {spec!r}: use one of {sorted(builtins)} or 'module:factory'")
    module_name, attr = spec.split(":", 1)
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise UserError(f"cannot load task {spec!r}: {exc}") from None
    task = factory()
    if not isinstance(task, Task):
        raise UserError(f"{spec!r} did not produce a Task (needs name, prompt(), reward(), solved())")
    return task
