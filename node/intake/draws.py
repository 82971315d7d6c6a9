"""Were these tokens *sampled*? The seeded-draw check of a rollout group (rule: protocols/draw.py). No torch.

The trainer's scorer replays each completion at the rollout's version and returns, per token, the interval
[lo, hi) of draws u that pick it (trainer/draws.py). An honest sampler's u(seed, k, t) lies in that interval,
except when the sampler's own arithmetic (float32, int8/int4 weights) put a CDF boundary on the other side of
u: a "near-boundary flip", within a small distance. So each token must satisfy lo - tol <= u < hi + tol, and
at most ``budget`` tokens per group may lie outside [lo, hi) at all. A token chosen by anything but the draw
(an injected answer) lands anywhere in [0, 1): it is caught unless its own interval, widened by tol, happens to
hold u; and the budget bounds how many such lucky tokens one group can carry.

Limits per sampler quantization come from measurement (bench/draws.py): the distances of honest flips of MLX
fp32/int8/int4 and torch samplers against the trainer's float64 replay on fp32 weights, with margin.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from protocols.draw import TokenDraw, draw_uniforms, inside, interval_distance


@dataclass(frozen=True)
class DrawLimits:
    """What honest arithmetic noise may do to one group's draws.

    With top_p < 1 the sampler's and the trainer's nucleus can differ (near-equal tokens at the boundary reorder)
    and both renormalise by their own kept mass, so every interval moves by up to about one boundary token's
    probability: a looser ``tolerance_nucleus`` and more flips apply there."""

    tolerance: float  # largest CDF distance of a near-boundary flip (top_p = 1)
    tolerance_nucleus: float  # the same when top_p < 1 (also the largest admissible nucleus-alternative margin)
    budget: int  # flips allowed per group, plus ...
    per_token: float = 0.0  # ... this fraction of the group's tokens, plus ...
    per_token_nucleus: float = 0.0  # ... this fraction when top_p < 1

    def tolerance_for(self, top_p: float = 1.0) -> float:
        return self.tolerance if top_p >= 1.0 else self.tolerance_nucleus

    def budget_for(self, tokens: int, top_p: float = 1.0) -> int:
        rate = self.per_token + (self.per_token_nucleus if top_p < 1.0 else 0.0)
        return self.budget + math.floor(rate * tokens)


# Measured by bench/draws.py (bench/results/draws.txt): honest samplers (G=8, max_tokens=8, T=1) replayed by the
# trainer in float64 on fp32 compute, on random-init Qwen2s (d=128 x 2 layers, 10,000 groups per sampler; d=256 x 4
# layers; bf16 weights) and the pretrained base model. Largest honest flip distance seen, top_p=1 / 0.9: q8 2.0e-3 /
# 1.4e-2 (both on bf16 weights), q4 1.7e-2 / 4.5e-2, MLX fp32 and torch on fp32 weights never flipped, "none" on bf16
# weights (MLX computes in bf16) 2.5e-4 / 1.2e-2. Most flips in one group (of ~60 tokens), top_p=1 / 0.9: q8 6 / 14,
# q4 34 / 37, none-on-bf16 2 / 7. Tolerances are 2.5-8x those distances, budgets ~2x those counts. A random-init
# model's next-token distribution is nearly flat (a CDF boundary every ~1/V): the worst case; peaked distributions
# flip far less. "none" and "torch" cover bf16 weights. Unknown quant modes get q4's limits.
DEFAULT_DRAW_LIMITS: dict[str, DrawLimits] = {
    "none": DrawLimits(tolerance=2e-3, tolerance_nucleus=0.05, budget=3, per_token=0.05, per_token_nucleus=0.2),
    "torch": DrawLimits(tolerance=2e-3, tolerance_nucleus=0.05, budget=3, per_token=0.05, per_token_nucleus=0.2),
    "q8": DrawLimits(tolerance=0.01, tolerance_nucleus=0.05, budget=4, per_token=0.1, per_token_nucleus=0.3),
    # int4 flips too often to budget (up to 60% of a group's tokens on a flat distribution): tolerance only
    "q4": DrawLimits(tolerance=0.05, tolerance_nucleus=0.1, budget=8, per_token=1.0),
}


@dataclass(frozen=True)
class Deviation:
    """A token outside its draw interval: which sample and position, its u, and how far outside."""

    sample: int
    position: int
    u: float
    distance: float


@dataclass(frozen=True)
class DrawCheck:
    tokens: int
    budget: int
    tolerance: float
    flips: list[Deviation] = field(default_factory=list)  # within tolerance
    forged: list[Deviation] = field(default_factory=list)  # beyond it

    @property
    def ok(self) -> bool:
        return not self.forged and len(self.flips) <= self.budget

    def reason(self) -> str:
        """Why the group fails (empty when it passes)."""
        if self.forged:
            d = max(self.forged, key=lambda x: x.distance)
            return (
                f"{len(self.forged)} of {self.tokens} tokens were not drawn by the seeded rule (worst: sample "
                f"{d.sample} position {d.position}, u={d.u:.6f} is {d.distance:.3g} outside its interval, "
                f"tolerance {self.tolerance:g})"
            )
        if len(self.flips) > self.budget:
            return f"{len(self.flips)} near-boundary draws in one group, more than the {self.budget} allowed"
        return ""


def _deviation(d: TokenDraw, u: float, tolerance: float) -> float:
    """Smallest distance of u from the token's interval or an admissible nucleus alternative (0: inside one)."""
    best = interval_distance(u, d.lo, d.hi)
    for margin, lo, hi in d.alts:
        if margin <= tolerance:
            best = min(best, 0.0 if inside(u, lo, hi) else interval_distance(u, lo, hi))
    return best


def check_draws(
    draws: Sequence[Sequence[TokenDraw]],
    seed: int,
    tolerance: float,
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
        dist = _deviation(d, float(u[j]), tolerance)
        (flips if dist <= tolerance else forged).append(Deviation(ks[i], t, float(u[j]), dist))
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
