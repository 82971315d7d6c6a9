"""How much honest arithmetic noise explains, per sampler mode: the limits of the logprob and draw checks, derived
from a measured noise model rather than set as one threshold per declared quantization. No torch.

THE MODEL
=========
A sampler declares its mode: engine (mlx, torch), compute dtype (fp32, bf16, fp16) and weight quantization (none,
q8, q4). The trainer decides which quantizations it trains on (``--accept-quant``; default none,q8: no int4) and
binds a peer to the mode it declared first. The *noise class* of a mode is (quantization, compute dtype): the
engine does not matter (torch and MLX in fp32 agree to ~1e-6), and each class has measured parameters
(bench/draws.py on the realistic trained model, bench/results/draws.txt):

- ``Tail.shift`` rho: honest flips per unit of *exposure* at T = 1. A token's exposure (protocols/draw.py
  ``TokenDraw.exposure``, computed by the trainer's replay) is the sum of C(1 - C) over its CDF boundaries; a
  boundary off by e log-odds moves by C(1 - C) e, so a position flips with probability ~ E|e| * exposure. Logits
  are divided by T before the softmax, so errors in log-odds scale as 1/T. Expected honest flips in a group:
  lambda = rho * X / T, X its summed exposure. Exposure is what makes one limit fit flat and peaked models.
- the tail of flip distances d (log-odds, times T): the share of honest flips further than x is q(x) =
  q0 (x / d0)^(-alpha) beyond d0 (``Tail.start``; q0 ``share``, alpha ``alpha``; 1 below d0). Shift and tail are
  measured apart for top_p = 1 and top_p < 1, where sampler and trainer can keep different token sets. Measured
  tails are heavy (Pareto, alpha ~1.6-1.8: rare positions where several near-equal tokens straddle u), so a hard
  cut at the largest distance ever seen would refuse an honest sampler now and then; the model says how rare
  each distance is instead.
- the claimed-vs-replayed logprob error: bounds on a group's mean and max, and the TIS clamp.
- ``noise_ref``: the class's median *normalised* logprob noise (``measured_noise``). A group whose logprobs show
  more (a bigger model's logits are noisier in bf16 than the small calibration model's) gets its shift and tail
  scaled by the ratio, capped by the trainer's ``--noise-scale-cap`` (default 1: no widening). Limits can then
  follow the noise each peer shows, but a peer that fakes noise widens its own by the same factor (its logprobs
  still face the class's bounds, and the TIS clamp takes the fake noise out of the loss): see ``noise_scale``.

Per group, with failure probability EPSILON = 1e-6 for an honest sampler of the class (split between the two):

- budget: the smallest b with P(Poisson(kappa * lambda) > b) <= EPSILON / 2 (kappa = ``RATE_MARGIN`` covers
  models noisier than the calibration one), so at most b tokens may lie outside their replayed interval;
- tolerance: no flip may lie further than tau, where kappa * lambda * q(tau T) = EPSILON / 2 (the expected number
  of honest flips that far out), i.e. tau = d0 (2 q0 kappa lambda / EPSILON)^(1 / alpha) / T (d0 / T when even
  one flip is that unlikely), but at most HARD_MARGIN = 3 times the largest honest flip measured (``Tail.largest``).
  That cap is an assumption, stated: a boundary moves by at most the spread of the logit errors (protocols/
  draw.py), which the largest logprob errors measured bound from below (int8 on fp32: flips up to 0.24 log-odds,
  logprob errors up to 0.27 nats), while the Pareto fit extrapolated without end would put ~1e-4 of int8 flips
  beyond 3x the largest seen. bench/draws.py measures the result: 0 honest groups refused.

A single near-boundary flip is evidence, not a verdict. Per peer, over its groups, the trainer sums the honest
expectation L (kappa * lambda) and counts flips F_j beyond the distances where q = 10^-1, 10^-2, 10^-3, 10^-4:
honest noise puts Poisson(L 10^-j) flips there. The peer is struck when any P(Poisson(L 10^-j) >= F_j) falls
below EPSILON / 4, and starts a fresh history. A steerer picks tokens whose intervals lie near u; every pick
beyond the typical honest distance is rare under honest noise, so it is struck after a couple of them, and what it
can do undetected is bounded: about (kappa - 1) * lambda extra flips per group, each within the 90th percentile
of honest distances (d0 / T, under 0.01 log-odds for int8) of its draw.

A peer cannot choose its own limits: the class is the *tighter* of the declared one and what its logprobs show.
An honest fp32 sampler's logprobs match the replay to ~1e-6; normalised by how much each token could move
(1 - p: a near-certain token's logprob barely moves however noisy the logits), a group whose noise is below the
fp32 bound is checked with fp32 limits whatever it declares. A trainer that scores in bf16 adds its own noise:
the classes are then floored at none/bf16.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

EPSILON = 1e-6  # an honest sampler's false-strike probability per group
RATE_MARGIN = 2.0  # kappa: honest flip rates up to this multiple of the calibration are covered
ABSOLUTE = 1e-4  # float arithmetic near 0 and 1 (an MLX draw on Metal is float32): always admitted
HARD_MARGIN = 3.0  # the per-group tolerance never exceeds this multiple of the largest honest flip measured
NOISE_SCALE_CAP = 1.0  # default --noise-scale-cap: how far a group's limits may widen with its measured noise


@dataclass(frozen=True)
class Mode:
    """What a sampler declares it runs."""

    engine: str
    compute: str
    quant: str

    def __str__(self) -> str:
        return f"{self.engine}/{self.compute}/{self.quant}"

    @property
    def noise_class(self) -> str:
        return f"{self.quant}/{self.compute}"


@dataclass(frozen=True)
class Tail:
    """Honest flips in one sampling regime (top_p = 1, or top_p < 1, where the kept set itself can differ)."""

    shift: float  # rho: flips per unit exposure at T = 1
    start: float  # d0, log-odds x T: the distance 90% of flips stay within
    share: float  # q0: share of flips beyond d0
    alpha: float  # Pareto exponent beyond d0 (its lower confidence bound: a heavier tail than measured)
    largest: float  # the largest flip distance measured (log-odds x T)

    def survival(self, distance: float, temperature: float, scale: float = 1.0) -> float:
        """q: the share of honest flips at least ``distance`` (log-odds) from their interval."""
        x = distance * temperature / scale
        return 1.0 if x <= self.start else self.share * (x / self.start) ** -self.alpha

    def heavier(self, other: Tail) -> Tail:
        return Tail(
            max(self.shift, other.shift),
            max(self.start, other.start),
            max(self.share, other.share),
            min(self.alpha, other.alpha),
            max(self.largest, other.largest),
        )


@dataclass(frozen=True)
class NoiseClass:
    """Measured honest noise of one (quantization, compute dtype) against the trainer's float64 replay."""

    full: Tail  # top_p = 1
    nucleus: Tail  # top_p < 1
    logprob_mean: float  # bound on a group's mean |claimed - replayed| logprob
    logprob_max: float  # bound on any token's
    tis_clamp: float  # what a claimed logprob may move the importance weight by (about honest p99)
    noise_ref: float = 0.0  # the class's median normalised logprob noise (measured_noise) on the calibration model

    def tail(self, top_p: float) -> Tail:
        return self.full if top_p >= 1.0 else self.nucleus


