"""Trainer role: wires the rollout intake and the learner to the network. The loop, top to bottom:

    batch = intake.next_batch()  ->  learner.step(batch)  ->  name a version  ->  evaluate  ->  checkpoint

A named version is written, cut into chunks, signed and announced by the outbox (node/weights/outbox.py) in the
background while training goes on (the learner's next optimizer step waits only for the weights file). One version
is in flight at a time: when publishing takes longer than ``publish_every`` steps, the next version is named as
soon as the last one is out (versions coalesce; the loop never waits for the network side). Everything else is a
handler (work leases, rollouts, weights) or a background loop (DHT provide, announce).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import trio
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID

from node.base_model import ensure_base_model
from node.config import NodeConfig
from node.dashboard import SwarmView, open_dashboard
from node.discovery import provide_forever, role_key
from node.host import Swarm
from node.intake import RolloutIntake
from node.roles.checkpoints import Checkpoints
from node.roles.ranks import open_learner, watch_ranks
from node.roles.trainer_rpc import serve_trainer
from node.runlog import RunLog, StepMeter
from node.settings import Settings
from node.weights.encodings import Demand, DemandServer, offered_encodings, trainer_outbox
from node.weights.store import ChunkStore
from protocols.work import WorkRequest
from trainer.memory import limit_malloc_arenas
from trainer.tasks import load_task

log = logging.getLogger(__name__)
SCORER_FLOOR = {"torch.bfloat16": "none/bf16", "torch.float16": "none/fp16"}  # by the learner's compute dtype


class TrainerRole:
    name = "trainer"

    def __init__(self, config: NodeConfig, settings: Settings) -> None:
        limit_malloc_arenas()  # the CLI did it before any thread started; here for trainers run in-process
        self.config = config
        self.settings = s = settings.trainer
        self.weights = w = settings.weights
        self.task = load_task(s.task, s.reward)
        model_dir = Path(settings.learner.model_dir or ensure_base_model(config.data_dir / "base-model"))
        self.learner = open_learner(model_dir, settings.learner, s.max_staleness + 1, config.data_dir)
        codec = self.learner.codec
        self.intake = RolloutIntake(
            self.task,
            codec.encode_prompt,
            codec.completion_text,
            codec.eos_ids,
            self.learner.score,
            config.data_dir / "journal",
            s,
            scorer_floor=SCORER_FLOOR.get(str(self.learner.precision.compute)),
            transport="wire8" if w.encoding == "int8" else None,
        )
        self.store = ChunkStore(config.data_dir / "store")
        # which encodings connected samplers run (their polls say); its own chunks go to peers that were leased work or
        # had a group accepted (intake.known), the others share one small upload share (policy.origin_serves_freely)
        self.demand = Demand(
            lambda: self.swarm.host.get_connected_peers(),
            self.intake.strikes.is_banned,
            offered_encodings(self.intake.verifier.accept),
        )
        self.weight_server = DemandServer(
            self.demand, self.store, True, w.reserve_after, w.upload_per_peer, self.intake.known
        )
        self.finished = trio.Event()
        self.runlog = RunLog(config.data_dir / "metrics.jsonl")
        self.meter = StepMeter(self.intake)
        self.view = SwarmView()
        self.dashboard_url: str | None = None
        self.checkpoints = Checkpoints(
            config.data_dir / "trainer.ckpt", self.learner, self.intake, self.store, self.runlog
        )
        self.checkpoints.restore()

    # -- the network side --------------------------------------------------------------------------------
    def register(self, swarm: Swarm) -> None:
        self.swarm = swarm
        key_pair = KeyPair(swarm.host.get_private_key(), swarm.host.get_public_key())
        self.outbox = trainer_outbox(
            self.store, key_pair, self.config.swarm, self.weights, swarm.gossip, self.weight_server, self.demand,
            stage=lambda version, staging: self.learner.save_model_dir(staging, version),
            keep=self.settings.max_staleness + 2,
            on_published=lambda version, _: self.view.trainer_version(version),
        )  # fmt: skip
        self.weight_server.register(swarm.host)
        swarm.conns.set_valued(self.intake.has_record)  # their connections are kept when slots run short
        intake = self.intake
        serve_trainer(
            swarm.host,
            self.on_work,
            self.on_rollouts,
            admit_work=lambda p: intake.admit_work(str(p), p.ip),
            admit_rollouts=lambda p: intake.admit_rollouts(str(p), p.ip),
            group_size=self.settings.group_size,
            max_tokens=self.settings.max_tokens,
            rollout_timeout=self.config.rollout_timeout,
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
            key = role_key(self.config.swarm, "trainer")
            nursery.start_soon(provide_forever, swarm, key, self.config.provide_interval)
            nursery.start_soon(self.outbox.announce_forever, self.weights.announce_interval)
            nursery.start_soon(self.intake.compact_forever)
            nursery.start_soon(watch_ranks, self.learner)  # a sharded learner's: a dead rank stops the node
            self.dashboard_url = await open_dashboard(nursery, self.settings.dashboard, self.dashboard_state)
            nursery.start_soon(self.train)
            await self.finished.wait()
            await trio.sleep(self.settings.linger)
            nursery.cancel_scope.cancel()

    # -- the loop ----------------------------------------------------------------------------------------
    async def train(self) -> None:
        """Train whenever the intake holds a batch; never wait on any one sampler, nor on publishing."""
        s, learner, intake, outbox = self.settings, self.learner, self.intake, self.outbox
        if learner.steps == 0:
            await self.evaluate()
        outbox.start(s.publish_every, learner.steps, learner.name_version, learner.write_version, self.record)
        async with trio.open_nursery() as background:
            while s.max_steps is None or learner.steps < s.max_steps:
                batch = await intake.next_batch(s.batch_groups, learner.version)
                t0 = time.monotonic()
                metrics = await self.meter.busy(learner.step, batch)
                intake.trained(batch)
                t1 = time.monotonic()
                outbox.after_step(background, learner.steps)  # names a version when one is due and none in flight
                self.record(self.meter.record(metrics, t1 - t0, time.monotonic() - t1, outbox))
                if learner.steps % s.eval_every == 0:
                    await self.evaluate()
                if learner.steps % s.checkpoint_every == 0:
                    await self.checkpoints.save()
        await outbox.finish(learner.steps)  # the last steps' weights go out too: the run's final version
        await self.checkpoints.save()
        self.record({"finished": True})  # the run's last record: its version is the final one, published
        self.finished.set()

    async def publish(self) -> None:
        """Publish the current version (written already) and announce it by gossip."""
        await self.outbox.send(self.learner.version)

    @property
    def published(self) -> tuple[int, bytes] | None:  # (version, manifest id) published last
        return self.outbox.published

    async def evaluate(self) -> None:
        s = self.settings
        result = await trio.to_thread.run_sync(self.learner.evaluate, self.task, s.eval_size, s.max_tokens)
        self.record(result)
        log.info(
            "step %d eval reward %.3f accuracy %.3f", self.learner.steps, result["eval_reward"], result["eval_accuracy"]
        )
        await trio.to_thread.run_sync(self.runlog.plot, self.config.data_dir / "reward_curve.png")

    def record(self, values: dict[str, Any]) -> None:
        self.runlog.record(self.learner.steps, self.learner.version, values)

    @property
    def last_metrics(self) -> dict[str, Any]:
        return self.runlog.last

    def dashboard_state(self) -> dict[str, Any]:
        """Everything the dashboard page draws (node/dashboard.py)."""
        trainer = {"peer_id": str(self.swarm.peer_id), **self.status()}
        return self.view.state(self.config.swarm, trainer, self.intake, self.runlog.history)

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
