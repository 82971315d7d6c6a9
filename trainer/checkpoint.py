"""The trainer's checkpoint (its saved state: learner state, lease cursor, journal epoch, ledger), written atomically.

One meaning of "checkpoint" in this project: this file (a sharded trainer's names a DCP directory beside it for the
learner's state: trainer/sharded_state.py). A Hugging Face directory of weights is a "model dir".
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path, mmap: bool = False) -> dict[str, Any] | None:
    """The saved state, or None; ``mmap``: tensors stay in the file until read (each rank of a sharded learner
    takes only its slices of a single-rank checkpoint)."""
    if not path.exists():
        return None
    return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