# Written by `bench/draws.py report --write` (bench/results/draws.txt): realistic trained Llama, G=8, max_tokens=16,
# T 0.6/1.0, top_p 1.0/0.9. Where (almost) no flip was seen: shift >= 1e-6, tail from >= 0.002 with alpha 4.
# NoiseClass(top_p = 1 Tail(shift, start, share, alpha, largest), top_p < 1 Tail, logprob mean bound, max bound,
# TIS clamp, median normalised noise)
NOISE: dict[str, NoiseClass] = {
    "none/fp32": NoiseClass(
        Tail(1e-06, 0.002, 1, 4, 0.005), Tail(1e-06, 0.002, 1, 4, 0.005), 0.001, 0.01, 0.01, 4.11e-07
    ),
    "q8/fp32": NoiseClass(
        Tail(0.00132, 0.00957, 0.1, 1.47, 0.241),
        Tail(0.00132, 0.0141, 0.101, 0.442, 0.241),
        0.0299,
        0.808,
        0.0149,
        0.00404,
    ),
    "q8/bf16": NoiseClass(
        Tail(0.00731, 0.0782, 0.1, 2.56, 0.568), Tail(0.00731, 0.0802, 0.1, 1.22, 18.5), 0.232, 2.19, 0.155, 0.049
    ),
    "none/bf16": NoiseClass(
        Tail(0.00156, 0.0108, 0.101, 1.38, 0.147),
        Tail(0.00156, 0.0163, 0.109, 1.03, 0.147),
        0.0641,
        0.976,
        0.0238,
        0.00829,
    ),
    "q4/fp32": NoiseClass(
        Tail(0.0107, 0.0741, 0.1, 1.64, 4.11), Tail(0.0124, 0.0781, 0.1, 1.64, 35.3), 0.551, 13.4, 0.181, 0.0576
    ),
    "q4/bf16": NoiseClass(
        Tail(0.0138, 0.0925, 0.1, 2.01, 1.62), Tail(0.0143, 0.0925, 0.1, 1.38, 18.5), 0.354, 6, 0.231, 0.0771
    ),
    "q8/fp16": NoiseClass(
        Tail(0.00141, 0.0111, 0.102, 1.36, 0.0478),
        Tail(0.00141, 0.0274, 1, 1.36, 0.0478),
        0.042,
        0.608,
        0.0244,
        0.00792,
    ),
    "none/fp16": NoiseClass(
        Tail(0.000236, 0.00232, 1, 4, 0.005), Tail(0.000236, 0.00232, 1, 4, 0.005), 0.00335, 0.032, 0.01, 0.00105
    ),
    "wire8/fp32": NoiseClass(
        Tail(0.00112, 0.0086, 0.101, 1.24, 0.139), Tail(0.00112, 0.0274, 1, 1.24, 0.139), 0.027, 0.439, 0.0132, 0.00327
    ),
    "wire8/bf16": NoiseClass(
        Tail(0.00692, 0.08, 0.1, 2.22, 0.459), Tail(0.00692, 0.105, 0.101, 0.989, 18.5), 0.208, 2.22, 0.164, 0.0512
    ),
}
QUIET = 2e-5  # fp32 samplers' normalised logprob noise stays below this (measured max 2.2e-6, x 10)


