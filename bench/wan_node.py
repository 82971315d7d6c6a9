"""One node of bench/wan, run inside a lab namespace: the product's weight stack without sampling or training.

``origin``: the trainer's side: publishes the model as version 0, then a new version (every tensor perturbed,
so every weight chunk is new) each time the driver writes ``<root>/publish``; super-seeds and announces by
gossip, exactly as the trainer role does. ``fetch``: a sampler's side: a real WeightSync (gossip, signed
manifests, rarest-first chunk swarming), discovery through the DHT, and a record of when each version
became usable. In ``naive`` mode (``<root>/mode`` says so) a fetcher downloads from the origin alone.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path
from typing import Any

import multiaddr
import torch
import trio
from libp2p.crypto.keys import KeyPair

from node.config import NodeConfig, load_config_file
from node.discovery import find_role, provide_forever, role_key
from node.host import Swarm
from node.runtime import run_node
from node.weights.gossip import announce_topic
from node.weights.publish import Publisher
from node.weights.server import WeightServer
from node.weights.store import ChunkStore
from node.weights.sync import WeightSync
from protocols import weights as w
from trainer.model import load_model, save_model_dir


class Origin:
    name = "trainer"

    def __init__(self, config: NodeConfig, model_dir: Path, root: Path) -> None:
        self.config, self.model_dir, self.root = config, model_dir, root
        self.store = ChunkStore(config.data_dir / "store")
        self.server = WeightServer(self.store, origin=True)
        self.model = load_model(model_dir)
        self.version = -1
        self.published: dict[int, dict[str, Any]] = {}

    def register(self, swarm: Swarm) -> None:
        self.server.register(swarm.host)
        key = KeyPair(swarm.host.get_private_key(), swarm.host.get_public_key())
        self.publisher = Publisher(self.store, key, self.config.swarm)

    async def publish(self, swarm: Swarm) -> None:
        version = self.version + 1
        mode = self.root / "mode"
        # the naive baseline gets a plain server: super-seeding only pays when peers re-serve
        self.server.origin = not (mode.exists() and mode.read_text() == "naive")
        if version:
            with torch.no_grad():
                for p in self.model.parameters():
                    p.add_(torch.randn_like(p) * 1e-3)
        staging = self.publisher.staging_dir(version)
        await trio.to_thread.run_sync(save_model_dir, self.model, staging, self.model_dir)
        mid, _, manifest = await trio.to_thread.run_sync(self.publisher.publish, staging, version)
        self.published[version] = {"time": time.time(), "bytes": manifest.total_size}
        (self.root / "published.json").write_text(json.dumps(self.published))
        self.version, self.mid = version, mid
        await swarm.gossip.publish(announce_topic(self.config.swarm), w.announce(version, mid))

    async def run(self, swarm: Swarm) -> None:
        await self.publish(swarm)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(provide_forever, swarm, role_key(self.config.swarm, "trainer"), 3.0)

            async def reannounce() -> None:
                while True:
                    await trio.sleep(2.0)
                    await swarm.gossip.publish(announce_topic(self.config.swarm), w.announce(self.version, self.mid))

            nursery.start_soon(reannounce)
            trigger = self.root / "publish"
            while True:
                if trigger.exists():
                    trigger.unlink()
                    await self.publish(swarm)
                await trio.sleep(0.05)

    def status(self) -> dict[str, Any]:
        return {"version": self.version, "bytes_uploaded": self.server.bytes_served}


class Fetcher:
    name = "sampler"

    def __init__(self, config: NodeConfig, root: Path) -> None:
        self.config, self.root = config, root
        self.store = ChunkStore(config.data_dir / "store")
        self.server = WeightServer(self.store)
        self.got: dict[int, float] = {}

    def register(self, swarm: Swarm) -> None:
        self.server.register(swarm.host)

        async def installed(version: int, path: Path) -> None:
            self.got[version] = time.time()

        assert self.config.trainer_id is not None
        trainer = self.config.trainer_id
        self.sync = WeightSync(swarm, self.store, swarm.gossip, self.config.swarm, trainer, installed)
        everyone = self.sync.peers
        mode = self.root / "mode"
        self.sync.peers = lambda: [trainer] if mode.exists() and mode.read_text() == "naive" else everyone()  # type: ignore[method-assign]

    async def run(self, swarm: Swarm) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.sync.run)
            key = role_key(self.config.swarm, "sampler")
            nursery.start_soon(provide_forever, swarm, key, 3.0)
            while True:
                for info in await find_role(swarm, key):
                    try:
                        await swarm.connect(info)
                    except Exception:
                        pass
                await trio.sleep(2.0)

    def status(self) -> dict[str, Any]:
        return {"got": {str(k): v for k, v in self.got.items()}, "bytes_uploaded": self.server.bytes_served}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["origin", "fetch"])
    p.add_argument("--config", type=Path, required=True)
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--listen", required=True)
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--model", type=Path)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    config = NodeConfig(
        role=args.role,
        data_dir=args.data_dir,
        listen=multiaddr.Multiaddr(args.listen),
        provide_interval=3.0,
        status_interval=0.5,
        **load_config_file(args.config),
    )
    role = Origin(config, args.model, args.root) if args.role == "origin" else Fetcher(config, args.root)
    trio.run(run_node, config, role)


if __name__ == "__main__":
    main()
