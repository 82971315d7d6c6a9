"""Were these tokens *sampled*? The seeded-draw check of a rollout group (rule: protocols/draw.py). No torch.

The trainer's scorer replays each completion at the rollout's version and returns, per token, the interval
[lo, hi) of draws u that pick it (trainer/draws.py). An honest sampler's u(seed, k, t) lies in that interval,
except when the sampler's own arithmetic (float32, bf16, int8/int4 weights) put a CDF boundary on the other side
of u: a "near-boundary flip", within a small distance. So each token's u must lie within tolerance of its
interval, and at most ``budget`` tokens per group may lie outside [lo, hi) at all. Distances are in log-odds
(protocols/draw.py): honest logit noise moves a CDF value c by ~c(1 - c) times the noise, so near 0 and 1 a
boundary barely moves and around 0.5 it moves most; one log-odds tolerance fits flat and peaked distributions.

A token chosen by anything but the draw (an injected answer) has u anywhere in [0, 1): it is caught unless its
own interval, widened by the tolerance, happens to hold u; the budget bounds how many such lucky tokens one group
can carry.

The tolerance and budget of each group come from the noise model of node/intake/noise.py (``assess_group``): the
sampler's mode, the group's exposure to flips, its temperature, and the noise its logprobs show.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from node.intake.noise import (
    NOISE_SCALE_CAP,
    GroupLimits,
    Mode,
    effective_class,
    floor_class,
    group_limits,
    measured_noise,
    noise_class,
    noise_scale,
)
from protocols.draw import TokenDraw, draw_uniforms, interval_distance, log_odds_distance


@dataclass(frozen=True)
class Tolerance:
    """How far outside its interval an honest draw may land: within ``log_odds`` of the boundary in log-odds
    (protocols/draw.py ``log_odds_distance``: the scale logit errors act on) or within ``absolute`` of it (float
    arithmetic near 0 and 1). ``log_odds`` also bounds the margin of an admissible nucleus alternative."""

    log_odds: float
    absolute: float = 1e-4

    def admits(self, distance: float, log_odds: float) -> bool:
        return log_odds <= self.log_odds or distance <= self.absolute


@dataclass(frozen=True)
class Deviation:
    """A token outside its draw interval: which sample and position, its u, and how far outside (absolute and in
    log-odds, nucleus alternatives considered)."""

    sample: int
    position: int
    u: float
    distance: float
    log_odds: float


@dataclass(frozen=True)
class DrawCheck:
    tokens: int
    budget: int
    tolerance: Tolerance
    flips: list[Deviation] = field(default_factory=list)  # within tolerance
    forged: list[Deviation] = field(default_factory=list)  # beyond it

    @property
    def ok(self) -> bool:
        return not self.forged and len(self.flips) <= self.budget

    def reason(self) -> str:
        """Why the group fails (empty when it passes)."""
        if self.forged:
            d = max(self.forged, key=lambda x: x.log_odds)
            return (
                f"{len(self.forged)} of {self.tokens} tokens were not drawn by the seeded rule (worst: sample "
                f"{d.sample} position {d.position}, u={d.u:.6f} is {d.distance:.3g} ({d.log_odds:.3g} in log-odds) "
                f"outside its interval)"
            )
        if len(self.flips) > self.budget:
            return f"{len(self.flips)} near-boundary draws in one group, more than the {self.budget} allowed"
        return ""


def _deviation(d: TokenDraw, u: float, tolerance: Tolerance) -> tuple[float, float, bool]:
    """(absolute, log-odds) distance of u from the token's interval or the nearest admissible nucleus
    alternative, and whether any of them admits it."""
    candidates = [(d.lo, d.hi)] + [(lo, hi) for margin, lo, hi in d.alts if margin <= tolerance.log_odds]
    dists = [(interval_distance(u, lo, hi), log_odds_distance(u, lo, hi)) for lo, hi in candidates]
    admitted = any(tolerance.admits(a, b) for a, b in dists)
    return min(a for a, _ in dists), min(b for _, b in dists), admitted


def check_draws(
    draws: Sequence[Sequence[TokenDraw]],
    seed: int,
    tolerance: Tolerance,
    budget: int,
    sample_indices: Sequence[int] | None = None,
) -> DrawCheck:
    """Check every token of one group: ``draws[i][t]`` is sample i's token t as the trainer replays it; sample i
    was drawn with index ``sample_indices[i]`` (default i, its place in the group) under the group ``seed``."""
    ks = list(range(len(draws))) if sample_indices is None else list(sample_indices)
    if len(ks) != len(draws):
        raise ValueError(f"{len(ks)} sample indices for {len(draws)} samples")
    k_arr = np.array([k for k, row in zip(ks, draws, strict=True) for _ in row], dtype=np.uint64)
    t_arr = np.array([t for row in draws for t in range(len(row))], dtype=np.uint64)
    flat = [(i, t, d) for i, row in enumerate(draws) for t, d in enumerate(row)]
    if not flat:
        return DrawCheck(0, budget, tolerance)
    u = draw_uniforms(seed, k_arr, t_arr)
    lo = np.array([d.lo for _, _, d in flat])
    hi = np.array([d.hi for _, _, d in flat])
    outside = np.nonzero(~((lo <= u) & (u < hi)))[0]
    flips, forged = [], []
    for j in outside.tolist():
        i, t, d = flat[j]
        dist, lodds, admitted = _deviation(d, float(u[j]), tolerance)
        (flips if admitted else forged).append(Deviation(ks[i], t, float(u[j]), dist, lodds))
    return DrawCheck(len(flat), budget, tolerance, flips, forged)


@dataclass(frozen=True)
class Assessment:
    """A group's verdict under the noise model (node/intake/noise.py): the class applied, the limits, the logprob
    error it showed and the draw check. ``reason`` names the limits, so an operator can report a false strike."""

    mode: str
    cls: str
    limits: GroupLimits
    noise: float | None  # normalised logprob noise (measured_noise)
    logprob_mean: float
    logprob_max: float
    draws: DrawCheck
    logprob_bounds: tuple[float, float]
    tails: tuple[float, ...] = ()  # per flip, the share of honest flips as far out (NoiseClass.tail)
    tis_clamp: float = 0.01  # the applied class's: how far the loss may trust the claimed logprobs

    @property
    def logprobs_ok(self) -> bool:
        return self.logprob_mean <= self.logprob_bounds[0] and self.logprob_max <= self.logprob_bounds[1]

    @property
    def ok(self) -> bool:
        return self.logprobs_ok and self.draws.ok

    def reason(self) -> str:
        if not self.logprobs_ok:
            return (
                f"claimed logprobs deviate from the trainer's (mean {self.logprob_mean:.3g}, max "
                f"{self.logprob_max:.3g}; {self.limits.mode} allows {self.logprob_bounds[0]:g} / "
                f"{self.logprob_bounds[1]:g})"
            )
        if not self.draws.ok:
            return f"tokens were not drawn from the lease's seed ({self.limits.describe()}): {self.draws.reason()}"
        return ""


def assess_group(
    draws: Sequence[Sequence[TokenDraw]],
    claimed: Sequence[Sequence[float]],
    seed: int,
    mode: Mode,
    temperature: float,
    top_p: float,
    scorer_floor: str | None = None,
    sample_indices: Sequence[int] | None = None,
    scale_cap: float = NOISE_SCALE_CAP,
    transport: str | None = None,
) -> Assessment:
    """Check one group as the trainer does: ``draws`` its replay, ``claimed`` the sampler's logprobs. The noise class
    is the declared mode's, or none/fp32 when the logprobs are fp32-quiet (a peer cannot pick its own limits);
    a bf16 scorer (``scorer_floor``) floors every class at its own noise, and so does a lossy ``transport`` of the
    versions ("wire8": int8 rowwise, whose decoded weights every sampler runs) at its class for the group's
    compute dtype."""
    replayed = [d.logprob for row in draws for d in row]
    flat_claimed = [c for row in claimed for c in row]
    diffs = [abs(a - b) for a, b in zip(flat_claimed, replayed, strict=True)]
    noise = measured_noise(flat_claimed, replayed)
    cls_name = effective_class(mode.noise_class, noise)
    cls = noise_class(cls_name)
    if scorer_floor is not None:
        cls = floor_class(cls, noise_class(scorer_floor))
        cls_name = f"{cls_name}+{scorer_floor} scorer"
    if transport is not None:
        wire = f"{transport}/{mode.compute}"
        cls = floor_class(cls, noise_class(wire))
        cls_name = f"{cls_name}+{wire} transport"
    exposure = sum(d.exposure for row in draws for d in row)
    scale = noise_scale(noise, cls, scale_cap)
    limits = group_limits(str(mode), cls_name, cls, exposure, temperature, top_p, scale)
    checked = check_draws(draws, seed, Tolerance(limits.log_odds, limits.absolute), limits.budget, sample_indices)
    tail = cls.tail(top_p)
    tails = tuple(tail.survival(d.log_odds, temperature, scale) for d in checked.flips)
    return Assessment(
        str(mode),
        cls_name,
        limits,
        noise,
        sum(diffs) / max(len(diffs), 1),
        max(diffs, default=0.0),
        checked,
        (cls.logprob_mean, cls.logprob_max),
        tails,
        cls.tis_clamp,
    )
