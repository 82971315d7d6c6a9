"""A whole swarm inside one trio process on 127.0.0.1: real libp2p hosts, the real Kad-DHT, real engines.

For benchmarks and tests that want many nodes without many processes (``swarmrl demo`` uses processes).
Each ``start_*`` returns once the node has joined; cancel the nursery to stop them all.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import multiaddr
import trio

from node.config import NodeConfig
from node.engines import engine_factory
from node.host import Swarm
from node.identity import load_or_create_key, peer_id_of
from node.roles.bootstrap import BootstrapRole
from node.roles.sampler import SamplerRole
from node.roles.trainer import TrainerRole
from node.runtime import run_node
from node.settings import Settings, build_settings

LOOPBACK = multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")


@dataclass
class Running:
    role: Any
    swarm: Swarm
    config: NodeConfig


def node_config(root: Path, name: str, role: str, **kw: Any) -> NodeConfig:
    """Fast intervals for a swarm on one machine."""
    defaults: dict[str, Any] = dict(
        swarm="test",
        listen=LOOPBACK,
        data_dir=root / name,
        provide_interval=2.0,
        discover_interval=0.5,
        status_interval=1.0,
        bootstrap_timeout=5.0,
    )
    defaults.update(kw)
    return NodeConfig(role=role, **defaults)


def settings(
    trainer: dict | None = None, learner: dict | None = None, sampler: dict | None = None, weights: dict | None = None
) -> Settings:
    """Default settings with some fields changed, by table."""
    s = build_settings(None, None)
    return Settings(
        replace(s.trainer, **(trainer or {})),
        replace(s.learner, **(learner or {})),
        replace(s.sampler, **(sampler or {})),
        replace(s.weights, **(weights or {})),
    )


def trainer_peer_id(root: Path):
    return peer_id_of(load_or_create_key(root / "trainer" / "identity.key"))


async def start(nursery: trio.Nursery, config: NodeConfig, role: Any) -> Running:
    swarm = await nursery.start(run_node, config, role)
    return Running(role, swarm, config)


async def start_bootstrap(nursery: trio.Nursery, root: Path, **config: Any) -> Running:
    """A bootstrap node; keyword arguments set its NodeConfig fields (``max_inbound``, ...)."""
    return await start(nursery, node_config(root, "bootstrap", "bootstrap", **config), BootstrapRole())


async def start_trainer(
    nursery: trio.Nursery, root: Path, boot: Running, model_dir: Path, weights: dict | None = None, **trainer: Any
) -> Running:
    """A trainer on ``model_dir``; keyword arguments set [trainer] or learner fields by name."""
    learner_fields = set(settings().learner.__dataclass_fields__)
    learner = {k: v for k, v in trainer.items() if k in learner_fields}
    rest = {"dashboard": "127.0.0.1:0", **{k: v for k, v in trainer.items() if k not in learner_fields}}
    cfg = node_config(root, "trainer", "trainer", bootstrap=(boot.swarm.addrs()[0],))
    s = settings(trainer=rest, learner={"model_dir": model_dir, **learner}, weights=weights)
    return await start(nursery, cfg, TrainerRole(cfg, s))


async def start_sampler(
    nursery: trio.Nursery,
    root: Path,
    name: str,
    boot: Running,
    engine: str = "mlx",
    bits: str = "8",
    compute: str = "auto",
) -> Running:
    cfg = node_config(root, name, "sampler", bootstrap=(boot.swarm.addrs()[0],), trainer_id=trainer_peer_id(root))
    s = settings(sampler={"engine": engine, "bits": bits, "compute": compute})
    return await start(nursery, cfg, SamplerRole(cfg, s, engine_factory(engine, bits, compute)))


async def wait_until(predicate: Any, timeout: float, interval: float = 0.2, what: str = "condition") -> None:
    """Poll ``predicate`` (state owned by other nodes) until it holds; fail with ``what`` after ``timeout``."""
    with trio.move_on_after(timeout) as scope:
        while not predicate():
            await trio.sleep(interval)
    if scope.cancelled_caught:
        raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
