"""Seeded draws (protocols/draw.py): the uniform is the same bits everywhere, every implementation of the rule
(numpy reference, torch, MLX) picks the same tokens from the same logits, honest samplers pass the replay
check end to end, and injected tokens do not."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
import torch

from node.engines import make_engine
from node.engines.mlx_engine import mlx_draw
from node.intake.draws import Tolerance, assess_group, check_draws
from node.intake.noise import EPSILON, FlipHistory, Mode, sequential_check
from protocols.draw import TokenDraw, cdf, draw_uniform, draw_uniforms, nucleus_mask, reference_draw
from trainer.draws import completion_draws, draw_tokens, token_draws
from trainer.model import load_model
from trainer.tiny_qwen2 import EOS_ID

PROMPT = [1, 4, 5, 6, 7, 8, 23]  # <bos>12345>
ANSWER = [8, 7, 6, 5, 4, EOS_ID]  # 54321<eos>

# u(seed, k, t) for a few triples: any platform, any implementation must give exactly these
GOLDEN = {
    (0, 0, 0): 0.22302239146227731,
    (12345, 3, 7): 0.8911734929076129,
    ((1 << 63) - 1, 63, 4095): 0.5706216395849769,
}


def test_uniform_is_fixed_bits_and_vectorised_the_same():
    for (s, k, t), u in GOLDEN.items():
        assert draw_uniform(s, k, t) == u
        assert draw_uniforms(s, k, t).item() == u
    grid = draw_uniforms(np.arange(50)[:, None, None], np.arange(8)[None, :, None], np.arange(16)[None, None, :])
    loop = [[[draw_uniform(s, k, t) for t in range(16)] for k in range(8)] for s in range(50)]
    assert (grid == np.array(loop)).all()
    assert 0.0 <= grid.min() and grid.max() < 1.0 and abs(grid.mean() - 0.5) < 0.02
    assert len(np.unique(grid)) == grid.size


def random_logits(rng: np.random.Generator, rows: int, vocab: int) -> np.ndarray:
    """Logits rounded to 0.1 (ties in p), some tokens at -inf-like values (p == 0 in float64)."""
    x = np.round(rng.normal(size=(rows, vocab)) * 2, 1)
    x[rng.random((rows, vocab)) < 0.1] = -1e4
    return x.astype(np.float32)


@pytest.mark.parametrize("top_p", [1.0, 0.999, 0.9, 0.5, 0.2])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_every_implementation_picks_the_same_tokens(temperature, top_p):
    rng = np.random.default_rng(int(temperature * 10 + top_p * 1000))
    logits = random_logits(rng, 256, 40)
    u = draw_uniforms(7, np.arange(256), 3)
    ref, ref_lp = reference_draw(logits, u, temperature, top_p)
    tt, tlp = draw_tokens(torch.from_numpy(logits), torch.from_numpy(u), temperature, top_p)
    m64, mlp64 = mlx_draw(mx.array(logits), mx.array(u), temperature, top_p, mx.float64)
    m32, _ = mlx_draw(mx.array(logits), mx.array(u.astype(np.float32)), temperature, top_p, mx.float32)
    assert (tt.numpy() == ref).all()
    assert (np.array(m64) == ref).all()
    assert (np.array(m32) == ref).mean() > 0.99  # float32 (Metal) may flip a draw right at a boundary
    assert np.allclose(tlp.numpy(), ref_lp, atol=1e-9) and np.allclose(np.array(mlp64), ref_lp, atol=1e-5)


def test_draws_follow_the_distribution():
    logits = np.array([[0.0, 1.0, 2.0, -1.0, 0.5]], dtype=np.float32)
    n = 20_000
    u = draw_uniforms(1, 0, np.arange(n))
    toks, _ = reference_draw(np.repeat(logits, n, axis=0), u, 1.0, 1.0)
    p = np.exp(logits[0]) / np.exp(logits[0]).sum()
    assert np.abs(np.bincount(toks, minlength=5) / n - p).max() < 0.01
    nucleus, _ = reference_draw(np.repeat(logits, n, axis=0), u, 1.0, 0.7)
    assert set(np.unique(nucleus)) == {1, 2}  # p = 0.076, 0.207, 0.563, 0.028, 0.126: 0.563 + 0.207 >= 0.7
    assert nucleus_mask(p[None], 0.7)[0].tolist() == [False, True, True, False, False]
    counts = np.bincount(nucleus, minlength=5)[1:3] / n
    assert np.abs(counts - p[1:3] / p[1:3].sum()).max() < 0.01


@pytest.mark.parametrize("top_p", [1.0, 0.95, 0.6])
def test_intervals_match_the_reference_cdf(top_p):
    rng = np.random.default_rng(3)
    logits = random_logits(rng, 64, 30)
    x = logits.astype(np.float64)
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    c = cdf(p, nucleus_mask(p, top_p))
    u = draw_uniforms(11, 0, np.arange(64))
    chosen, _ = reference_draw(logits, u, 1.0, top_p)
    for j, d in enumerate(token_draws(torch.from_numpy(logits), chosen, 1.0, top_p)):
        assert d.lo <= u[j] < d.hi
    for tok in range(30):  # every token, chosen or not: [C_{i-1}, C_i)
        for j, d in enumerate(token_draws(torch.from_numpy(logits), [tok] * 64, 1.0, top_p)):
            lo = c[j, tok - 1] if tok else 0.0
            assert d.lo == pytest.approx(lo, abs=1e-12) and d.hi == pytest.approx(c[j, tok], abs=1e-12)


def test_nucleus_alternatives_cover_a_boundary_decision():
    """A sampler whose p is slightly off keeps a different nucleus; the trainer's alternatives hold its draw."""
    logits = np.log(np.array([[0.30, 0.2999, 0.2, 0.2001]]))
    top_p = 0.55  # kept: token 0 (0.30) + token 1 (0.2999) = 0.5999; mass before token 1 is 0.30
    trainer = token_draws(torch.tensor(logits, dtype=torch.float32), [1], 1.0, top_p)[0]
    assert trainer.hi > trainer.lo and trainer.alts
    sampler_logits = np.log(np.array([[0.30, 0.2999 * 0.99, 0.2, 0.2001]]))
    for tok in range(4):  # whatever the sampler's nucleus, its token's u lies in some admissible interval
        drawn = token_draws(torch.tensor(sampler_logits, dtype=torch.float32), [tok], 1.0, top_p)[0]
        if drawn.hi > drawn.lo:
            mid = (drawn.lo + drawn.hi) / 2
            ours = token_draws(torch.tensor(logits, dtype=torch.float32), [tok], 1.0, top_p)[0]
            near = [ours.lo <= mid < ours.hi] + [lo <= mid < hi for m, lo, hi in ours.alts if m <= 0.1]
            assert any(near), (tok, drawn, ours)
    swap = np.log(np.array([[0.5, 0.25, 0.25]]))  # tie at the boundary: id order keeps token 1
    d1, d2 = token_draws(torch.tensor(np.repeat(swap, 2, axis=0), dtype=torch.float32), [1, 2], 1.0, 0.7)
    assert d1.hi > d1.lo and d2.hi == d2.lo and any(m < 1e-6 and hi > lo for m, lo, hi in d2.alts)


