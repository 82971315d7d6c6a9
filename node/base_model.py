"""The embedded base model (trainer/base_model.py) provisioned on disk: pretrained once, where a trainer or the demo
keeps it. Torch is imported only to build it."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

log = logging.getLogger(__name__)


def ensure_base_model(path: Path, building: Callable[[], AbstractContextManager] = nullcontext) -> Path:
    """The embedded base model at ``path``, pretrained there first (deterministically, ~30-60 s, inside
    ``building()``) unless it is already. A half-written one (a crash mid-build) is built again: the directory
    appears only when complete."""
    if not (path / "config.json").exists():
        from trainer.base_model import build_base_model

        log.info("pretraining the embedded base model into %s (once, ~30-60 s)", path)
        with building():
            staging = path.with_name(path.name + ".tmp")
            shutil.rmtree(staging, ignore_errors=True)
            build_base_model(staging)
            shutil.rmtree(path, ignore_errors=True)
            os.replace(staging, path)
    return path
