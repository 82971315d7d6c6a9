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

``--replay DIR`` (the origin): versions published beforehand by bench/delta_shaped.py ``--keep DIR`` (a 1.5B-shaped
int8-grid chain, signed with DIR/origin.key, this node's identity) go out one per trigger, as the trainer's Outbox
sends a version it has just published: announced with their encoding, pushed, served. ``--seed DIR`` (a fetcher):
start from DIR's sampler store, which holds version 0 built; ``--encoding``: the one the fetcher runs;
``--deliver-only``: a version counts when every chunk of its route is here, each checked against its hash as it
arrived; its rebuild (a 1.7 GB file per version at 1.5B, measured on one node by bench/delta_shaped.py) is not
repeated by every sampler of one box: its model dir is its parent's, relinked.
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
import trio
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID

from node.config import NodeConfig
from node.discovery import find_role, next_look, provide_forever, role_key
from node.host import Swarm
from node.runtime import run_node
from node.settings import WeightSettings, load_config_file
from node.weights.chain import Step
from node.weights.grid import GRID_ENCODING
from node.weights.outbox import Outbox
from node.weights.patch import WeightChanges
from node.weights.publish import Publisher
from node.weights.server import OriginPush, WeightServer
from node.weights.store import ChunkStore
from node.weights.sync import WeightSync, swarm_peers
from protocols.weights import DEFAULT_ENCODING, Manifest, SignedManifest

PATCH_FRACTION = WeightSettings().patch_max_fraction  # the product's default
WHOLE = 1e-12  # a patch_max_fraction no patch fits under: the version is shipped whole


class Replayed:
    """The publisher of versions published beforehand (``--replay``): ``publish`` hands out the kept version."""

    def __init__(self, store: ChunkStore, encoding: str = GRID_ENCODING) -> None:
        self.store, self.encoding, self.last_stats = store, encoding, None
        self.versions = {m.version: mid for mid, m in store.manifests() if m.encoding == encoding}
        self.chunk_size = 0  # the pieces were cut when the versions were published

    def staging_dir(self, version: int) -> Path:
        return self.store.root / f"replay-v{version}"

    def publish(self, model_dir: Path, version: int) -> tuple[bytes, SignedManifest, Manifest]:
        shutil.rmtree(model_dir, ignore_errors=True)
        if version not in self.versions:
            raise SystemExit(f"no kept version {version} in {self.store.root} (it holds {sorted(self.versions)})")
        mid = self.versions[version]
        kept = self.store.manifest(mid)
        assert kept is not None
        return mid, kept[0], kept[1]


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
        replay: Path | None = None,
        uplink: float = 0.0,
    ) -> None:
        self.config, self.model_dir, self.root, self.push = config, model_dir, root, push
        self.delta, self.delta_lr, self.versions, self.chunk_size = delta, delta_lr, versions, chunk_size
        self.replay, self.uplink = replay, uplink
        self.store = ChunkStore(replay / "trainer" if replay is not None else config.data_dir / "store")
        self.server = WeightServer(self.store, origin=True)
        self.model = None
        if versions is None and replay is None:
            from trainer.model import load_model  # torch: ~7 CPU-s to import, so only the origin that trains loads it

            self.model = load_model(model_dir)
        self.version = -1
        self.published: dict[int, dict[str, Any]] = {}

    def register(self, swarm: Swarm) -> None:
        self.server.register(swarm.host)
        key = KeyPair(swarm.host.get_private_key(), swarm.host.get_public_key())
        if self.replay is not None:
            self.publisher: Publisher | Replayed = Replayed(self.store)
        elif self.delta:
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
            self.publisher,  # type: ignore[arg-type]
            self.stage,
            swarm.gossip,
            self.config.swarm,
            on_published=self.note,
            pusher=OriginPush(self.server, self.uplink) if self.push else None,
        )
        self.pusher = self.outbox.pusher

    def stage(self, version: int, staging: Path) -> Path:
        """Blocking: write ``version``'s model dir at ``staging``, where the publisher takes it."""
        if self.replay is not None:  # published already
            staging.mkdir(parents=True, exist_ok=True)
            return staging
        if self.versions is not None:
            source = self.versions / f"v{version}"
            if not source.is_dir():
                raise SystemExit(f"no model dir {source} to publish as version {version}")
            shutil.rmtree(staging, ignore_errors=True)
            return Path(shutil.copytree(source, staging))
        import torch

        from trainer.model import save_model_dir

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
        if self.delta and isinstance(self.publisher, Publisher):
            self.publisher.patch_max_fraction = WHOLE if mode == "full" else PATCH_FRACTION
        if mode == "nopush":  # the baseline beside push rounds: announce only, chunks of the configured size
            self.outbox.pusher = None
            if isinstance(self.publisher, Publisher):
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

    def __init__(
        self,
        config: NodeConfig,
        root: Path,
        seed: Path | None = None,
        encoding: str = DEFAULT_ENCODING,
        deliver_only: bool = False,
    ) -> None:
        self.config, self.root, self.encoding, self.deliver_only = config, root, encoding, deliver_only
        if seed is not None and not (config.data_dir / "store").exists():  # hard links: 14 samplers, one copy
            shutil.copytree(seed / "sampler", config.data_dir / "store", copy_function=os.link)
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

        self.sync = WeightSync(
            swarm, self.store, swarm.gossip, self.config.swarm, trainer, installed, peers=peers, encoding=self.encoding
        )
        build = self.relink if self.deliver_only else self.sync.build

        def timed_build(steps: list[Step]) -> tuple[Path, WeightChanges | None]:  # a worker thread, all chunks here
            phases = self.phases.setdefault(steps[-1].manifest.version, {})
            phases["fetched"] = time.time()
            try:
                return build(steps)
            finally:
                phases["built"] = time.time()

        self.sync.build = timed_build  # type: ignore[method-assign]

    def relink(self, steps: list[Step]) -> tuple[Path, WeightChanges | None]:
        """``--deliver-only``'s build: every chunk is here and verified; the version's dir is the newest built one's,
        relinked (see the module docstring)."""
        m = steps[-1].manifest
        here = self.store.built(m)
        if here is not None:  # built already (version 0, from the seed)
            return here, None
        done = self.store.versions_dir
        built = [d for d in done.glob("v*") if (d / ".complete").exists() and d.name[1:].isdigit()]
        parent = max(built, key=lambda d: int(d.name[1:]))
        out, tmp = done / f"v{m.version}", done / f"v{m.version}.relink"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(parent, tmp, copy_function=os.link)
        (tmp / ".complete").unlink()
        (tmp / ".complete").write_text(f"{m.version} {m.encoding}")
        os.replace(tmp, out)
        return out, None

    async def run(self, swarm: Swarm) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.sync.run)
            key = role_key(self.config.swarm, "sampler")
            nursery.start_soon(provide_forever, swarm, key, 3.0)
            known: set[ID] = set()
            quiet = 0
            while True:  # the product's sampler cadence: looks slow down while they teach nothing (next_look)
                found = await find_role(swarm, key)
                for info in found:
                    try:
                        await swarm.connect(info)
                    except Exception:
                        pass
                new = {info.peer_id for info in found} - known
                known |= new
                quiet = 0 if new else quiet + 1
                await trio.sleep(next_look(2.0, quiet))

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
    p.add_argument("--uplink-mbps", type=float, default=0.0, help="origin: its uplink, for the push's copies")
    p.add_argument("--replay", type=Path, help="origin: send bench/delta_shaped.py --keep DIR's versions")
    p.add_argument("--seed", type=Path, help="fetcher: start from DIR's sampler store (bench/delta_shaped.py --keep)")
    p.add_argument("--encoding", default=DEFAULT_ENCODING, help="fetcher: the encoding its engine runs")
    p.add_argument("--deliver-only", action="store_true", help="fetcher: a version counts once all its chunks are here")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    config = NodeConfig(
        role=args.role,
        data_dir=args.data_dir,
        listen=multiaddr.Multiaddr(args.listen),
        provide_interval=3.0,
        # the driver reads "got" times, taken as each version arrived, not when the file was written: a sampler's
        # status every 2 s (0.5 s took 7% of its CPU while a version arrived, on a box the lab's CPU binds)
        status_interval=0.5 if args.role == "origin" else 2.0,
        **load_config_file(args.config),
    )
    if args.role == "origin":
        role: Origin | Fetcher = Origin(
            config, args.model, args.root, args.delta, args.delta_lr, args.versions, args.chunk_size, not args.no_push,
            args.replay, args.uplink_mbps * 1e6 / 8,
        )  # fmt: skip
    else:
        role = Fetcher(config, args.root, args.seed, args.encoding, args.deliver_only)
    trio.run(run_node, config, role)


if __name__ == "__main__":
    main()
