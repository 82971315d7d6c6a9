"""Never trust a sampler: every rollout group is checked against the lease, the task and the trainer's own model.

Checks, cheapest first: the claimed sampler id is the stream's authenticated peer; the lease exists, is that
peer's, and holds this seed; the tokens were drawn by the protocol's rule (a lease holder naming another rule, or
none, is a forger: the protocol fixes the rule, and dropping a seed must not be free); the prompt equals the one
the trainer builds from (task, seed); the group size and sampling parameters match the lease; the version is not
too stale. Then rewards are recomputed (a claimed reward that differs is forgery) and the claimed logprobs are
compared with the trainer's recomputation at the claimed version (``score``, given by the trainer role: the
learner's), and every token must be the one the lease's seed draws under the seeded-draw rule (protocols/draw.py),
both within what the honest noise of the sampler's declared mode explains (node/intake/noise.py: the mode must be
one the trainer accepts and the one the peer declared first; a peer whose logprobs are fp32-exact is held to fp32
limits whatever it declares), and the peer's near-boundary flips over its history must stay plausible for that
noise: a sampler cannot choose its tokens, only sample them. ``Forged`` means the peer lied (the intake strikes
it); ``Rejected`` is refusal without blame.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import trio

from node.intake.draws import Assessment, assess_group
from node.intake.leases import LeaseBook
from node.intake.noise import EPSILON, LEVELS, FlipHistory, Mode, sequential_check
from protocols.draw import RULE as DRAW_RULE
from protocols.draw import TokenDraw
from protocols.rollouts import RolloutGroup
from trainer.groups import Group
from trainer.tasks import Task

# score(version, prompts, completions, temperature, top_p) -> for every completion token, its logprob at that
# version and the interval of the seeded draw that picks it (protocols/draw.py), or None when the version is no
# longer kept. Blocking (a forward pass): called from a worker thread.
ScoreFn = Callable[[int, list[list[int]], list[list[int]], float, float], list[list[TokenDraw]] | None]


def bounded_mu(claimed: list[float], ours: list[float], clamp: float) -> list[float]:
    """The sampler's logprobs as the loss will see them: within ``clamp`` (the applied noise class's ``tis_clamp``,
    about honest p99) of the trainer's own, so a peer cannot skew the TIS weights of its own samples."""
    return [o + max(-clamp, min(clamp, m - o)) for m, o in zip(claimed, ours, strict=True)]


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
        accept: tuple[str, ...],
        scorer_floor: str | None = None,
        max_peers: int = 10_000,
        scale_cap: float = 1.0,
        transport: str | None = None,
    ) -> None:
        self.task = task
        self.leases = leases
        self.score = score
        self.completion_text = completion_text
        self.eos_ids = eos_ids
        self.max_staleness = max_staleness
        self.accept = accept  # weight quantizations trained on (--accept-quant)
        self.scorer_floor = scorer_floor  # the scorer's own noise class (a bf16 scorer: none/bf16), or None
        self.max_peers = max_peers
        self.scale_cap = scale_cap  # --noise-scale-cap (node/intake/noise.py noise_scale)
        self.transport = transport  # "wire8" when versions travel int8 rowwise: samplers run lossy weights
        self.modes: dict[str, Mode] = {}  # the mode each peer declared first (insertion order: oldest first)
        self.history: dict[str, FlipHistory] = {}  # each peer's near-boundary flips against honest expectation
        self.last_limits: dict[str, str] = {}  # per peer, the limits its latest refusal for forgery named
        self.scoring_seconds = 0.0  # time spent recomputing logprobs (the trainer's cost of verification)
        self.scored_tokens = 0  # prompt and completion tokens those forward passes took

    def check_lease(self, g: RolloutGroup, remote: str, current_version: int) -> None:
        if g.sampler != remote:
            raise Forged(f"group claims sampler {g.sampler} but arrived from {remote}")
        rec = self.leases.get(g.lease_id)
        if rec is None:
            raise Rejected(f"unknown or expired lease {g.lease_id}")
        if rec.peer != remote:
            raise Forged(f"lease {g.lease_id} was issued to another peer")
        if g.seed not in rec.open_seeds:
            raise Rejected(f"seed {g.seed} is not open in lease {g.lease_id}")
        if g.draw != DRAW_RULE:
            # the rule is fixed by the protocol and the lease holder chose to ignore it (refused without blame, a
            # sampler could drop any prompt it dislikes for free: censorship)
            raise Forged(f"tokens must be drawn by {DRAW_RULE} (got {g.draw!r})")
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
            if s.completion_ids[-1] not in self.eos_ids and len(s.completion_ids) < lease.sampling.max_tokens:
                raise Forged("a completion stops before its stop token and before max_tokens (cut short)")
        self.check_mode(g, remote)

    def check_mode(self, g: RolloutGroup, remote: str) -> Mode:
        """The peer's declared mode: one this trainer accepts, and the one it declared first (never blame: a
        sampler that changed engines is not a liar, but its history no longer describes it)."""
        mode = Mode(g.engine, g.compute, g.quant)
        if g.quant not in self.accept:
            raise Rejected(
                f"this trainer does not train on {g.quant} rollouts (it accepts {', '.join(self.accept)}): "
                "run the sampler with --bits 8 or --bits none"
            )
        bound = self.modes.get(remote)
        if bound is None:
            self.modes[remote] = mode
            while len(self.modes) > self.max_peers:
                del self.modes[next(iter(self.modes))]
        elif bound != mode:
            raise Rejected(f"this peer declared {bound} first, now {mode}: restart it with a fresh identity to switch")
        return mode

    def check_logprobs(self, g: RolloutGroup) -> tuple[list[list[float]], Assessment]:
        """The trainer's own logprobs at the rollout's version and the group's assessment under the noise its
        declared mode explains (node/intake/noise.py). Blocking (a forward pass): runs in a worker thread."""
        prompts = [g.prompt_ids] * len(g.samples)
        comps = [s.completion_ids for s in g.samples]
        draws = self.score(g.version, prompts, comps, g.temperature, g.top_p)
        if draws is None:
            raise Rejected(f"version {g.version} is no longer kept for verification")
        self.scored_tokens += sum(len(p) + len(c) for p, c in zip(prompts, comps, strict=True))
        mode = Mode(g.engine, g.compute, g.quant)
        claimed = [s.logprobs for s in g.samples]
        verdict = assess_group(
            draws,
            claimed,
            g.seed,
            mode,
            g.temperature,
            g.top_p,
            self.scorer_floor,
            scale_cap=self.scale_cap,
            transport=self.transport,
        )
        return [[d.logprob for d in row] for row in draws], verdict

    def judge(self, verdict: Assessment, remote: str) -> float:
        """Refuse a group its noise does not explain, or one that makes the peer's flips so far implausible for
        honest noise (a steerer spreading its picks over many groups); returns the TIS clamp for the group. In the
        event loop: a peer's history is updated by one group at a time."""
        if not verdict.ok:
            self._note_limits(remote, verdict)
            raise Forged(verdict.reason())
        history, p = sequential_check(self.history.pop(remote, FlipHistory()), verdict.tails, verdict.limits.expected)
        if p < EPSILON:
            self._note_limits(remote, verdict)
            beyond = ", ".join(
                f"{n} beyond the honest {level:g} tail (expected {history.expected * level:.2g})"
                for n, level in zip(history.beyond, LEVELS, strict=True)
            )
            raise Forged(
                f"steering, not sampling ({verdict.limits.describe()}): over {history.groups} groups, near-boundary "
                f"draws {beyond} (p = {p:.1e})"
            )
        self.history[remote] = history
        while len(self.history) > self.max_peers:
            del self.history[next(iter(self.history))]
        return verdict.tis_clamp

    def _note_limits(self, remote: str, verdict: Assessment) -> None:
        self.last_limits.pop(remote, None)
        self.last_limits[remote] = verdict.limits.describe()
        while len(self.last_limits) > self.max_peers:
            del self.last_limits[next(iter(self.last_limits))]

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
            old_logprobs, verdict = await trio.to_thread.run_sync(self.check_logprobs, g)
        finally:
            self.scoring_seconds += time.monotonic() - t0
        clamp = self.judge(verdict, remote)
        return Group(
            group_id=g.group_id,
            peer=remote,
            version=g.version,
            task_id=g.task_id,
            seed=g.seed,
            prompt_ids=g.prompt_ids,
            completions=[s.completion_ids for s in g.samples],
            sampler_logprobs=[bounded_mu(s.logprobs, o, clamp) for s, o in zip(g.samples, old_logprobs, strict=True)],
            old_logprobs=old_logprobs,
            rewards=rewards,
            solved=solved,
            temperature=g.temperature,
        )
