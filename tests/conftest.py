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


@pytest.fixture
async def trainer_and_client(tmp_path, tiny_model_dir, nursery):
    """A trainer on loopback and a bare client swarm connected to it (tests of what a peer may send)."""
    from node.host import open_swarm
    from node.identity import load_or_create_key
    from tests.helpers import LOOPBACK, start_bootstrap, start_trainer

    boot = await start_bootstrap(nursery, tmp_path)
    trainer = await start_trainer(nursery, tmp_path, boot, tiny_model_dir, group_size=4, max_tokens=6)
    async with open_swarm(load_or_create_key(tmp_path / "client.key"), LOOPBACK) as client:
        from libp2p.peer.peerinfo import info_from_p2p_addr

        await client.connect(info_from_p2p_addr(trainer.swarm.addrs()[0]))
        yield trainer, client
