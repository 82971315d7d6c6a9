"""Sampler role: finds the trainer (and other samplers) through the DHT (node/discovery.py's SamplerDiscovery),
asks for work, generates GRPO groups with its engine off the event loop, and sends each group straight to the
trainer."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio
from libp2p.peer.id import ID

from node.config import NodeConfig
from node.discovery import SamplerDiscovery, provide_forever, role_key
from node.engines import Engine
from node.engines import install as install_weights
from node.errors import describe
from node.host import Swarm
from node.roles.trainer_rpc import TrainerClient
from node.rpc import AnswerClock, backpressure, timed_by
from node.settings import Settings
from node.weights.patch import WeightChanges
from node.weights.server import WeightServer
from node.weights.store import ChunkStore
from node.weights.sync import WeightSync
from protocols.draw import RULE as DRAW_RULE
from protocols.errors import ProtocolError, RemoteError
from protocols.rollouts import RolloutAck, RolloutGroup, Sample
from protocols.weights import DEFAULT_ENCODING
from protocols.work import SamplerReport, TaskSpec, WorkLease, WorkRequest

log = logging.getLogger(__name__)


WORK_TIMEOUT = 30.0  # seconds a work request may take before the trainer has answered a few (then: AnswerClock)
WORK_TIMEOUT_MOST = 120.0  # ... at most: a lease that took longer to arrive than a lease lives would come expired
LEASE_FILL = 0.5  # of a lease's life, what a sampler plans to spend sampling it (the rest: weights, lag, resends)
GROUP_TIME_WEIGHT = 0.3  # weight of the newest group in the running mean of seconds per group


def groups_to_ask(seconds_per_group: float | None, lease_seconds: float | None, most: int) -> int:
    """How many groups a sampler asks for in one work request: what it finishes within ``LEASE_FILL`` of a lease's
    life at its own measured pace, at least 1 and at most ``most``; 1 before it has measured a group or seen a
    lease. A fixed 4 meant a sampler taking 64 s a group (a Mac on a large model) held a lease for 256 s, past its
    120 s life: its last groups were refused as expired work (bench/swarm_scale, N = 256), and a newcomer held its
    place in the newcomers' lease pool for all of it."""
    if not seconds_per_group or not lease_seconds:
        return 1
    return max(1, min(most, int(LEASE_FILL * lease_seconds / seconds_per_group)))


class VersionWatch:
    """Which version the engine runs, and the newest one this node knows the trainer has (from leases and
    announcements). Wakes whoever waits for the engine to come within a staleness bound."""

    def __init__(self) -> None:
        self.engine = -1
        self.newest_known = -1
        self._installed = trio.Event()

    def installed(self, version: int) -> None:
        self.engine = version
        self._installed.set()
        self._installed = trio.Event()

    def heard_of(self, version: int) -> None:
        self.newest_known = max(self.newest_known, version)

    def behind(self) -> int:
        return self.newest_known - self.engine

    async def wait_within(self, bound: int, timeout: float) -> bool:
        """Wait until the engine is at most ``bound`` versions behind; False if ``timeout`` passes first."""
        with trio.move_on_after(timeout):
            while self.behind() > bound:
                await self._installed.wait()
            return True
        return False


