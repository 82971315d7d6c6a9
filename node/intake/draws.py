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

Limits per sampler quantization come from measurement (bench/draws.py): the distances of honest flips of MLX
fp32/bf16/int8/int4 and torch samplers against the trainer's float64 replay, with margin.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

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
class DrawLimits:
    """What honest arithmetic noise may do to one group's draws.

    With top_p < 1 the sampler's and the trainer's nucleus can differ by more than the boundary alternatives cover
    (near-equal tokens reorder) and both renormalise by their own kept mass: a looser ``tolerance_nucleus`` and
    more flips apply there."""

    tolerance: Tolerance
    tolerance_nucleus: Tolerance
    budget: int  # flips allowed per group, plus ...
    per_token: float = 0.0  # ... this fraction of the group's tokens, plus ...
    per_token_nucleus: float = 0.0  # ... this fraction when top_p < 1

    def tolerance_for(self, top_p: float = 1.0) -> Tolerance:
        return self.tolerance if top_p >= 1.0 else self.tolerance_nucleus

    def budget_for(self, tokens: int, top_p: float = 1.0) -> int:
        rate = self.per_token + (self.per_token_nucleus if top_p < 1.0 else 0.0)
        return self.budget + math.floor(rate * tokens)


# Set from bench/draws.py (bench/results/draws.txt): honest MLX fp32/bf16/int8/int4 and torch samplers (G=8,
# max_tokens=8, T=1) replayed by the trainer in float64, on random-init Qwen2s (flat next-token distributions, a
# CDF boundary every ~1/V) and the pretrained base model (peaked ones), fp32 and bf16 weights, fp32 and bf16
# scoring; 10,000 groups per sampler on the tiny model. Largest honest flip seen, top_p=1: q8 (and fp32 on bf16)
# 0.03 log-odds, q4 1.35 log-odds; top_p=0.9: q8 0.89 log-odds but only 0.014 absolute (several near-equal tokens
# reorder at the nucleus boundary), q4 33 log-odds / 0.045 absolute. Most flips in one ~60-token group: q8 6
# (top_p=1) and 14 (0.9), q4 37. Tolerances are 2-5x those, budgets ~2x. fp32 samplers on fp32 weights never
# flipped; "none" and "torch" get q8's limits because bf16 weights or bf16 scoring make them flip like q8.
# Unknown quant modes get q4's limits.
_EIGHT_BIT = DrawLimits(
    Tolerance(log_odds=0.15, absolute=1e-3),
    Tolerance(log_odds=0.6, absolute=0.03),
    budget=4,
    per_token=0.1,
    per_token_nucleus=0.3,
)
DEFAULT_DRAW_LIMITS: dict[str, DrawLimits] = {
    "none": _EIGHT_BIT,
    "torch": _EIGHT_BIT,
    "q8": _EIGHT_BIT,
    # int4 logits are off by up to ~3 nats: it flips too often to budget (up to 60% of a group's tokens on a flat
    # distribution) and needs a wide tolerance, so int4 rollouts are checked far less tightly than int8 ones
    "q4": DrawLimits(Tolerance(log_odds=3.0, absolute=0.03), Tolerance(log_odds=3.0, absolute=0.1), 8, 1.0),
}


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
                f"outside its interval; tolerance {self.tolerance.log_odds:g} log-odds)"
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


def check_group_draws(
    draws: Sequence[Sequence[TokenDraw]],
    seed: int,
    quant: str,
    top_p: float = 1.0,
    limits: dict[str, DrawLimits] | None = None,
) -> DrawCheck:
    """``check_draws`` with the limits of the sampler's quantization mode (budget scaled by the group's tokens)."""
    table = limits or DEFAULT_DRAW_LIMITS
    lim = table.get(quant, table["q4"])
    tokens = sum(len(row) for row in draws)
    return check_draws(draws, seed, lim.tolerance_for(top_p), lim.budget_for(tokens, top_p))
