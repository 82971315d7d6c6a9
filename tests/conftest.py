"""Shared fixtures: one tiny model per test session, and helpers to run real nodes on loopback."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from trainer.tiny_qwen2 import build_random_model

    return build_random_model(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="session")
def realistic_model_dir() -> Path:
    """The trained Llama of trainer/realistic_model.py (peaked distributions), built once per checkout (~30 s)."""
    from trainer.realistic_model import cached_realistic_model

    return cached_realistic_model(cache_dir=Path(__file__).resolve().parents[1] / "runs" / ".fixtures")
