"""Never trust a sampler: every rollout group is checked against the lease, the task and the trainer's own model.

Checks, cheapest first: the claimed sampler id is the stream's authenticated peer; the lease exists, is that
peer's, and holds this seed; the prompt equals the one the trainer builds from (task, seed); the group size
and sampling parameters match the lease; the version is not too stale. Then rewards are recomputed (a claimed
reward that differs is forgery) and the claimed logprobs are compared with the trainer's recomputation at the
claimed version, within a tolerance that depends on the sampler's quantization. Forgeries cost the peer a
strike; after ``max_strikes`` it is banned.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from protocols.rollouts import RolloutAck, RolloutGroup
from trainer.buffer import RolloutBuffer, VerifiedGroup
from trainer.leases import LeaseBook
from trainer.scorer import Scorer
from trainer.tasks import Task

log = logging.getLogger(__name__)

# (mean |diff|, max |diff|) allowed between claimed and recomputed per-token logprobs, by sampler quantization.
# Measured on the tiny model: fp32 MLX vs torch ~5e-7, int8 ~5e-3 max; int4 is an order of magnitude looser.
DEFAULT_TOLERANCES: dict[str, tuple[float, float]] = {
    "none": (0.01, 0.1),
    "torch": (0.01, 0.1),
    "q8": (0.05, 0.5),
    "q4": (0.25, 2.0),
}


class Rejected(Exception):
    """The group is refused, without blame (stale, unknown lease, duplicate seed)."""


class Forged(Exception):
    """The group contradicts what the trainer can check: the peer lied."""


@dataclass
class PeerBook:
    max_strikes: int = 3
    strikes: dict[str, int] = field(default_factory=dict)
    banned: set[str] = field(default_factory=set)

    def strike(self, peer: str) -> None:
        self.strikes[peer] = self.strikes.get(peer, 0) + 1
        if self.strikes[peer] >= self.max_strikes:
            self.banned.add(peer)


class RolloutVerifier:
    def __init__(
        self,
        task: Task,
        leases: LeaseBook,
        buffer: RolloutBuffer,
        scorer: Scorer,
        decode: Callable[[list[int]], str],
        eos_ids: tuple[int, ...],
        max_staleness: int,
        tolerances: dict[str, tuple[float, float]] | None = None,
        peers: PeerBook | None = None,
    ) -> None:
        self.task = task
        self.leases = leases
        self.buffer = buffer
        self.scorer = scorer
        self.decode = decode
        self.eos_ids = eos_ids
        self.max_staleness = max_staleness
        self.tolerances = tolerances or DEFAULT_TOLERANCES
        self.peers = peers or PeerBook()
        self.rejected = 0
        self.forged = 0

    def completion_text(self, ids: list[int]) -> str:
        if ids and ids[-1] in self.eos_ids:
            ids = ids[:-1]
        return self.decode(ids)

    def _check_lease(self, g: RolloutGroup, remote: str, current_version: int) -> None:
        if g.sampler != remote:
            raise Forged(f"group claims sampler {g.sampler} but arrived from {remote}")
        rec = self.leases.get(g.lease_id)
        if rec is None:
            raise Rejected(f"unknown or expired lease {g.lease_id}")
        if rec.peer != remote:
            raise Forged(f"lease {g.lease_id} was issued to another peer")
        if g.seed not in rec.open_seeds:
            raise Rejected(f"seed {g.seed} is not open in lease {g.lease_id}")
        if g.task_id != self.task.name:
            raise Forged(f"task {g.task_id!r} is not this swarm's task {self.task.name!r}")
        lease = rec.lease
        expected_prompt = next(t.prompt_ids for t in lease.tasks if t.seed == g.seed)
        if g.prompt_ids != expected_prompt:
            raise Forged("prompt ids differ from the prompt the trainer issued for this seed")
        if len(g.samples) != lease.group_size:
            raise Forged(f"group holds {len(g.samples)} samples, the lease asked for {lease.group_size}")
        if abs(g.temperature - lease.sampling.temperature) > 1e-6 or abs(g.top_p - lease.sampling.top_p) > 1e-6:
            raise Forged("sampling parameters differ from the lease")
        if g.version > current_version:
            # not blame: a restarted trainer may have lost versions it had published (and signed)
            raise Rejected(f"version {g.version} is newer than the trainer's {current_version}")
        if current_version - g.version > self.max_staleness:
            raise Rejected(f"version {g.version} is more than {self.max_staleness} versions old")
        for s in g.samples:
            if len(s.completion_ids) > lease.sampling.max_tokens:
                raise Forged("a completion is longer than the lease's max_tokens")
            if any(t in self.eos_ids for t in s.completion_ids[:-1]):
                raise Forged("a completion continues after a stop token")

    def _check_logprobs(self, g: RolloutGroup) -> list[list[float]]:
        prompts = [g.prompt_ids] * len(g.samples)
        comps = [s.completion_ids for s in g.samples]
        ours = self.scorer.logprobs(g.version, prompts, comps, g.temperature)
        if ours is None:
            raise Rejected(f"version {g.version} is no longer kept for verification")
        mean_tol, max_tol = self.tolerances.get(g.quant, self.tolerances["q4"])
        diffs = [
            abs(a - b) for s, mine in zip(g.samples, ours, strict=True) for a, b in zip(s.logprobs, mine, strict=True)
        ]
        mean = sum(diffs) / len(diffs)
        worst = max(diffs)
        if mean > mean_tol or worst > max_tol:
            raise Forged(
                f"claimed logprobs deviate from the trainer's (mean {mean:.3g}, max {worst:.3g}, quant {g.quant})"
            )
        return ours

    async def verify(self, g: RolloutGroup, remote: str, current_version: int) -> RolloutAck:
        ids = [s.rollout_id for s in g.samples]
        if remote in self.peers.banned:
            return RolloutAck(rejected=[(i, "peer is banned") for i in ids])
        if all(self.buffer.is_duplicate(i) for i in ids):
            return RolloutAck(duplicate=ids)
        try:
            self._check_lease(g, remote, current_version)
            rewards, solved = [], []
            for s in g.samples:
                text = self.completion_text(s.completion_ids)
                r = float(self.task.reward(g.seed, text))
                if s.claimed_reward is not None and abs(s.claimed_reward - r) > 1e-6:
                    raise Forged(f"claimed reward {s.claimed_reward} but the trainer computes {r}")
                rewards.append(r)
                solved.append(bool(self.task.solved(g.seed, text)))
            old_logprobs = await trio.to_thread.run_sync(self._check_logprobs, g)
        except Forged as exc:
            self.forged += 1
            self.peers.strike(remote)
            log.warning("forged rollouts from %s: %s", remote, exc)
            return RolloutAck(rejected=[(i, f"forged: {exc}") for i in ids])
        except Rejected as exc:
            self.rejected += 1
            return RolloutAck(rejected=[(i, str(exc)) for i in ids])
        if all(self.buffer.is_duplicate(i) for i in ids):  # a resend that raced the original
            return RolloutAck(duplicate=ids)
        self.leases.close_seed(g.lease_id, g.seed)
        self.buffer.add(
            VerifiedGroup(
                group_id=g.group_id,
                peer=remote,
                version=g.version,
                task_id=g.task_id,
                seed=g.seed,
                prompt_ids=g.prompt_ids,
                completions=[s.completion_ids for s in g.samples],
                sampler_logprobs=[s.logprobs for s in g.samples],
                old_logprobs=old_logprobs,
                rewards=rewards,
                solved=solved,
                temperature=g.temperature,
            ),
            ids,
        )
        return RolloutAck(accepted=ids)
