"""Never trust a sampler: every rollout group is checked against the lease, the task and the trainer's own model.

Checks, cheapest first: the claimed sampler id is the stream's authenticated peer; the lease exists, is that
peer's, and holds this seed; the prompt equals the one the trainer builds from (task, seed); the group size
and sampling parameters match the lease; the version is not too stale. Then rewards are recomputed (a claimed
reward that differs is forgery) and the claimed logprobs are compared with the trainer's recomputation at the
claimed version (``score``, given by the trainer role: the learner's), within a tolerance that depends on
the sampler's quantization; and every token must be the one the lease's seed draws under the seeded-draw rule
(protocols/draw.py), up to near-boundary flips that the sampler's quantization noise explains
(node/intake/draws.py): a sampler cannot choose its tokens, only sample them. ``Forged`` means the peer lied (the
intake strikes it); ``Rejected`` is refusal without blame.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import trio

from node.intake.draws import DEFAULT_DRAW_LIMITS, DrawLimits, check_group_draws
from node.intake.leases import LeaseBook
from protocols.draw import RULE as DRAW_RULE
from protocols.draw import TokenDraw
from protocols.rollouts import RolloutGroup
from trainer.groups import Group
from trainer.tasks import Task

# score(version, prompts, completions, temperature, top_p) -> for every completion token, its logprob at that
# version and the interval of the seeded draw that picks it (protocols/draw.py), or None when the version is no
# longer kept. Blocking (a forward pass): called from a worker thread.
ScoreFn = Callable[[int, list[list[int]], list[list[int]], float, float], list[list[TokenDraw]] | None]

# (mean |diff|, max |diff|) allowed between claimed and recomputed per-token logprobs, by sampler quantization.
# Measured against fp32 versions (tiny model): fp32 MLX vs torch ~5e-7, int8 ~5e-3 max. Against bf16 versions
# scored in bf16 (Qwen2 4x256 / Llama 4x128, 3.5k tokens each): fp32 engines mean 0.001-0.002, p99 0.003-0.007,
# max 0.006-0.009; int8 mean 0.007-0.013, p99 0.023-0.043, max 0.034-0.063; int4 mean 0.04-0.06, p99 0.14-0.21,
# max 0.18-0.30. The bounds keep a margin of 3-5x over those maxima, because trained models with peaked
# distributions can be noisier than these random-init ones, and refusing an honest group costs a strike.
DEFAULT_TOLERANCES: dict[str, tuple[float, float]] = {
    "none": (0.01, 0.05),
    "torch": (0.01, 0.05),
    "q8": (0.05, 0.3),
    "q4": (0.2, 1.2),
}
# What a claimed logprob may move the importance weight pi_old / mu by: about the p99 of honest noise of that
# quantization. Anything a sampler claims beyond it (still within the verification tolerance) is clamped, so a
# peer that declares a coarse quantization to shift its logprobs cannot skew the TIS weights of its own samples.
TIS_CLAMP: dict[str, float] = {"none": 0.01, "torch": 0.01, "q8": 0.05, "q4": 0.2}


def bounded_mu(claimed: list[float], ours: list[float], quant: str) -> list[float]:
    """The sampler's logprobs as the loss will see them: within ``TIS_CLAMP[quant]`` of the trainer's own."""
    c = TIS_CLAMP.get(quant, TIS_CLAMP["q4"])
    return [o + max(-c, min(c, m - o)) for m, o in zip(claimed, ours, strict=True)]


class Rejected(Exception):
    """The group is refused, without blame (stale, unknown lease, duplicate seed)."""


class Forged(Exception):
    """The group contradicts what the trainer can check: the peer lied."""


class RolloutVerifier:
    def __init__(
        self,
        task: Task,
        leases: LeaseBook,
        score: ScoreFn,
        completion_text: Callable[[list[int]], str],
        eos_ids: tuple[int, ...],
        max_staleness: int,
        tolerances: dict[str, tuple[float, float]] | None = None,
        draw_limits: dict[str, DrawLimits] | None = None,
    ) -> None:
        self.task = task
        self.leases = leases
        self.score = score
        self.completion_text = completion_text
        self.eos_ids = eos_ids
        self.max_staleness = max_staleness
        self.tolerances = tolerances or DEFAULT_TOLERANCES
        self.draw_limits = draw_limits or DEFAULT_DRAW_LIMITS
        self.scoring_seconds = 0.0  # time spent recomputing logprobs (the trainer's cost of verification)
        self.scored_tokens = 0  # prompt and completion tokens those forward passes took

    def check_lease(self, g: RolloutGroup, remote: str, current_version: int) -> None:
        if g.draw != DRAW_RULE:  # an older sampler: not a liar, but its tokens cannot be checked
            raise Rejected(f"tokens must be drawn by {DRAW_RULE} (got {g.draw!r}): upgrade this sampler")
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

    def check_logprobs(self, g: RolloutGroup) -> list[list[float]]:
        """The trainer's own logprobs at the rollout's version, if the claimed ones agree with them and every token
        is the one the lease's seed draws (within the sampler's quantization noise)."""
        prompts = [g.prompt_ids] * len(g.samples)
        comps = [s.completion_ids for s in g.samples]
        draws = self.score(g.version, prompts, comps, g.temperature, g.top_p)
        if draws is None:
            raise Rejected(f"version {g.version} is no longer kept for verification")
        self.scored_tokens += sum(len(p) + len(c) for p, c in zip(prompts, comps, strict=True))
        ours = [[d.logprob for d in row] for row in draws]
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
        checked = check_group_draws(draws, g.seed, g.quant, g.top_p, self.draw_limits)
        if not checked.ok:
            raise Forged(f"tokens were not drawn from the lease's seed: {checked.reason()}")
        return ours

    async def verify(self, g: RolloutGroup, remote: str, current_version: int) -> Group:
        """The group as the learner will train on it; raises Forged or Rejected."""
        self.check_lease(g, remote, current_version)
        rewards, solved = [], []
        for s in g.samples:
            text = self.completion_text(s.completion_ids)
            r = float(self.task.reward(g.seed, text))
            if s.claimed_reward is not None and abs(s.claimed_reward - r) > 1e-6:
                raise Forged(f"claimed reward {s.claimed_reward} but the trainer computes {r}")
            rewards.append(r)
            solved.append(bool(self.task.solved(g.seed, text)))
        t0 = time.monotonic()
        try:
            old_logprobs = await trio.to_thread.run_sync(self.check_logprobs, g)
        finally:
            self.scoring_seconds += time.monotonic() - t0
        return Group(
            group_id=g.group_id,
            peer=remote,
            version=g.version,
            task_id=g.task_id,
            seed=g.seed,
            prompt_ids=g.prompt_ids,
            completions=[s.completion_ids for s in g.samples],
            sampler_logprobs=[bounded_mu(s.logprobs, o, g.quant) for s, o in zip(g.samples, old_logprobs, strict=True)],
            old_logprobs=old_logprobs,
            rewards=rewards,
            solved=solved,
            temperature=g.temperature,
        )
