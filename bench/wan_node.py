"""One node of bench/wan, run inside a lab namespace: the product's weight stack without sampling or training.

``origin``: the trainer's side: publishes the model as version 0, then a new version (every tensor perturbed,
so every weight chunk is new) each time the driver writes ``<root>/publish``; super-seeds, and sends each version
out through the trainer role's own outbox (stage, publish, announce by gossip and again every 2 s). ``fetch``: a
sampler's side: a real WeightSync (gossip, signed manifests, rarest-first chunk swarming), discovery through the
DHT, and a record of when each version became usable. In ``naive`` mode (``<root>/mode`` says so) a fetcher
downloads from the origin alone.

``--delta`` (the origin): versions are bf16 and travel as sparse patches of their parent, except in ``full`` mode,
where the version is shipped whole (no patch). Each new version is one step of ``--delta-lr`` per fp32 master weight
(the size of Adam's first step), or, with ``--versions DIR``, the model dirs ``DIR/v0``, ``DIR/v1``, ... published
in turn (real trained versions, bench/delta.py). Mode ``warmup`` publishes a patch the driver does not count (the
piece size follows the last patch's size: this gives it one); mode ``nopush`` publishes a patch without push, in
chunks of the configured size (the baseline, interleaved with push rounds). Unless ``--no-push``, the origin
pushes each small version to the samplers as it announces it (node/weights/server.py, OriginPush), and pieces are
sized for that.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import multiaddr
import torch
import trio
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID

from node.config import NodeConfig
from node.discovery import find_role, provide_forever, role_key
from node.host import Swarm
from node.runtime import run_node
from node.settings import WeightSettings, load_config_file
from node.weights.chain import Step
from node.weights.outbox import Outbox
from node.weights.patch import WeightChanges
from node.weights.publish import Publisher
from node.weights.server import OriginPush, WeightServer
from node.weights.store import ChunkStore
from node.weights.sync import WeightSync, swarm_peers
from protocols.weights import Manifest
from trainer.model import load_model, save_model_dir

PATCH_FRACTION = WeightSettings().patch_max_fraction  # the product's default
WHOLE = 1e-12  # a patch_max_fraction no patch fits under: the version is shipped whole


class Origin:
    name = "trainer"

    def __init__(
        self,
        config: NodeConfig,
        model_dir: Path,
        root: Path,
        delta: bool = False,
        delta_lr: float = 1e-6,
        versions: Path | None = None,
        chunk_size: int = 1 << 20,
        push: bool = True,
    ) -> None:
        self.config, self.model_dir, self.root, self.push = config, model_dir, root, push
        self.delta, self.delta_lr, self.versions, self.chunk_size = delta, delta_lr, versions, chunk_size
        self.store = ChunkStore(config.data_dir / "store")
        self.server = WeightServer(self.store, origin=True)
        self.model = load_model(model_dir) if versions is None else None
        self.version = -1
        self.published: dict[int, dict[str, Any]] = {}

    def register(self, swarm: Swarm) -> None:
        self.server.register(swarm.host)
        key = KeyPair(swarm.host.get_private_key(), swarm.host.get_public_key())
        if self.delta:
            self.publisher = Publisher(
                self.store,
                key,
                self.config.swarm,
                chunk_size=self.chunk_size,
                anchor_every=1 << 20,
                patch_max_fraction=PATCH_FRACTION,
            )
        else:
            self.publisher = Publisher(self.store, key, self.config.swarm, chunk_size=self.chunk_size)
        self.outbox = Outbox(
            self.publisher,
            self.stage,
            swarm.gossip,
            self.config.swarm,
            on_published=self.note,
            pusher=OriginPush(self.server) if self.push else None,
        )
        self.pusher = self.outbox.pusher

    def stage(self, version: int, staging: Path) -> Path:
        """Blocking: write ``version``'s model dir at ``staging``, where the publisher takes it."""
        if self.versions is not None:
            source = self.versions / f"v{version}"
            if not source.is_dir():
                raise SystemExit(f"no model dir {source} to publish as version {version}")
            shutil.rmtree(staging, ignore_errors=True)
            return Path(shutil.copytree(source, staging))
        assert self.model is not None
        if version:
            with torch.no_grad():
                for p in self.model.parameters():
                    if self.delta:  # Adam's first step: every weight moves by lr, either way
                        p.add_(torch.randn_like(p).sign() * self.delta_lr)
                    else:  # every chunk new
                        p.add_(torch.randn_like(p) * 1e-3)
        dtype = torch.bfloat16 if self.delta else torch.float32
        return save_model_dir(self.model, staging, self.model_dir, dtype)

    def note(self, version: int, manifest: Manifest) -> None:
        """A version is published (and about to be announced): the driver reads when, and what it weighs."""
        self.published[version] = {
            "time": time.time(),
            "bytes": manifest.total_size,
            "update_bytes": manifest.update_size,
            "patch": manifest.patch is not None,
            "chunk_size": manifest.chunk_size,
            "chunks": len(manifest.patch.chunks) if manifest.patch is not None else len(manifest.all_chunks()),
        }
        tmp = self.root / "published.json.tmp"  # replaced whole: bench/wan.py reads it while versions go out
        tmp.write_text(json.dumps(self.published))
        os.replace(tmp, self.root / "published.json")
        self.version = version

    async def publish(self) -> None:
        mode_file = self.root / "mode"
        mode = mode_file.read_text() if mode_file.exists() else ""
        # the naive baseline gets a plain server: super-seeding only pays when peers re-serve
        self.server.origin = mode != "naive"
        if self.delta:
            self.publisher.patch_max_fraction = WHOLE if mode == "full" else PATCH_FRACTION
        if mode == "nopush":  # the baseline beside push rounds: announce only, chunks of the configured size
            self.outbox.pusher = None
            self.publisher.chunk_size = self.chunk_size
        else:
            self.outbox.pusher = self.pusher
        await self.outbox.send(self.version + 1)

    async def run(self, swarm: Swarm) -> None:
        await self.publish()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(provide_forever, swarm, role_key(self.config.swarm, "trainer"), 3.0)
            nursery.start_soon(self.outbox.announce_forever, 2.0)
            trigger = self.root / "publish"
            while True:
                if trigger.exists():
                    trigger.unlink()
                    await self.publish()
                await trio.sleep(0.05)

    def status(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "bytes_uploaded": self.server.bytes_served,
            "bytes_pushed": self.server.bytes_pushed,
        }


