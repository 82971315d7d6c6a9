"""The honest-noise model behind verification (node/intake/noise.py): pure functions, checked against brute force
and against what they must guarantee (an honest peer is not struck, a cheater cannot pick its limits)."""

from __future__ import annotations

import math
import random

import pytest

from node.intake.draws import assess_group
from node.intake.noise import (
    EPSILON,
    NOISE,
    QUIET,
    FlipHistory,
    Mode,
    effective_class,
    group_limits,
    measured_noise,
    noise_class,
    noise_scale,
    poisson_sf,
    poisson_upper,
    sequential_check,
)
from protocols.draw import TokenDraw, draw_uniforms


def brute_sf(k: int, lam: float) -> float:
    return 1.0 - sum(math.exp(-lam) * lam**i / math.factorial(i) for i in range(k))


@pytest.mark.parametrize("lam", [1e-4, 0.01, 0.5, 3.0, 20.0])
def test_poisson_tail_and_budget_agree_with_brute_force(lam):
    for k in range(0, 40):
        assert poisson_sf(k, lam) == pytest.approx(max(brute_sf(k, lam), 0.0), rel=1e-6, abs=1e-15)
    b = poisson_upper(lam, 1e-6)
    assert brute_sf(b + 1, lam) <= 1e-6 < (brute_sf(b, lam) if b > 0 else 1.0)


def test_every_mode_has_a_measured_noise_class_and_fp32_is_the_tightest():
    for quant in ("none", "q8", "q4"):
        for compute in ("fp32", "bf16", "fp16"):
            noise_class(f"{quant}/{compute}")  # measured, or the noisiest of its quantization
    fp32 = NOISE["none/fp32"]
    for name, cls in NOISE.items():
        assert cls.full.shift >= fp32.full.shift and cls.logprob_max >= fp32.logprob_max, name
        # top_p < 1 adds the kept set's noise to every boundary's: never a lighter tail
        assert cls.nucleus.largest >= cls.full.largest and cls.nucleus.alpha <= cls.full.alpha, name


def test_limits_widen_with_exposure_and_temperature_but_not_for_fp32_noise():
    bf16 = noise_class("q8/bf16")
    small = group_limits("m", "q8/bf16", bf16, exposure=1.0, temperature=1.0, top_p=1.0)
    big = group_limits("m", "q8/bf16", bf16, exposure=100.0, temperature=1.0, top_p=1.0)
    cold = group_limits("m", "q8/bf16", bf16, exposure=100.0, temperature=0.5, top_p=1.0)
    assert small.budget <= big.budget <= cold.budget and big.expected < cold.expected
    assert cold.log_odds > big.log_odds  # logit errors are divided by T
    tight = group_limits("m", "none/fp32", noise_class("none/fp32"), exposure=100.0, temperature=1.0, top_p=1.0)
    assert tight.log_odds < big.log_odds and tight.budget <= big.budget
    assert "q8/bf16" in big.describe() and "tolerance" in big.describe()


def test_measured_noise_is_normalised_by_leverage():
    # near-certain tokens carry no leverage: no measurement rather than a falsely quiet one
    assert measured_noise([-1e-6] * 10, [-2e-6] * 10) is None
    # the same logit noise shows as small logprob errors on likely tokens and large ones on unlikely tokens
    likely = measured_noise([-0.11, -0.11], [-0.1, -0.1])
    unlikely = measured_noise([-2.1, -2.1], [-2.0, -2.0])
    assert likely is not None and unlikely is not None
    assert likely == pytest.approx(0.01 / (1 - math.exp(-0.1)))
    assert effective_class("q8/bf16", 0.0) == "none/fp32"
    assert effective_class("q8/bf16", 10 * QUIET) == "q8/bf16"
    assert effective_class("q8/bf16", None) == "q8/bf16"


