"""Hostile swarm members for fault scenarios: real libp2p nodes (same host, DHT and protocols as the product)
that misbehave on purpose. Test code only; nothing in the product can be switched into these modes.

``--mode corrupt``: joins as a sampler, fetches the real manifests, then claims to hold every chunk of the
newest version and serves garbage of the right length (so only the blake3 check can catch it).
``--mode flood``: finds the trainer through the DHT and floods it with rollout submissions from 16
concurrent streams, counting the replies by error code.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import msgpack
import multiaddr
import trio

from node.cli import setup_logging
from node.config import NodeConfig, load_config_file
from node.discovery import find_role, provide_forever, role_key
from node.host import Swarm
from node.rpc import request
from node.runtime import run_node
from node.weights.server import WeightServer
from node.weights.store import ChunkStore
from node.weights.sync import WeightSync
from protocols import rollouts
from protocols.errors import RemoteError


class LyingStore:
    """Claims every chunk of every manifest it knows, and returns random bytes for each."""

    def __init__(self, store: ChunkStore) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def bitfield(self, manifest) -> bytes:
        n = len(manifest.all_chunks())
        return bytes([0xFF]) * ((n + 7) // 8)

    def read(self, h: bytes) -> bytes:
        real = self._store.read(h)
        return os.urandom(len(real) if real else 4096)


class CorruptSeeder:
    name = "sampler"

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.store = ChunkStore(config.data_dir / "store")
        self.server = WeightServer(LyingStore(self.store))  # type: ignore[arg-type]

    def register(self, swarm: Swarm) -> None:
        self.server.register(swarm.host)

        async def keep(version: int, path: Path) -> None:
            pass

        assert self.config.trainer_id is not None
        self.sync = WeightSync(swarm, self.store, swarm.gossip, self.config.swarm, self.config.trainer_id, keep)

    async def run(self, swarm: Swarm) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.sync.run)
            nursery.start_soon(provide_forever, swarm, role_key(self.config.swarm, "sampler"), 5.0)

    def status(self) -> dict[str, Any]:
        return {"mode": "corrupt", "garbage_bytes_served": self.server.bytes_served}


class Flooder:
    name = "sampler"

    def __init__(self, config: NodeConfig, concurrency: int = 16) -> None:
        self.config = config
        self.concurrency = concurrency
        self.replies: dict[str, int] = {}

    def register(self, swarm: Swarm) -> None:
        pass

    async def run(self, swarm: Swarm) -> None:
        key = role_key(self.config.swarm, "trainer")
        while not any(i.peer_id == self.config.trainer_id for i in await find_role(swarm, key)):
            await trio.sleep(1.0)
        junk = msgpack.unpackb(msgpack.packb({"v": 1, "t": "rollouts", "group_id": "f" * 16, "samples": []}))

        async def flood() -> None:
            while True:
                try:
                    await request(
                        swarm.host,
                        self.config.trainer_id,
                        rollouts.PROTOCOL_ID,
                        junk,
                        max_request=rollouts.MAX_FRAME,
                        max_reply=rollouts.MAX_ACK_FRAME,
                        timeout=10,
                    )
                    code = "accepted"
                except RemoteError as exc:
                    code = exc.code
                except Exception as exc:
                    code = type(exc).__name__
                    await trio.sleep(0.2)
                self.replies[code] = self.replies.get(code, 0) + 1

        async with trio.open_nursery() as nursery:
            for _ in range(self.concurrency):
                nursery.start_soon(flood)

    def status(self) -> dict[str, Any]:
        return {"mode": "flood", "replies": dict(self.replies), "sent": sum(self.replies.values())}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["corrupt", "flood"], required=True)
    p.add_argument("--config", type=Path, required=True)
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--listen", required=True)
    args = p.parse_args()
    setup_logging(verbose=False)
    config = NodeConfig(
        role="sampler",
        data_dir=args.data_dir,
        listen=multiaddr.Multiaddr(args.listen),
        provide_interval=5.0,
        status_interval=1.0,
        **load_config_file(args.config),
    )
    role = CorruptSeeder(config) if args.mode == "corrupt" else Flooder(config)
    trio.run(run_node, config, role)


if __name__ == "__main__":
    main()