def draws_of(intervals: list[list[tuple[float, float]]]) -> list[list[TokenDraw]]:
    return [[TokenDraw(-1.0, lo, hi) for lo, hi in row] for row in intervals]


def test_check_draws_decides_exact_flip_and_forgery():
    seed = 99
    us = [[draw_uniform(seed, k, t) for t in range(3)] for k in range(2)]
    exact = draws_of([[(u - 0.01, u + 0.01) for u in row] for row in us])
    tol = Tolerance(log_odds=0.05, absolute=1e-6)
    assert check_draws(exact, seed, tol, 0).ok
    flipped = draws_of([[(u + 1e-4, u + 0.05) if (k, t) == (1, 2) else (u - 0.01, u + 0.01) for t, u in enumerate(row)]
                        for k, row in enumerate(us)])  # fmt: skip
    result = check_draws(flipped, seed, tol, 1)
    assert result.ok and len(result.flips) == 1 and result.flips[0].position == 2 and result.flips[0].sample == 1
    assert result.flips[0].distance == pytest.approx(1e-4) and 0 < result.flips[0].log_odds < 0.05
    assert not check_draws(flipped, seed, tol, 0).ok  # over budget
    far = draws_of([[(0.999, 1.0) if t == 1 else (u - 0.01, u + 0.01) for t, u in enumerate(row)] for row in us])
    result = check_draws(far, seed, tol, 10)
    assert not result.ok and {(d.sample, d.position) for d in result.forged} == {(0, 1), (1, 1)}
    assert "not drawn by the seeded rule" in result.reason()
    shifted = check_draws(exact, seed, tol, 0, sample_indices=[1, 0])  # the draws belong to other indices
    assert not shifted.ok


def test_tolerance_is_in_log_odds():
    """The same absolute miss is honest noise next to a boundary at 0.5 and forgery next to one at 0.001."""
    tol = Tolerance(log_odds=0.1, absolute=1e-6)
    seed, u = 5, draw_uniform(5, 0, 0)
    miss = 0.002
    mid_lo = u + miss  # the boundary right above u
    assert 0.05 < u < 0.95 and check_draws(draws_of([[(mid_lo, mid_lo + 0.1)]]), seed, tol, 1).ok
    tiny = TokenDraw(-1.0, 0.001, 0.002)  # u is ~0.001 + far away in log-odds
    assert not check_draws([[tiny]], seed, tol, 1).ok


