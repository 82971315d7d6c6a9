"""Trainer role: provides the trainer key, hands out work leases, verifies and buffers rollouts."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import trio
from libp2p.peer.id import ID

from node.discovery import provide_forever, role_key
from node.host import Swarm
from node.rpc import serve
from node.weights.gossip import announce_topic
from node.weights.server import WeightServer
from node.weights.store import ChunkStore
from protocols import rollouts, work
from protocols import weights as weights_proto
from protocols.errors import ProtocolError
from protocols.rollouts import RolloutGroup
from protocols.work import SamplingParams, WorkRequest
from trainer.buffer import RolloutBuffer
from trainer.leases import LeaseBook
from trainer.policy import load_model, load_tokenizer
from trainer.publish import Publisher
from trainer.scorer import Scorer
from trainer.settings import TrainerSettings
from trainer.tasks import load_task
from trainer.tiny_model import build_tiny_model
from trainer.verify import RolloutVerifier

log = logging.getLogger(__name__)


class Banned(ProtocolError):
    code = "banned"


def resolve_model_dir(model_dir: Path | None, data_dir: Path) -> Path:
    """The given checkpoint, or the embedded tiny model built (once, deterministically) under data_dir."""
    if model_dir is not None:
        return Path(model_dir)
    path = data_dir / "tiny-model"
    if not (path / "config.json").exists():
        build_tiny_model(path)
    return path


class TrainerRole:
    name = "trainer"

    def __init__(
        self,
        swarm_name: str,
        data_dir: Path,
        settings: TrainerSettings,
        provide_interval: float,
        chunk_size: int = 1 << 20,
        encoding: str = "fp32",
        announce_interval: float = 2.0,
    ) -> None:
        self.swarm_name = swarm_name
        self.data_dir = data_dir
        self.settings = settings
        self.provide_interval = provide_interval
        self.model_dir = resolve_model_dir(settings.model_dir, data_dir)
        self.task = load_task(settings.task)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.model = load_model(self.model_dir)
        self.version = 0
        eos = self.tokenizer.eos_token_id
        self.eos_ids = (eos,) if eos is not None else ()
        bos = self.tokenizer.bos_token_id
        self.encode = lambda text: ([bos] if bos is not None else []) + self.tokenizer.encode(text)
        self.decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False)
        sampling = SamplingParams(settings.temperature, settings.top_p, settings.max_tokens)
        self.leases = LeaseBook(self.task, self.encode, settings.group_size, sampling, settings.lease_ttl)
        self.buffer = RolloutBuffer()
        self.scorer = Scorer(self.model_dir, keep=settings.max_staleness + 1)
        self.scorer.remember(0, self.model.state_dict())
        self.verifier = RolloutVerifier(
            self.task, self.leases, self.buffer, self.scorer, self.decode, self.eos_ids, settings.max_staleness
        )
        self.store = ChunkStore(data_dir / "store")
        self.weight_server = WeightServer(self.store, super_seed=True)
        self.chunk_size = chunk_size
        self.encoding = encoding
        self.announce_interval = announce_interval
        self.published: tuple[int, bytes] | None = None  # (version, manifest id)

    # -- protocol handlers -------------------------------------------------------------------------
    async def on_work(self, message: dict[str, Any], remote: ID) -> dict[str, Any]:
        req = WorkRequest.from_wire(message)
        if str(remote) in self.verifier.peers.banned:
            raise Banned("this peer is banned for forged rollouts")
        n = min(req.max_groups, self.settings.groups_per_lease)
        return self.leases.issue(str(remote), n, self.version).to_wire()

    async def on_rollouts(self, message: dict[str, Any], remote: ID) -> dict[str, Any]:
        group = RolloutGroup.from_wire(message)
        ack = await self.verifier.verify(group, str(remote), self.version)
        return ack.to_wire()

    def register(self, swarm: Swarm) -> None:
        from libp2p.crypto.keys import KeyPair

        self.swarm = swarm
        key_pair = KeyPair(swarm.host.get_private_key(), swarm.host.get_public_key())
        self.publisher = Publisher(
            self.store, key_pair, self.swarm_name, self.model_dir, self.chunk_size, self.encoding
        )
        self.weight_server.register(swarm.host)
        swarm.host.set_stream_handler(work.PROTOCOL_ID, serve("work", self.on_work, work.MAX_FRAME, work.MAX_FRAME))
        swarm.host.set_stream_handler(
            rollouts.PROTOCOL_ID,
            serve("rollouts", self.on_rollouts, rollouts.MAX_FRAME, rollouts.MAX_ACK_FRAME, timeout=120.0),
        )

    async def publish(self) -> None:
        """Publish the current weights as ``self.version`` and announce them by gossip."""
        mid, _, manifest = await trio.to_thread.run_sync(self.publisher.publish, self.model, self.version)
        self.published = (self.version, mid)
        log.info(
            "published version %d (%d chunks, %.1f MB)",
            self.version,
            len(manifest.all_chunks()),
            manifest.total_size / 1e6,
        )
        await self.announce()
        await trio.to_thread.run_sync(self.store.gc, self.settings.max_staleness + 2)

    async def announce(self) -> None:
        if self.published is not None:
            version, mid = self.published
            try:
                await self.swarm.gossip.publish(announce_topic(self.swarm_name), weights_proto.announce(version, mid))
            except Exception as exc:
                log.debug("announce failed: %s", exc)

    async def _announce_forever(self) -> None:
        while True:
            await trio.sleep(self.announce_interval)
            await self.announce()

    async def run(self, swarm: Swarm) -> None:
        await self.publish()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(provide_forever, swarm, role_key(self.swarm_name, "trainer"), self.provide_interval)
            nursery.start_soon(self._announce_forever)

    def status(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "leases_issued": self.leases.issued,
            "rollouts_accepted": self.buffer.accepted,
            "groups_buffered": len(self.buffer),
            "groups_rejected": self.verifier.rejected,
            "groups_forged": self.verifier.forged,
            "stale_dropped": self.buffer.dropped_stale,
            "banned": len(self.verifier.peers.banned),
            "bytes_uploaded": self.weight_server.bytes_served,
        }