def test_sequential_test_spares_honest_noise_and_strikes_a_steady_steerer():
    rng = random.Random(0)
    expected = 0.4  # kappa * lambda per group: honest flips average half of it
    history, lowest = FlipHistory(), 1.0
    for _ in range(5000):
        flips = sum(rng.random() < 0.2 / 50 for _ in range(50))  # Poisson-like, mean 0.2
        # an honest flip's survival value q is uniform on [0, 1] when the tail model is right
        history, p = sequential_check(history, [rng.random() for _ in range(flips)], expected)
        lowest = min(lowest, p)
    assert lowest > EPSILON
    # a steerer adding one pick per group, each only as far out as 1 honest flip in 20: within any per-group
    # budget and tolerance, but too many far flips for its history
    history, struck_at = FlipHistory(), None
    for i in range(1, 200):
        history, p = sequential_check(history, [0.05], expected)
        if p < EPSILON:
            struck_at = i
            break
    assert struck_at is not None and struck_at < 30
    # two flips rarer than 1 in 10,000 honest ones strike at once
    _, p = sequential_check(FlipHistory(), [1e-5, 2e-5], expected)
    assert p < EPSILON


def draws_for(seed: int, n: int, width: float, p: float = 0.5) -> list[list[TokenDraw]]:
    """One sample of n tokens whose intervals hold the seed's draws, each ``width`` wide, exposure 1."""
    us = draw_uniforms(seed, 0, list(range(n)))
    return [[TokenDraw(math.log(p), max(0.0, u - width / 2), min(1.0, u + width / 2), (), 1.0) for u in us.tolist()]]


def test_a_cheater_with_exact_logprobs_gets_fp32_limits_whatever_it_declares():
    seed, n = 7, 40
    draws = draws_for(seed, n, 0.2)
    # move one token's interval off its draw by ~0.1 log-odds: a q8/bf16 flip, never an fp32 one
    d = draws[0][5]
    u = float(draw_uniforms(seed, 0, 5))
    lo = min(1 - 1e-9, u + u * (1 - u) * 0.1)
    draws[0][5] = TokenDraw(d.logprob, lo, min(1.0, lo + 0.1), (), 1.0)
    exact = [[x.logprob for x in draws[0]]]
    declared = Mode("mlx", "bf16", "q8")
    as_exact = assess_group(draws, exact, seed, declared, 1.0, 1.0)
    assert as_exact.cls == "none/fp32" and not as_exact.ok
    assert "none/fp32" in as_exact.reason() and "mlx/bf16/q8" in as_exact.reason()
    noisy = [[x + (0.02 if i % 2 else -0.02) for i, x in enumerate(exact[0])]]  # bf16-like logprob noise
    as_noisy = assess_group(draws, noisy, seed, declared, 1.0, 1.0)
    assert as_noisy.cls == "q8/bf16" and as_noisy.ok, as_noisy.reason()


def test_limits_widen_with_measured_noise_only_as_far_as_the_trainer_allows():
    cls = noise_class("q8/bf16")
    assert noise_scale(None, cls, 4.0) == 1.0 and noise_scale(cls.noise_ref / 2, cls, 4.0) == 1.0
    assert noise_scale(3 * cls.noise_ref, cls, 4.0) == pytest.approx(3.0)
    assert noise_scale(10 * cls.noise_ref, cls, 4.0) == 4.0 and noise_scale(10 * cls.noise_ref, cls) == 1.0
    base = group_limits("m", "q8/bf16", cls, 50.0, 1.0, 1.0)
    wide = group_limits("m", "q8/bf16", cls, 50.0, 1.0, 1.0, scale=3.0)
    assert wide.log_odds > 2 * base.log_odds and wide.expected == pytest.approx(3 * base.expected)


def test_lossy_transport_floors_every_sampler_at_its_own_noise():
    """Versions that travel int8 rowwise (--weights-encoding int8) put their rounding under every sampler, even
    one that runs them in fp32 without quantizing: the trainer checks each group at least at that noise."""
    seed, n = 3, 40
    draws = draws_for(seed, n, 0.2)
    exact = [[x.logprob for x in draws[0]]]
    fp32 = Mode("mlx", "fp32", "none")
    plain = assess_group(draws, exact, seed, fp32, 1.0, 1.0)
    wired = assess_group(draws, exact, seed, fp32, 1.0, 1.0, transport="wire8")
    assert plain.cls == "none/fp32" and wired.cls == "none/fp32+wire8/fp32 transport"
    assert wired.limits.log_odds > plain.limits.log_odds and wired.logprob_bounds > plain.logprob_bounds
    assert wired.tis_clamp >= noise_class("wire8/fp32").tis_clamp
    # an fp16 sampler on a wire8 swarm: a class never measured falls back to the noisiest one measured
    assert assess_group(draws, exact, seed, Mode("mlx", "fp16", "q8"), 1.0, 1.0, transport="wire8").ok