@pytest.fixture(scope="module")
def trainer_model(tiny_model_dir):
    return load_model(tiny_model_dir).eval()


def test_fp32_mlx_and_torch_sample_the_same_completions(tiny_model_dir):
    kw = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 12, "seed": 2024}
    mlx_gens = make_engine("mlx", tiny_model_dir, bits=None).generate([PROMPT] * 8, **kw)
    torch_gens = make_engine("torch", tiny_model_dir).generate([PROMPT] * 8, **kw)
    assert [g.completion_ids for g in mlx_gens] == [g.completion_ids for g in torch_gens]
    assert [g.finish_reason for g in mlx_gens] == [g.finish_reason for g in torch_gens]
    assert len({tuple(g.completion_ids) for g in mlx_gens}) > 1  # the samples of a group differ
    for a, b in zip(mlx_gens, torch_gens, strict=True):
        assert np.allclose(a.logprobs, b.logprobs, atol=1e-4)
    other = make_engine("torch", tiny_model_dir).generate([PROMPT] * 8, **{**kw, "seed": 2025})
    assert [g.completion_ids for g in other] != [g.completion_ids for g in torch_gens]


@pytest.mark.parametrize(("engine", "bits"), [("mlx", 8), ("mlx", 4), ("torch", None)])
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_honest_samplers_pass_and_injectors_are_caught(tiny_model_dir, trainer_model, engine, bits, top_p):
    e = make_engine(engine, tiny_model_dir, bits=bits)
    mode = Mode(e.name, e.compute, e.quant)
    seed = 31337
    gens = e.generate([PROMPT] * 8, temperature=1.0, top_p=top_p, max_tokens=8, seed=seed)
    comps = [g.completion_ids for g in gens]
    draws = completion_draws(trainer_model, [PROMPT] * 8, comps, 1.0, top_p)
    honest = assess_group(draws, [g.logprobs for g in gens], seed, mode, 1.0, top_p)
    assert honest.ok, honest.reason()
    injected = [ANSWER if k % 2 == 0 else c for k, c in enumerate(comps)]
    forged_draws = completion_draws(trainer_model, [PROMPT] * 8, injected, 1.0, top_p)
    # honest logprobs for the injected tokens, the sampler's own for the rest (exact ones for every sample would get
    # the whole group checked as fp32, the honest q4 samples' flips included)
    claimed = [
        [d.logprob for d in row] if k % 2 == 0 else g.logprobs
        for k, (row, g) in enumerate(zip(forged_draws, gens, strict=True))
    ]
    forged = assess_group(forged_draws, claimed, seed, mode, 1.0, top_p)
    if forged.ok:  # int4's tolerance is wide enough to admit each injected token; not so many rare flips at once
        assert mode.quant == "q4"
        _, p = sequential_check(FlipHistory(), forged.tails, forged.limits.expected)
        assert p < EPSILON
    else:
        assert {d.sample for d in forged.draws.forged} <= {0, 2, 4, 6}


@pytest.mark.parametrize(("engine", "bits"), [("mlx", None), ("torch", None)])
def test_batched_groups_of_different_prompts_draw_as_alone(tiny_model_dir, engine, bits):
    """Left padding and KV-cache row bookkeeping never change a row's draws: one call for many groups samples
    what separate calls would."""
    e = make_engine(engine, tiny_model_dir, bits=bits)
    short, long = [1, 4, 23], [1, 4, 5, 6, 7, 8, 9, 10, 23]
    prompts = [long, short, long, short]
    rows = [(5, 0), (6, 0), (5, 1), (6, 1)]
    kw = {"temperature": 1.0, "top_p": 0.95, "max_tokens": 10}
    together = e.generate_rows(prompts, rows, **kw)
    alone = [e.generate_rows([p], [r], **kw)[0] for p, r in zip(prompts, rows, strict=True)]
    assert [g.completion_ids for g in together] == [g.completion_ids for g in alone]
    assert e.generate([long, long], seed=5, **kw)[1].completion_ids == together[2].completion_ids


def test_token_draws_in_chunks_equal_one_pass(monkeypatch):
    import trainer.draws

    logits = torch.from_numpy(random_logits(np.random.default_rng(5), 50, 30))
    toks = [t % 30 for t in range(50)]
    whole = token_draws(logits, toks, 0.8, 0.9)
    monkeypatch.setattr(trainer.draws, "ROW_ELEMENTS", 30 * 7)  # 7 rows at a time
    assert token_draws(logits, toks, 0.8, 0.9) == whole