def noise_class(name: str) -> NoiseClass:
    """The class's parameters; a class never measured (q4/fp16) takes the noisiest of its quantization's."""
    if name in NOISE:
        return NOISE[name]
    quant = name.split("/")[0]
    same = [c for k, c in NOISE.items() if k.startswith(quant + "/")]
    if not same:
        raise KeyError(name)
    return max(same, key=lambda c: (c.full.shift, c.full.start))


def floor_class(cls: NoiseClass, floor: NoiseClass) -> NoiseClass:
    """Noise at least ``floor``'s in every parameter (a bf16 scorer's own noise under every sampler's)."""
    return NoiseClass(
        cls.full.heavier(floor.full),
        cls.nucleus.heavier(floor.nucleus),
        max(cls.logprob_mean, floor.logprob_mean),
        max(cls.logprob_max, floor.logprob_max),
        max(cls.tis_clamp, floor.tis_clamp),
        max(cls.noise_ref, floor.noise_ref),
    )


def noise_scale(noise: float | None, cls: NoiseClass, cap: float = NOISE_SCALE_CAP) -> float:
    """How much noisier than the calibration model this group's logits look: its normalised logprob noise over the
    class's median, between 1 and ``cap``. A bigger model (deeper, larger activations) computed in bf16 shows
    larger logit errors than the small calibration model; its flips and their distances grow with them. But a peer
    can fake noise in its logprobs (within the class's bounds) to widen its own limits by the same factor, so the
    default cap is 1: measured on the calibration model, honest groups need no widening (0 refused at 1), while a
    one-token injector faking 4x noise got 50 groups accepted before its ban at cap 4 against 4 at cap 1."""
    if noise is None or cls.noise_ref <= 0:
        return 1.0
    return min(max(noise / cls.noise_ref, 1.0), max(cap, 1.0))


def poisson_upper(lam: float, eps: float) -> int:
    """The smallest b with P(N > b) <= eps for N ~ Poisson(lam)."""
    if lam <= 0:
        return 0
    term = math.exp(-lam)
    cdf = term
    b = 0
    while 1.0 - cdf > eps and b < 100_000:
        b += 1
        term *= lam / b
        cdf += term
    return b


