"""Trainer role: wires the rollout intake and the learner to the network. The loop, top to bottom:

    batch = intake.next_batch()  ->  learner.step(batch)  ->  name a version  ->  evaluate  ->  checkpoint

A named version is written, cut into chunks, signed and announced by a background task while training goes on
(the learner's next optimizer step waits only for the weights file). One version is in flight at a time: when
publishing takes longer than ``publish_every`` steps, the next version is named as soon as the last one is out
(versions coalesce; the loop never waits for the network side).

Everything else is a handler (work leases, rollouts, weights) or a background loop (DHT provide, announce).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import trio
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID

from node.config import NodeConfig
from node.dashboard import SwarmView, parse_address, serve_dashboard
from node.discovery import provide_forever, role_key
from node.host import Swarm
from node.intake import RolloutIntake
from node.metrics import append_jsonl, plot_curve, read_jsonl
from node.rpc import serve
from node.runtime import peak_rss_mb
from node.settings import Settings
from node.weights.gossip import announce_topic
from node.weights.publish import Publisher
from node.weights.server import WeightServer
from node.weights.store import ChunkStore
from protocols import rollouts, work
from protocols import weights as weights_proto
from protocols.work import WorkRequest
from trainer.base_model import build_base_model
from trainer.checkpoint import load_checkpoint, save_checkpoint
from trainer.learner import Learner
from trainer.memory import limit_malloc_arenas
from trainer.tasks import load_task

log = logging.getLogger(__name__)
T = TypeVar("T")


def resolve_model_dir(model_dir: Path | None, data_dir: Path) -> Path:
    """The given model directory, or the embedded base model pretrained (once, deterministically, ~30-60 s) under
    data_dir. A half-written one (a crash mid-build) is built again: the directory appears only when complete."""
    if model_dir is not None:
        return Path(model_dir)
    path = data_dir / "base-model"
    if not (path / "config.json").exists():
        log.info("pretraining the embedded base model into %s (once, ~30-60 s)", path)
        staging = data_dir / "base-model.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        build_base_model(staging)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(staging, path)
    return path


class TrainerRole:
    name = "trainer"

    def __init__(self, config: NodeConfig, settings: Settings) -> None:
        limit_malloc_arenas()  # the CLI did it before any thread started; here for trainers run in-process
        self.config = config
        self.settings = s = settings.trainer
        self.weights = settings.weights
        self.task = load_task(s.task, s.reward)
        model_dir = resolve_model_dir(settings.learner.model_dir, config.data_dir)
        self.learner = Learner(model_dir, settings.learner, s.max_staleness + 1, config.data_dir)
        codec = self.learner.codec
        self.intake = RolloutIntake(
            self.task,
            codec.encode_prompt,
            codec.completion_text,
            codec.eos_ids,
            self.learner.score,
            config.data_dir / "journal",
            s,
            scorer_floor={"torch.bfloat16": "none/bf16", "torch.float16": "none/fp16"}.get(
                str(self.learner.precision.compute)
            ),
            transport="wire8" if self.weights.encoding == "int8" else None,
        )
        self.checkpoint_path = config.data_dir / "trainer.ckpt"
        self.metrics_path = config.data_dir / "metrics.jsonl"
        self.store = ChunkStore(config.data_dir / "store")
        w = self.weights
        self.weight_server = WeightServer(self.store, True, w.reserve_after, w.upload_per_peer)
        self.finished = trio.Event()
        self.busy_seconds = 0.0
        self.last_metrics: dict[str, float] = {}
        self.published: tuple[int, bytes] | None = None  # (version, manifest id)
        self.publishing = False  # a named version is being written and published
        self.versions_coalesced = 0  # due versions not named because the last one was still being published
        self.view = SwarmView()
        self.history: deque[dict[str, Any]] = deque(maxlen=5000)  # recent metric records, for the dashboard
        self.dashboard_url: str | None = None
        self._verify_seen = (0.0, 0)  # (scoring seconds, tokens scored) at the last step
        self._restore()

    def _restore(self) -> None:
        # versions named before a crash: their weights files are written as they are named, before publishing
        # (which runs in the background and may not have finished)
        named = max(self.learner.scorer.found_at_start, default=-1)
        saved = load_checkpoint(self.checkpoint_path)
        if saved is not None:
            self.learner.restore(saved)
            log.info("resumed from %s at step %d, version %d", self.checkpoint_path, saved["step"], saved["version"])
        self.intake.start(saved)
        published = self.store.latest()
        last = max(named, published[2].version if published is not None else -1)
        if last > self.learner.version:
            # named or published after the last checkpoint, then lost in a crash: never reuse a version number
            self.learner.skip_to_version(last + 1)
            log.info(
                "versions up to %d were named before a restart; continuing as version %d", last, self.learner.version
            )

    # -- the network side --------------------------------------------------------------------------------
    def register(self, swarm: Swarm) -> None:
        self.swarm = swarm
        key_pair = KeyPair(swarm.host.get_private_key(), swarm.host.get_public_key())
        w = self.weights
        self.publisher = Publisher(
            self.store, key_pair, self.config.swarm, w.chunk_size, w.encoding, w.anchor_every, w.patch_max_fraction
        )
        self.weight_server.register(swarm.host)
        s, intake = self.settings, self.intake
        swarm.host.set_stream_handler(
            work.PROTOCOL_ID,
            serve("work", self.on_work, work.MAX_FRAME, work.MAX_FRAME, admit=lambda p: intake.admit_work(str(p))),
        )
        swarm.host.set_stream_handler(
            rollouts.PROTOCOL_ID,
            serve(
                "rollouts",
                self.on_rollouts,
                rollouts.frame_limit(s.group_size, s.max_tokens),
                rollouts.MAX_ACK_FRAME,
                self.config.rollout_timeout,
                admit=lambda p: intake.admit_rollouts(str(p)),
                max_containers=rollouts.max_containers(s.group_size),
            ),
        )

    async def on_work(self, message: dict[str, Any], remote: ID) -> dict[str, Any]:
        req = WorkRequest.from_wire(message)
        lease = self.intake.lease(req, str(remote), self.learner.version)
        self.view.heard(str(remote), req.report)
        return lease.to_wire()

    async def on_rollouts(self, message: dict[str, Any], remote: ID) -> dict[str, Any]:
        return (await self.intake.submit(message, str(remote), self.learner.version)).to_wire()

    async def run(self, swarm: Swarm) -> None:
        await self.publish()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                provide_forever, swarm, role_key(self.config.swarm, "trainer"), self.config.provide_interval
            )
            nursery.start_soon(self._announce_forever)
            if self.settings.dashboard != "off":
                host, port = parse_address(self.settings.dashboard)
                self.dashboard_url = await nursery.start(serve_dashboard, self.dashboard_state, host, port)
                log.info("dashboard at %s", self.dashboard_url)
            nursery.start_soon(self.train)
            await self.finished.wait()
            await trio.sleep(self.settings.linger)
            nursery.cancel_scope.cancel()

    # -- the loop ----------------------------------------------------------------------------------------
    async def train(self) -> None:
        """Train whenever the intake holds a batch; never wait on any one sampler, nor on publishing."""
        s, learner, intake = self.settings, self.learner, self.intake
        if learner.steps == 0:
            await self.evaluate()
        due, named_at = False, learner.steps
        async with trio.open_nursery() as background:
            while s.max_steps is None or learner.steps < s.max_steps:
                batch = await intake.next_batch(s.batch_groups, learner.version)
                t0 = time.monotonic()
                metrics = await self._busy(learner.step, batch)
                intake.trained(batch)
                t1 = time.monotonic()
                if learner.steps % s.publish_every == 0:
                    self.versions_coalesced += due  # the last due one was never named
                    due = True
                if due and not self.publishing:
                    due, named_at = False, learner.steps
                    self.publishing = True
                    background.start_soon(self._publish_version, learner.name_version())
                metrics |= {
                    "time_learn": t1 - t0,
                    "time_publish": time.monotonic() - t1 + metrics.pop("time_version_wait"),  # what the loop waited
                    **self._verify_time(),
                    "publish_bytes": self.last_metrics.get("publish_bytes", 0),
                }
                self.record(
                    {
                        **metrics,
                        "busy_fraction": self._busy_fraction(),
                        "forged": intake.forged,
                        "stale_dropped": intake.ledger.groups_stale,
                        "zero_signal_groups": intake.ledger.groups_no_signal,
                        "rollouts_accepted": intake.ledger.rollouts_accepted,
                        "versions_coalesced": self.versions_coalesced,
                    }
                )
                if learner.steps % s.eval_every == 0:
                    await self.evaluate()
                if learner.steps % s.checkpoint_every == 0:
                    await self.checkpoint()
        if learner.steps > named_at:  # the last steps' weights go out too: the run's final version
            await self._publish_version(learner.name_version())
        await self.checkpoint()
        self.record({"finished": True})  # the run's last record: its version is the final one, published
        self.finished.set()

    async def _publish_version(self, version: int) -> None:
        """Write a named version's weights (concurrently with the next step's forward and backward), publish them."""
        t0 = time.monotonic()
        try:
            await trio.to_thread.run_sync(self.learner.write_version, version)
            await self.publish(version)
        finally:
            self.publishing = False
        self.record({"published": version, "publish_seconds": time.monotonic() - t0, **self._publish_stats()})

    async def _busy(self, fn: Callable[..., T], *args: Any) -> T:
        """Run learner work off the event loop, counting the time as the trainer's busy time."""
        t0 = time.monotonic()
        try:
            return await trio.to_thread.run_sync(fn, *args)
        finally:
            self.busy_seconds += time.monotonic() - t0

    def _verify_time(self) -> dict[str, float]:
        """Seconds spent recomputing logprobs for verification since the last step, and the tokens scored."""
        seconds, tokens = self.intake.verifier.scoring_seconds, self.intake.verifier.scored_tokens
        (seen_s, seen_t), self._verify_seen = self._verify_seen, (seconds, tokens)
        return {"time_verify": seconds - seen_s, "verify_tokens": tokens - seen_t}

    def _busy_fraction(self) -> float:
        start = self.intake.first_accepted_at or time.monotonic()
        return self.busy_seconds / max(time.monotonic() - start, 1e-9)

    async def publish(self, version: int | None = None) -> None:
        """Publish a written version (the current one by default) and announce it by gossip."""
        version = self.learner.version if version is None else version
        staging = self.publisher.staging_dir(version)
        await trio.to_thread.run_sync(self.learner.save_model_dir, staging, version)
        mid, _, manifest = await trio.to_thread.run_sync(self.publisher.publish, staging, version)
        self.published = (version, mid)
        self.last_metrics["publish_bytes"] = manifest.update_size  # a patch's size when it travels as one
        self.view.trainer_version(version)
        log.info(
            "published version %d (%d chunks, %.1f MB%s)",
            version,
            len(manifest.all_chunks()),
            manifest.total_size / 1e6,
            f"; patch {manifest.patch.size / 1e6:.2f} MB" if manifest.patch is not None else "",
        )
        await self.announce()
        await trio.to_thread.run_sync(self.store.gc, self.settings.max_staleness + 2)

    def _publish_stats(self) -> dict[str, Any]:
        st = self.publisher.last_stats
        if st is None:
            return {}
        return {"publish_bytes": self.last_metrics.get("publish_bytes", 0), "publish_patch_seconds": st.patch_seconds}

    async def announce(self) -> None:
        if self.published is not None:
            version, mid = self.published
            try:
                await self.swarm.gossip.publish(announce_topic(self.config.swarm), weights_proto.announce(version, mid))
            except Exception as exc:
                log.debug("announce failed: %s", exc)

    async def _announce_forever(self) -> None:
        while True:
            await trio.sleep(self.weights.announce_interval)
            await self.announce()

    async def evaluate(self) -> None:
        s = self.settings
        result = await trio.to_thread.run_sync(self.learner.evaluate, self.task, s.eval_size, s.max_tokens)
        self.record(result)
        log.info(
            "step %d eval reward %.3f accuracy %.3f", self.learner.steps, result["eval_reward"], result["eval_accuracy"]
        )
        await trio.to_thread.run_sync(
            plot_curve, read_jsonl(self.metrics_path), self.config.data_dir / "reward_curve.png"
        )

    async def checkpoint(self) -> None:
        """The intake cuts its journal in the event loop; the checkpoint naming that cut is written off the loop;
        then the journal segments it supersedes are dropped."""
        intake_state = self.intake.begin_checkpoint()
        state = {**self.learner.state(), **intake_state}
        await trio.to_thread.run_sync(save_checkpoint, self.checkpoint_path, state)
        self.intake.end_checkpoint(intake_state)

    def record(self, values: dict[str, Any]) -> None:
        self.last_metrics.update(values)
        record = {
            "time": time.time(),
            "step": self.learner.steps,
            "version": self.learner.version,
            "peak_rss_mb": peak_rss_mb(),  # the high-water mark so far: where in a run memory peaks
            **values,
        }
        self.history.append(record)
        append_jsonl(self.metrics_path, record)

    def dashboard_state(self) -> dict[str, Any]:
        """Everything the dashboard page draws (node/dashboard.py)."""
        intake, now = self.intake, time.time()
        peers = set(intake.ledger.accepted_by_peer) | set(self.view.reports) | set(intake.strikes.counts)
        rows = []
        for peer in sorted(peers):
            seen, report = self.view.reports.get(peer, (None, None))
            rows.append(
                {
                    "peer_id": peer,
                    "role": "sampler",
                    "version": report.version if report else None,
                    "accepted": intake.ledger.accepted_by_peer.get(peer, 0),
                    "refused": intake.refused_by_peer.get(peer, 0),
                    "strikes": intake.strikes.counts.get(peer, 0),
                    "banned": intake.strikes.is_banned(peer),
                    "bytes_served": report.bytes_served if report else None,
                    "engine": report.engine if report else None,
                    "report_age": round(now - seen, 1) if seen else None,
                }
            )
        me = str(self.swarm.peer_id)
        trainer_row = {
            "peer_id": me,
            "role": "trainer",
            "version": self.learner.version,
            "accepted": 0,
            "refused": 0,
            "strikes": 0,
            "banned": False,
            "bytes_served": self.weight_server.bytes_served,
            "engine": "learner",
            "report_age": 0.0,
        }
        curve_keys = ("step", "reward", "eval_reward", "eval_accuracy", "busy_fraction")
        return {
            "swarm": self.config.swarm,
            "trainer": {"peer_id": me, **self.status()},
            "peers": [trainer_row, *rows],
            "versions": {who: list(points) for who, points in self.view.timelines.items()},
            "curves": [{k: r[k] for k in curve_keys if k in r} for r in self.history],
        }

    def status(self) -> dict[str, Any]:
        shown = ("reward", "eval_reward", "eval_accuracy", "busy_fraction")
        return {
            "version": self.learner.version,
            "step": self.learner.steps,
            "finished": self.finished.is_set(),  # --max-steps reached, the final version published: ``version``
            **{k: round(v, 4) for k, v in self.last_metrics.items() if k in shown},
            **self.intake.status(),
            "bytes_uploaded": self.weight_server.bytes_served,
            **({"dashboard": self.dashboard_url} if self.dashboard_url else {}),
        }
