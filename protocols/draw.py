"""Seeded draws: the sampling rule every sampler follows, so the trainer can replay each token choice.

Why: recomputing logprobs proves a sampler reported the right probabilities for its tokens, not that it
*sampled* them; a sampler could inject any completion (say, the right answer) with honest logprobs. With
seeded draws the randomness comes from the trainer's lease, so the trainer can check every token was the
one the rule picks: an injected token lands outside its draw and is caught.

THE SPEC (draw rule "splitmix-cdf/1")
====================================

1. Uniform. For the group seed ``s`` (the lease's task seed, 0 <= s < 2**63), the sample index ``k`` (the
   sample's position in the group, 0-based) and the completion position ``t`` (0-based: the first
   generated token is t = 0), the draw is ``u(s, k, t)`` in [0, 1), computed with 64-bit unsigned integer
   arithmetic only (every product and sum taken mod 2**64), hence bit-identical on every platform::

       mix(z) = z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27; z *= 0x94D049BB133111EB; z ^= z >> 31
       h = mix(s ^ DOMAIN)                     DOMAIN = 0x737761726D726C31 (b"swarmrl1")
       h = mix(h + (k + 1) * 0x9E3779B97F4A7C15)
       h = mix(h + (t + 1) * 0xD1B54A32D192ED03)
       u = (h >> 11) * 2**-53                  (an exact double: 53 random bits)

   ``mix`` is the SplitMix64 finaliser. Unpredictability is not needed (the trainer picks the seed; the
   sampler may know u ahead), only uniform, independent draws the trainer can recompute.

2. Distribution. From the logits z of the step (a row of the model's output), temperature T and top_p:
   ``p = softmax(z / T)``. Nucleus: when top_p >= 1 every token is kept. Otherwise rank tokens by p
   descending, ties by token id ascending; keep the first n tokens, n the smallest count whose cumulative
   mass S_n >= top_p (n = vocabulary size if none reaches it). ``q_i = p_i / Z`` for kept tokens (Z the kept
   mass), 0 for the rest.

3. Choice. In token-id order, ``C_i = (sum of q_j for j <= i)`` is the inclusive CDF; every C_i at or past
   the last token with q > 0 is set to exactly 1. Token i owns the interval ``[C_{i-1}, C_i)`` (C_{-1} = 0);
   these intervals partition [0, 1) (tokens with q = 0 own empty ones). The chosen token is the one whose
   interval holds u: the smallest i with u < C_i.

The reported logprob is log_softmax(z / T) of the chosen token, before the nucleus (unchanged from before).

Arithmetic. The rule is defined on exact values; the reference here computes it in float64 from the given
logits. Samplers may compute in float32 (MLX on a GPU has no float64), and a quantized sampler sees
different logits altogether, so the sampler's CDF and the trainer's recomputed one differ slightly: when u
falls within that difference of a boundary the two pick different tokens. The verifier allows such
"near-boundary flips" within a tolerance and per-group budget (node/intake/draws.py), and nothing else.

Near the nucleus boundary a small difference in p can also change which tokens are kept (top_p < 1 only);
``TokenDraw.alts`` carries the chosen token's interval under the kept set with the boundary token dropped,
the next one added, or the two swapped, each with the ``margin`` a sampler's error must exceed for it to
happen (in log-odds of the ranked mass against top_p, or log-ratio of the two probabilities); the verifier
accepts an alternative (as a flip) when its margin is within tolerance.

Distances are measured in log-odds (``log_odds_distance``): logit errors of size e move a CDF value c by about
c(1 - c) e, so a fixed log-odds tolerance fits flat and peaked distributions alike, with a small absolute
floor for float arithmetic near 0 and 1.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

RULE = "splitmix-cdf/1"
MASK64 = (1 << 64) - 1
DOMAIN = 0x737761726D726C31  # b"swarmrl1"
GAMMA_K = 0x9E3779B97F4A7C15
GAMMA_T = 0xD1B54A32D192ED03
MUL1 = 0xBF58476D1CE4E5B9
MUL2 = 0x94D049BB133111EB
TWO_POW_M53 = 2.0**-53


class TokenDraw(NamedTuple):
    """One completion token as the trainer sees it: its logprob and the interval of u that picks it."""

    logprob: float
    lo: float
    hi: float
    # (margin, lo, hi): the token's interval under a nucleus that differs at its boundary (top_p < 1 only); the
    # margin is the log-odds (or log-ratio) error a sampler needs for its nucleus to differ that way
    alts: tuple[tuple[float, float, float], ...] = ()
    # sum over the row's CDF boundaries of C(1 - C): a boundary moves by C(1 - C) times a log-odds error, so an
    # honest sampler whose boundaries are off by e log-odds on average flips this token with probability ~e * this
    exposure: float = 0.0


# -- the uniform -----------------------------------------------------------------------------------------
def _mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * MUL1) & MASK64
    z = ((z ^ (z >> 27)) * MUL2) & MASK64
    return z ^ (z >> 31)


def draw_uniform(seed: int, k: int, t: int) -> float:
    """u(seed, k, t) in [0, 1): pure Python integers, the definition."""
    h = _mix((seed ^ DOMAIN) & MASK64)
    h = _mix((h + (k + 1) * GAMMA_K) & MASK64)
    h = _mix((h + (t + 1) * GAMMA_T) & MASK64)
    return (h >> 11) * TWO_POW_M53


def _mix_np(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * np.uint64(MUL1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(MUL2)
    return z ^ (z >> np.uint64(31))


def draw_uniforms(seed: int | np.ndarray, k: int | np.ndarray, t: int | np.ndarray) -> np.ndarray:
    """u for broadcast arrays of (seed, k, t): the same bits as ``draw_uniform``, vectorised (uint64 wraps)."""
    s, kk, tt = np.broadcast_arrays(
        np.asarray(seed, dtype=np.uint64), np.asarray(k, dtype=np.uint64), np.asarray(t, dtype=np.uint64)
    )
    with np.errstate(over="ignore"):
        h = _mix_np(s ^ np.uint64(DOMAIN))
        h = _mix_np(h + (kk + np.uint64(1)) * np.uint64(GAMMA_K))
        h = _mix_np(h + (tt + np.uint64(1)) * np.uint64(GAMMA_T))
    return (h >> np.uint64(11)).astype(np.float64) * TWO_POW_M53


# -- the rule (numpy reference, float64) ------------------------------------------------------------------
def nucleus_mask(p: np.ndarray, top_p: float) -> np.ndarray:
    """Kept tokens [..., V] (bool): the smallest highest-probability set with mass >= top_p, ties by lower id."""
    if top_p >= 1.0:
        return np.ones(p.shape, dtype=bool)
    order = np.argsort(-p, axis=-1, kind="stable")  # stable: equal p keep id order
    mass = np.cumsum(np.take_along_axis(p, order, axis=-1), axis=-1)
    n = np.minimum((mass < top_p).sum(axis=-1, keepdims=True) + 1, p.shape[-1])
    ranks = np.arange(p.shape[-1])
    keep = np.zeros(p.shape, dtype=bool)
    np.put_along_axis(keep, order, ranks < n, axis=-1)
    return keep


def cdf(p: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """Inclusive CDF C [..., V] of the renormalised kept distribution, exactly 1 from the last kept token on."""
    q = np.where(keep, p, 0.0)
    c = np.cumsum(q, axis=-1)
    c = c / c[..., -1:]
    positive = q > 0
    last = p.shape[-1] - 1 - np.argmax(positive[..., ::-1], axis=-1)
    return np.where(np.arange(p.shape[-1]) >= last[..., None], 1.0, c)


def reference_draw(
    logits: np.ndarray, u: np.ndarray, temperature: float, top_p: float
) -> tuple[np.ndarray, np.ndarray]:
    """The reference sampler: logits [B, V], u [B] -> (chosen token ids [B], their logprobs [B])."""
    x = np.asarray(logits, dtype=np.float64) / temperature
    x = x - x.max(axis=-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(axis=-1, keepdims=True))
    p = np.exp(logp)
    c = cdf(p, nucleus_mask(p, top_p))
    tokens = (c <= np.asarray(u, dtype=np.float64)[:, None]).sum(axis=-1)
    return tokens, np.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def inside(u: float, lo: float, hi: float) -> bool:
    return lo <= u < hi


def interval_distance(u: float, lo: float, hi: float) -> float:
    """How far u lies outside [lo, hi) (0 inside, and at u == hi: use ``inside`` to tell those apart)."""
    if u < lo:
        return lo - u
    return max(u - hi, 0.0)


def _logit(x: float) -> float:
    x = min(max(x, 2.0**-60), 1.0 - 2.0**-53)
    return math.log(x) - math.log1p(-x)


def log_odds_distance(u: float, lo: float, hi: float) -> float:
    """How far u lies outside [lo, hi) in log-odds, |logit(u) - logit(c)| for the nearer boundary c (0 inside).

    The natural scale of honest error: with logit errors e_j, a CDF value c moves, to first order, by
    c(1 - c) * (mean e below the boundary - mean e above it), so logit(c) moves by at most the spread of the
    errors whatever the distribution's shape; in absolute terms boundaries of flat distributions barely move
    and those between a few likely tokens move a lot.
    """
    if inside(u, lo, hi):
        return 0.0
    return abs(_logit(u) - _logit(lo if u < lo else hi))