def poisson_sf(k: int, lam: float) -> float:
    """P(N >= k) for N ~ Poisson(lam), computed from the lower tail's terms (exact enough for k up to ~1e4)."""
    if k <= 0:
        return 1.0
    if lam <= 0:
        return 0.0
    log_term = -lam
    below = 0.0
    for i in range(k):
        if i:
            log_term += math.log(lam / i)
        below += math.exp(log_term)
    if below < 0.999:
        return max(0.0, 1.0 - below)
    # 1 - below loses precision: sum the upper tail directly from k
    log_term = -lam + k * math.log(lam) - math.lgamma(k + 1)
    total, i = 0.0, k
    while True:
        t = math.exp(log_term)
        total += t
        if t < total * 1e-12 or i > k + 100_000:
            return total
        i += 1
        log_term += math.log(lam / i)


@dataclass(frozen=True)
class GroupLimits:
    """The limits one group is checked against, and why: an operator can report a false strike from this."""

    mode: str  # as declared
    cls: str  # the noise class applied
    expected: float  # honest flips expected (kappa * lambda)
    budget: int
    log_odds: float  # tolerance
    absolute: float = ABSOLUTE

    def describe(self) -> str:
        return (
            f"limits for {self.mode} (noise class {self.cls}): tolerance {self.log_odds:.3g} log-odds, "
            f"at most {self.budget} near-boundary flips (honest expectation {self.expected:.2g})"
        )


def group_limits(
    mode: str,
    cls_name: str,
    cls: NoiseClass,
    exposure: float,
    temperature: float,
    top_p: float,
    scale: float = 1.0,
) -> GroupLimits:
    """Budget and tolerance for a group of summed ``exposure`` sampled at (``temperature``, ``top_p``), its
    logits ``scale`` times as noisy as the class's calibration (``noise_scale``)."""
    tail = cls.tail(top_p)
    lam = RATE_MARGIN * tail.shift * scale * exposure / temperature
    budget = poisson_upper(lam, EPSILON / 2)
    # kappa lambda q(tau) = EPSILON / 2, q(x) = q0 (x / d0)^-alpha beyond d0
    ratio = max(2 * tail.share * lam / EPSILON, 1.0)
    tau = scale * min(tail.start * ratio ** (1.0 / tail.alpha), HARD_MARGIN * tail.largest) / temperature
    return GroupLimits(mode, cls_name, lam, budget, tau)


def measured_noise(claimed: Sequence[float], replayed: Sequence[float]) -> float | None:
    """A group's logprob noise normalised by leverage: sum |claimed - replayed| / sum (1 - p), p = exp(replayed).

    An honest sampler's logprob error on token i is e_i - E_p[e] ~ (1 - p_i)(e_i - e_rest) for logit errors e, so
    a near-certain token shows none however noisy the logits; dividing by the summed leverage estimates the
    logit noise itself. None when the group has too little leverage to tell (every token near-certain)."""
    lev = sum(1.0 - math.exp(min(r, 0.0)) for r in replayed)
    if lev < 0.05:
        return None
    return sum(abs(c - r) for c, r in zip(claimed, replayed, strict=True)) / lev


def effective_class(declared: str, noise: float | None) -> str:
    """The class a group is checked as: none/fp32 when its measured logprob noise is fp32-quiet (logits that
    exact were neither quantized nor computed in half precision), whatever it declared; else the declared one."""
    return "none/fp32" if noise is not None and noise <= QUIET else declared


LEVELS = (1e-1, 1e-2, 1e-3, 1e-4)  # tail shares the sequential test counts flips beyond


@dataclass(frozen=True)
class FlipHistory:
    """A peer's near-boundary flips against honest expectation over its groups: the summed expectation
    (kappa * lambda) and, per tail level, how many flips were at least that rare."""

    expected: float = 0.0
    beyond: tuple[int, ...] = (0,) * len(LEVELS)
    groups: int = 0


def sequential_check(history: FlipHistory, tails: Sequence[float], expected: float) -> tuple[FlipHistory, float]:
    """Add one group: ``tails`` is q (``NoiseClass.tail``) of each of its flips, ``expected`` its kappa * lambda.
    Returns the new history and the smallest p-value over the levels, P(Poisson(L * level) >= flips beyond it),
    times the number of levels (Bonferroni). Below EPSILON the peer is steering: strike it, start afresh."""
    beyond = tuple(n + sum(q <= level for q in tails) for n, level in zip(history.beyond, LEVELS, strict=True))
    h = FlipHistory(history.expected + expected, beyond, history.groups + 1)
    p = min(poisson_sf(n, max(h.expected * level, 1e-300)) for n, level in zip(beyond, LEVELS, strict=True))
    return h, min(1.0, p * len(LEVELS))
