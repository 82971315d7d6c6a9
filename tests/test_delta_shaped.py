"""bench/delta_shaped's drawn 1.5B versions: the shapes are Qwen2.5-1.5B's, and the update model is the one its
docstring says was calibrated on the real GRPO run (Adam's first step changes the real run's share of bf16 elements)."""

from __future__ import annotations

import numpy as np
import pytest

from bench.delta_shaped import QWEN25_15B, RESULTS, SIGMA, bf16_changed, fit_step, measured_steps, tensor_shapes


def test_the_shapes_hold_qwen25_15b_parameter_count():
    shapes = tensor_shapes(QWEN25_15B)
    assert sum(int(np.prod(s)) for _, s in shapes) == 1_543_714_304  # the model card's 1.54B (tied embeddings)
    assert len({n for n, _ in shapes}) == len(shapes) == 1 + 28 * 12 + 1


def test_adams_first_step_changes_the_real_runs_share_of_bf16_elements():
    rng = np.random.default_rng(1)
    w = rng.standard_normal(1 << 20, dtype=np.float32) * np.float32(SIGMA)
    signs = rng.integers(0, 2, w.size, dtype=np.int8).astype(bool)
    real_v1 = measured_steps(RESULTS / "delta.txt")[0][0]  # every weight moved by exactly lr
    assert bf16_changed(w, 1e-6, signs) == pytest.approx(real_v1, rel=0.05)


def test_the_fitted_step_hits_its_target_share():
    rng = np.random.default_rng(2)
    w = rng.standard_normal(1 << 20, dtype=np.float32) * np.float32(SIGMA)
    for target in (0.01, 0.03):
        a = fit_step(w, 1e-6, target, np.random.default_rng(3))
        signs = np.random.default_rng(3).integers(0, 2, w.size, dtype=np.int8).astype(bool)
        assert bf16_changed(w, 1e-6 * a, signs) == pytest.approx(target, rel=0.02)
    assert fit_step(w, 1e-6, 0.01, rng) < fit_step(w, 1e-6, 0.03, rng)
