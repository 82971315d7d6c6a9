"""The trainer's checkpoint (its saved state: learner state, lease cursor, journal epoch, ledger), written atomically.

One meaning of "checkpoint" in this project: this file. A Hugging Face directory of weights is a "model dir".
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


def load_checkpoint(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    return torch.load(path, map_location="cpu", weights_only=False)
