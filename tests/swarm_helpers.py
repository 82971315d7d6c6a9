"""Run real swarm nodes (libp2p hosts, Kad-DHT, real engines) inside one trio process, on 127.0.0.1."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import multiaddr
import trio

from node.config import NodeConfig
from node.engines import make_engine
from node.host import Swarm
from node.identity import load_or_create_key, peer_id_of
from node.roles.bootstrap import BootstrapRole
from node.roles.sampler import SamplerRole
from node.roles.trainer import TrainerRole
from node.runtime import run_node
from trainer.settings import TrainerSettings

LOOPBACK = multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")


@dataclass
class Running:
    role: object
    swarm: Swarm
    config: NodeConfig


def node_config(root: Path, name: str, role: str, **kw) -> NodeConfig:
    defaults = dict(
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


def trainer_peer_id(root: Path):
    return peer_id_of(load_or_create_key(root / "trainer" / "identity.key"))


async def start(nursery: trio.Nursery, config: NodeConfig, role) -> Running:
    swarm = await nursery.start(run_node, config, role)
    return Running(role, swarm, config)


async def start_bootstrap(nursery, root: Path) -> Running:
    return await start(nursery, node_config(root, "bootstrap", "bootstrap"), BootstrapRole())


async def start_trainer(nursery, root: Path, boot: Running, model_dir: Path, role_kw=None, **settings) -> Running:
    cfg = node_config(root, "trainer", "trainer", bootstrap=(boot.swarm.addrs()[0],))
    role = TrainerRole(
        cfg.swarm,
        cfg.data_dir,
        TrainerSettings(model_dir=model_dir, **settings),
        cfg.provide_interval,
        **(role_kw or {}),
    )
    return await start(nursery, cfg, role)


async def start_sampler(nursery, root: Path, name: str, boot: Running, engine="mlx", bits=8) -> Running:
    cfg = node_config(root, name, "sampler", bootstrap=(boot.swarm.addrs()[0],), trainer_id=trainer_peer_id(root))
    role = SamplerRole(
        cfg.swarm,
        cfg.trainer_id,
        lambda path, v: make_engine(engine, path, bits=bits, version=v),
        cfg.data_dir,
        cfg.provide_interval,
        cfg.discover_interval,
    )
    return await start(nursery, cfg, role)


async def wait_until(predicate, timeout: float, interval: float = 0.2) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(interval)
