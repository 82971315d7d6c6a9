"""Trainer role: provides the trainer key, hands out work leases, verifies and buffers rollouts."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
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
from trainer.checkpoint import load_checkpoint, save_checkpoint
from trainer.evaluate import evaluate
from trainer.grpo import LossConfig, has_signal
from trainer.journal import RolloutJournal
from trainer.leases import LeaseBook
from trainer.metrics import append_jsonl, plot_curve, read_jsonl
from trainer.policy import load_model, load_tokenizer
from trainer.publish import Publisher
from trainer.ratelimit import PeerRateLimiter
from trainer.scorer import Scorer
from trainer.settings import TrainerSettings
from trainer.step import train_step
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
        torch.manual_seed(settings.seed)
        torch.set_num_threads(settings.torch_threads)
        self.model = load_model(self.model_dir).eval()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=settings.lr, betas=(0.9, 0.99), weight_decay=0.0)
        self.loss_cfg = LossConfig(settings.clip_low, settings.clip_high, settings.tis_cap, settings.kl_beta)
        self.ref_model = load_model(self.model_dir).eval() if settings.kl_beta > 0 else None
        self.version = 0
        self.step = 0
        self.busy_seconds = 0.0
        self.started_at: float | None = None
        self.zero_signal_groups = 0
        self.last_metrics: dict[str, float] = {}
        self.metrics_path = data_dir / "metrics.jsonl"
        self.checkpoint_path = data_dir / "trainer.ckpt"
        self.finished = trio.Event()
        eos = self.tokenizer.eos_token_id
        self.eos_ids = (eos,) if eos is not None else ()
        bos = self.tokenizer.bos_token_id
        self.encode = lambda text: ([bos] if bos is not None else []) + self.tokenizer.encode(text)
        self.decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False)
        sampling = SamplingParams(settings.temperature, settings.top_p, settings.max_tokens)
        self.leases = LeaseBook(
            self.task, self.encode, settings.group_size, sampling, settings.lease_ttl,
            max_staleness=settings.max_staleness,
        )  # fmt: skip
        self.journal = RolloutJournal(data_dir / "journal")
        self.buffer = RolloutBuffer(journal=self.journal)
        self.groups_trained = 0
        self._pending: list = []
        self.work_limit = PeerRateLimiter(settings.work_rate, settings.work_burst)
        self.rollout_limit = PeerRateLimiter(settings.rollout_rate, settings.rollout_burst)
        resumed = load_checkpoint(self.checkpoint_path)
        if resumed is not None:
            self.model.load_state_dict(resumed["model"])
            self.optimizer.load_state_dict(resumed["optimizer"])
            self.version, self.step = resumed["version"], resumed["step"]
            self.leases.next_seed = resumed["next_seed"]
            self._restore_ledger(resumed.get("ledger", {}))
            log.info("resumed from %s at step %d, version %d", self.checkpoint_path, self.step, self.version)
        self._replay_journal(resumed.get("journal_epoch", 0) if resumed else 0)
        self.store = ChunkStore(data_dir / "store")
        published = self.store.latest()
        if published is not None and published[2].version > self.version:
            # Published after the last checkpoint, then lost in a crash: never reuse a version number.
            self.version = published[2].version + 1
            log.info(
                "versions up to %d were published before a restart; continuing as version %d",
                published[2].version,
                self.version,
            )
        self.scorer = Scorer(self.model_dir, keep=settings.max_staleness + 1)
        self.scorer.remember(self.version, self.model.state_dict())
        self.verifier = RolloutVerifier(
            self.task, self.leases, self.buffer, self.scorer, self.decode, self.eos_ids, settings.max_staleness
        )
        self.weight_server = WeightServer(self.store, super_seed=True)
        self.chunk_size = chunk_size
        self.encoding = encoding
        self.announce_interval = announce_interval
        self.published: tuple[int, bytes] | None = None  # (version, manifest id)

    # -- nothing accepted is lost: the ledger of every accepted group's fate, and the journal behind it -----
    def ledger(self) -> dict[str, Any]:
        return {
            "groups_accepted": self.buffer.groups_accepted,
            "rollouts_accepted": self.buffer.accepted,
            "accepted_by_peer": dict(self.buffer.accepted_by_peer),
            "groups_trained": self.groups_trained,
            "groups_stale": self.buffer.dropped_stale,
            "groups_no_signal": self.zero_signal_groups,
        }

    def _restore_ledger(self, ledger: dict[str, Any]) -> None:
        self.buffer.groups_accepted = ledger.get("groups_accepted", 0)
        self.buffer.accepted = ledger.get("rollouts_accepted", 0)
        self.buffer.accepted_by_peer = dict(ledger.get("accepted_by_peer", {}))
        self.groups_trained = ledger.get("groups_trained", 0)
        self.buffer.dropped_stale = ledger.get("groups_stale", 0)
        self.zero_signal_groups = ledger.get("groups_no_signal", 0)

    def _replay_journal(self, epoch: int) -> None:
        """Put back what the checkpoint had buffered and everything accepted after it, then start a segment."""
        snapshot, new = self.journal.replay(epoch)
        for group, ids in snapshot:
            self.buffer.restore(group, ids, count=False)
        for group, ids in new:
            self.buffer.restore(group, ids, count=True)
        if snapshot or new:
            log.info("journal: %d buffered and %d newer accepted groups restored", len(snapshot), len(new))
        # appends go to a fresh segment after every existing one: earlier segments stay as they are until a
        # checkpoint supersedes them (a later replay still needs their records)
        self.journal.start_segment(max(epoch, self.journal.last_epoch()) + 1, [])

    async def checkpoint(self) -> None:
        """Cut a journal segment (in the event loop, so no accept can slip between it and the ledger), then
        write the checkpoint that names it off the loop, then drop the segments it supersedes."""
        epoch = self.journal.epoch + 1
        self.journal.start_segment(epoch, self.buffer.snapshot())
        ledger = self.ledger()
        await trio.to_thread.run_sync(self.save, epoch, ledger)
        self.journal.drop_before(epoch)

    # -- protocol handlers -------------------------------------------------------------------------
    async def on_work(self, message: dict[str, Any], remote: ID) -> dict[str, Any]:
        req = WorkRequest.from_wire(message)
        if str(remote) in self.verifier.peers.banned:
            raise Banned("this peer is banned for forged rollouts")
        self.work_limit.take(str(remote))
        n = min(req.max_groups, self.settings.groups_per_lease)
        return self.leases.issue(str(remote), n, self.version).to_wire()

    async def on_rollouts(self, message: dict[str, Any], remote: ID) -> dict[str, Any]:
        self.rollout_limit.take(str(remote))  # before any checking: a flood costs only this
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
            nursery.start_soon(self._train_forever)
            await self.finished.wait()
            await trio.sleep(self.settings.linger_after_finish)
            nursery.cancel_scope.cancel()

    # -- training ----------------------------------------------------------------------------------------
    async def _train_forever(self) -> None:
        """Train whenever the buffer holds a batch; never wait on any one sampler."""
        s = self.settings
        if self.step == 0:
            await self._evaluate()
        while s.max_steps is None or self.step < s.max_steps:
            groups = await self._next_batch()
            t0 = time.monotonic()
            metrics = await trio.to_thread.run_sync(
                train_step, self.model, self.optimizer, groups, self.loss_cfg, s.grad_clip, self.version, self.ref_model
            )
            self.busy_seconds += time.monotonic() - t0
            self.step += 1
            self.groups_trained += len(groups)
            self._pending = []
            if self.step % s.publish_every == 0:
                self.version += 1
                self.scorer.remember(self.version, self.model.state_dict())
                await self.publish()
            wall = time.monotonic() - (self.started_at or t0)
            self.last_metrics = {**metrics, "busy_fraction": self.busy_seconds / max(wall, 1e-9)}
            self._record(
                {
                    "step": self.step,
                    "version": self.version,
                    **self.last_metrics,
                    "stale_dropped": self.buffer.dropped_stale,
                    "zero_signal_groups": self.zero_signal_groups,
                    "rollouts_accepted": self.buffer.accepted,
                    "forged": self.verifier.forged,
                }
            )
            if self.step % s.eval_every == 0:
                await self._evaluate()
            if self.step % s.checkpoint_every == 0:
                await self.checkpoint()
        await self.checkpoint()
        self.finished.set()

    async def _next_batch(self) -> list:
        """Wait for ``batch_groups`` usable groups (fresh enough, with reward variance)."""
        batch: list = []
        self._pending = batch  # taken from the buffer but not trained yet: still counted as buffered
        while len(batch) < self.settings.batch_groups:
            taken = self.buffer.take(self.settings.batch_groups - len(batch), self.version, self.settings.max_staleness)
            if self.started_at is None and taken:
                self.started_at = time.monotonic()
            for g in taken:
                if has_signal(g.rewards):
                    batch.append(g)
                else:
                    self.zero_signal_groups += 1
            if len(batch) < self.settings.batch_groups:
                await trio.sleep(0.02)
        return batch

    async def _evaluate(self) -> None:
        result = await trio.to_thread.run_sync(
            lambda: evaluate(
                self.model,
                self.task,
                self.encode,
                self.decode,
                self.eos_ids,
                self.settings.eval_size,
                self.settings.max_tokens,
            )
        )
        self.last_metrics.update(result)
        self._record({"step": self.step, "version": self.version, **result})
        log.info("step %d eval reward %.3f accuracy %.3f", self.step, result["eval_reward"], result["eval_accuracy"])
        await trio.to_thread.run_sync(plot_curve, read_jsonl(self.metrics_path), self.data_dir / "reward_curve.png")

    def _record(self, record: dict) -> None:
        append_jsonl(self.metrics_path, {"time": time.time(), **record})

    def save(self, journal_epoch: int, ledger: dict[str, Any]) -> None:
        save_checkpoint(
            self.checkpoint_path,
            model=self.model.state_dict(),
            optimizer=self.optimizer.state_dict(),
            version=self.version,
            step=self.step,
            next_seed=self.leases.next_seed,
            journal_epoch=journal_epoch,
            ledger=ledger,
        )

    def status(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "step": self.step,
            **{
                k: round(v, 4)
                for k, v in self.last_metrics.items()
                if k in ("reward", "eval_reward", "eval_accuracy", "busy_fraction")
            },
            "leases_issued": self.leases.issued,
            **self.ledger(),  # rollouts and groups accepted (per peer too), and every accepted group's fate
            "groups_buffered": len(self.buffer) + len(self._pending),
            "groups_rejected": self.verifier.rejected,
            "groups_forged": self.verifier.forged,
            "banned": len(self.verifier.peers.banned),
            "rate_limited": sum(self.rollout_limit.refused.values()) + sum(self.work_limit.refused.values()),
            "bytes_uploaded": self.weight_server.bytes_served,
        }