class SamplerRole:
    name = "sampler"
    # bound to the swarm by ``register``, which the runtime calls before ``run`` and ``status`` (node/runtime.py)
    swarm: Swarm
    weights: WeightSync

    def __init__(
        self,
        config: NodeConfig,
        settings: Settings,
        engine_factory: Callable[[Path, int], Engine],
        encoding: str = DEFAULT_ENCODING,
    ) -> None:
        """``encoding``: the weights encoding this sampler receives (node/engines ``weights_encoding``: int8-grid
        suits an MLX int8 engine, int4-grid an int4 one; the default, bf16/native, suits every engine)."""
        if config.trainer_id is None:
            raise ValueError("a sampler needs the trusted trainer's peer id")
        self.config = config
        self.settings = settings.sampler
        self.weight_settings = settings.weights
        self.swarm_name = config.swarm
        self.trainer_id: ID = config.trainer_id
        self.engine_factory = engine_factory
        self.encoding = encoding
        self.engine: Engine | None = None
        self.engine_ready = trio.Event()
        self.store = ChunkStore(config.data_dir / "store")
        self.weight_server = WeightServer(self.store, upload_per_peer=settings.weights.upload_per_peer)
        self.discovery = SamplerDiscovery(
            self.swarm_name, self.trainer_id, config.discover_interval, remember=config.data_dir / "trainer.addrs"
        )
        self.groups_sent = 0
        self.rollouts_accepted = 0
        self.rollouts_rejected = 0
        self.strikes = 0  # groups the trainer refused as forged: each is a strike there (banned at its limit)
        self.last_strike = ""
        self.rate_limited = 0
        self.stale_waits = 0
        self.versions = VersionWatch()
        self.last_error = ""
        self.group_seconds: float | None = None  # running mean of one group's time, sampling to acknowledgement
        self.lease_seconds: float | None = None  # the life of the last lease the trainer gave us
        self._engine_lock = trio.Lock()
        self.work_clock = AnswerClock(WORK_TIMEOUT, WORK_TIMEOUT_MOST)  # how long the trainer takes to give work

    def register(self, swarm: Swarm) -> None:
        self.swarm = swarm
        self.weight_server.register(swarm.host)
        self.trainer = TrainerClient(swarm.host, self.config.rollout_timeout)
        self.weights = WeightSync(
            swarm,
            self.store,
            swarm.gossip,
            self.swarm_name,
            self.trainer_id,
            self.install_version,
            self.weight_settings,
            peers=swarm.chunk_peers,  # chunks over direct connections; relays only as a last resort
            encoding=self.encoding,
        )

    async def install_version(self, version: int, path: Path, changes: WeightChanges | None) -> None:
        """First version: build the engine. Later ones: hot-swap (in place when ``changes`` say which elements of
        the running version changed), after any in-flight group finishes."""
        await self._install(version, path, changes)
        self.versions.installed(version)

    async def _install(self, version: int, path: Path, changes: WeightChanges | None) -> None:
        if self.engine is None:
            self.engine = await trio.to_thread.run_sync(self.engine_factory, path, version)
            self.engine_ready.set()
            log.info("engine %s ready at version %d", self.mode(), version)
            return
        async with self._engine_lock:
            how = await trio.to_thread.run_sync(install_weights, self.engine, path, version, changes)
        log.info("%s to version %d", "updated in place" if how == "updated" else "hot-swapped", version)

    async def run(self, swarm: Swarm) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.weights.run)
            nursery.start_soon(
                provide_forever, swarm, role_key(self.swarm_name, "sampler"), self.config.provide_interval
            )
            nursery.start_soon(self.discovery.run, swarm)
            nursery.start_soon(self._work_loop, swarm)

    # -- work ----------------------------------------------------------------------------------------
    async def _work_loop(self, swarm: Swarm) -> None:
        backoff = 0.5
        await self.engine_ready.wait()
        while True:
            await self.discovery.trainer_found.wait()
            try:
                lease = await self.ask_for_work()
            except RemoteError as exc:
                self.last_error = str(exc)
                pause = backpressure(exc)
                if pause is not None:
                    self.rate_limited += 1
                    await trio.sleep(pause)
                    continue
                log.warning("trainer refused work: %s", exc)
                await trio.sleep(backoff := min(backoff * 2, 30.0))
                continue
            except (ProtocolError, trio.TooSlowError, Exception) as exc:
                self.last_error = describe(exc)
                log.info("work request failed (%s); looking for the trainer again", self.last_error)
                self.discovery.lost_trainer()  # it may have restarted, or moved: find it again
                await trio.sleep(backoff := min(backoff * 2, 10.0))
                continue
            backoff = 0.5
            self.lease_seconds = lease.expires_in
            for spec in lease.tasks:
                if not await self._fresh_enough(lease):
                    break  # the lease ran out while we waited for weights: ask for new work
                started = trio.current_time()
                group = await self.sample_group(lease, spec)
                await self.submit(swarm, group)
                took = trio.current_time() - started
                mean = self.group_seconds
                self.group_seconds = took if mean is None else mean + GROUP_TIME_WEIGHT * (took - mean)

    async def ask_for_work(self) -> WorkLease:
        """One work request, given as long as the trainer's answers have been taking here (``work_clock``): a
        request that runs out of time is waited for longer the next time, not given up on at the same deadline while
        the trainer issues a lease for each (a closed connection or a refusal still ends it at once)."""
        ask = groups_to_ask(self.group_seconds, self.lease_seconds, self.settings.groups_per_request)
        timeout = self.work_clock.timeout()
        with timed_by(self.work_clock, timeout):
            return await self.trainer.lease(self.trainer_id, WorkRequest(ask, self.report()), timeout)

    async def _fresh_enough(self, lease: WorkLease) -> bool:
        """Don't sample what the trainer will refuse as stale: wait for newer weights (up to the lease's life)."""
        self.versions.heard_of(lease.version)
        if self.weights.target is not None:
            self.versions.heard_of(self.weights.target[0])
        if lease.max_staleness is None or self.versions.behind() <= lease.max_staleness:
            return True
        self.stale_waits += 1
        log.info("%d versions behind the trainer: waiting for weights before sampling", self.versions.behind())
        return await self.versions.wait_within(lease.max_staleness, lease.expires_in)

    async def sample_group(self, lease: WorkLease, spec: TaskSpec) -> RolloutGroup:
        """Generate one group on one engine version (the lock keeps a hot swap out until it finishes)."""
        sp = lease.sampling
        assert self.engine is not None
        async with self._engine_lock:
            version = self.engine.version
            gens = await trio.to_thread.run_sync(
                lambda: self.engine.generate(
                    [spec.prompt_ids] * lease.group_size,
                    temperature=sp.temperature,
                    top_p=sp.top_p,
                    max_tokens=sp.max_tokens,
                    seed=spec.seed,
                )
            )
        group_id = secrets.token_hex(8)
        return RolloutGroup(
            group_id=group_id,
            lease_id=lease.lease_id,
            task_id=spec.task_id,
            seed=spec.seed,
            version=version,
            sampler=str(self.swarm.peer_id),
            prompt_ids=spec.prompt_ids,
            temperature=sp.temperature,
            top_p=sp.top_p,
            quant=self.engine.quant,
            engine=self.engine.name,
            compute=self.engine.compute,
            samples=[
                Sample(f"{group_id}/{i}", g.completion_ids, g.logprobs, g.finish_reason) for i, g in enumerate(gens)
            ],
            draw=DRAW_RULE,
        )

    async def submit(self, swarm: Swarm, group: RolloutGroup) -> RolloutAck | None:
        """Send a group until it is acknowledged; resends are safe (the trainer dedupes by rollout id).

        Being told to slow down is not a failure: the group waits as long as the trainer asks, up to
        ``rate_limit_patience`` seconds in all (after that it would be too stale to train on anyway)."""
        attempt, waited = 0, 0.0
        while attempt < self.settings.submit_attempts:
            try:
                ack = await self.trainer.submit(self.trainer_id, group)
            except RemoteError as exc:
                self.last_error = str(exc)
                pause = backpressure(exc)
                if pause is not None and waited < self.settings.rate_limit_patience:
                    self.rate_limited += 1
                    waited += pause
                    await trio.sleep(pause)
                    continue
                log.warning("trainer refused group %s: %s", group.group_id, exc)
                return None
            except Exception as exc:
                self.last_error = f"{type(exc).__name__}: {exc}"
                await trio.sleep(0.5 * 2**attempt)
                attempt += 1
                continue
            self.groups_sent += 1
            self.rollouts_accepted += len(ack.accepted) + len(ack.duplicate)
            self.rollouts_rejected += len(ack.rejected)
            if ack.rejected:
                reason = ack.rejected[0][1]
                self.last_error = reason
                if reason.startswith("forged:"):
                    # a strike against this peer: an honest sampler should never see one, so say it loudly, with
                    # the limits the trainer applied (engine, compute dtype, quantization) for a report
                    self.strikes += 1
                    self.last_strike = reason
                    log.warning(
                        "trainer refused group %s as forged (strike %d): %s", group.group_id, self.strikes, reason
                    )
                else:
                    log.info("trainer rejected group %s: %s", group.group_id, reason)
            return ack
        log.warning("gave up on group %s after %d attempts (%s)", group.group_id, attempt, self.last_error)
        return None

    def mode(self) -> str:
        """engine/compute dtype/quantization: what this sampler's rollouts declare."""
        return f"{self.engine.name}/{self.engine.compute}/{self.engine.quant}"

    def report(self) -> SamplerReport:
        """What the trainer's dashboard shows for this sampler (its own word)."""
        engine = self.mode() if self.engine else "none"
        return SamplerReport(self.versions.engine, self.weight_server.bytes_served, engine)

    def status(self) -> dict[str, Any]:
        return {
            "trainer": str(self.trainer_id) if self.discovery.trainer_found.is_set() else "searching",
            "version": self.engine.version if self.engine else -1,
            "engine": self.mode() if self.engine else "waiting for weights",
            "bytes_uploaded": self.weight_server.bytes_served,
            "samplers_known": len(self.discovery.samplers),
            "groups_sent": self.groups_sent,
            "rollouts_accepted": self.rollouts_accepted,
            "rollouts_rejected": self.rollouts_rejected,
            "strikes": self.strikes,
            "last_strike": self.last_strike,
            "rate_limited": self.rate_limited,
            "stale_waits": self.stale_waits,
            "work_timeout": round(self.work_clock.timeout(), 1),
            "last_error": self.last_error,
            "trainer_found_by": dict(self.discovery.trainer_found_by),
            **self.weights.status(),
        }