class Fetcher:
    name = "sampler"

    def __init__(self, config: NodeConfig, root: Path) -> None:
        self.config, self.root = config, root
        self.store = ChunkStore(config.data_dir / "store")
        self.server = WeightServer(self.store)
        self.got: dict[int, float] = {}
        # per version, wall-clock times: its manifest accepted ("heard"), its chunks all here ("fetched"), its
        # model dir built and verified ("built"); "got" is when it became usable
        self.phases: dict[int, dict[str, float]] = {}

    def register(self, swarm: Swarm) -> None:
        self.server.register(swarm.host)

        async def installed(version: int, path: Path, changes: WeightChanges | None) -> None:
            self.got[version] = now = time.time()
            heard = self.sync.heard_at.get(version)
            if heard is not None:
                self.phases.setdefault(version, {})["heard"] = now - (time.monotonic() - heard)

        assert self.config.trainer_id is not None
        trainer = self.config.trainer_id
        everyone, mode = swarm_peers(swarm), self.root / "mode"

        def peers() -> list[ID]:
            return [trainer] if mode.exists() and mode.read_text() == "naive" else everyone()

        self.sync = WeightSync(swarm, self.store, swarm.gossip, self.config.swarm, trainer, installed, peers=peers)
        build = self.sync.build

        def timed_build(steps: list[Step]) -> tuple[Path, WeightChanges | None]:  # a worker thread, all chunks here
            phases = self.phases.setdefault(steps[-1].manifest.version, {})
            phases["fetched"] = time.time()
            try:
                return build(steps)
            finally:
                phases["built"] = time.time()

        self.sync.build = timed_build  # type: ignore[method-assign]

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
        return {
            "got": {str(k): v for k, v in self.got.items()},
            "phases": {str(k): v for k, v in self.phases.items()},
            "bytes_uploaded": self.server.bytes_served,
            "push": {"took": self.sync.pushed_chunks, "relayed": self.sync.relayed_chunks},
        }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["origin", "fetch"])
    p.add_argument("--config", type=Path, required=True)
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--listen", required=True)
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--model", type=Path)
    p.add_argument("--delta", action="store_true", help="origin: bf16 versions as patches (full mode: whole)")
    p.add_argument("--delta-lr", type=float, default=1e-6, help="origin, --delta: each version's step per weight")
    p.add_argument("--versions", type=Path, help="origin, --delta: publish DIR/v0, DIR/v1, ... in turn")
    p.add_argument("--chunk-size", type=int, default=1 << 20, help="origin: largest chunk in bytes")
    p.add_argument("--no-push", action="store_true", help="origin: announce only (the baseline: no push)")
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
    if args.role == "origin":
        role: Origin | Fetcher = Origin(
            config, args.model, args.root, args.delta, args.delta_lr, args.versions, args.chunk_size, not args.no_push
        )
    else:
        role = Fetcher(config, args.root)
    trio.run(run_node, config, role)


if __name__ == "__main__":
    main()
