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
