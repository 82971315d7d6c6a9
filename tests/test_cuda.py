"""The learner on a CUDA GPU (skipped where torch sees none): a bf16 mixed-precision step, and bf16 versions that
score within bf16 rounding of fp32 on the same device."""

from __future__ import annotations

import random

import pytest
import torch

from trainer.groups import Group
from trainer.learner import Learner
from trainer.settings import LearnerSettings

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible to torch here")


def batch(n: int = 4) -> list[Group]:
    rng = random.Random(0)
    out = []
    for g in range(n):
        prompt = [1, *(rng.randrange(3, 13) for _ in range(6))]
        comps = [[rng.randrange(3, 13) for _ in range(rng.randrange(2, 8))] for _ in range(4)]
        lps = [[-1.5] * len(c) for c in comps]
        out.append(
            Group(f"g{g}", "p", 0, "reverse", g, prompt, comps, lps, lps, [0.0, 1.0, 0.5, 0.2], [False] * 4, 1.0)
        )
    return out


def test_auto_picks_cuda_and_bf16_and_a_step_runs(tmp_path, tiny_model_dir):
    ln = Learner(tiny_model_dir, LearnerSettings(), keep_versions=2, work_dir=tmp_path)
    assert ln.precision.device.type == "cuda" and ln.precision.name == "bf16"
    before = {n: p.detach().clone() for n, p in ln.model.named_parameters()}
    metrics = ln.step(batch())
    assert metrics["grad_norm"] > 0 and next(ln.model.parameters()).dtype == torch.float32
    assert any(not torch.equal(before[n], p) for n, p in ln.model.named_parameters())
    assert ln.new_version() == 1 and ln.scorer.model.device.type == "cuda"


def test_bf16_and_fp32_logprobs_agree_on_cuda(tmp_path, tiny_model_dir):
    bf16 = Learner(tiny_model_dir, LearnerSettings(device="cuda", dtype="bf16"), 2, tmp_path / "bf16")
    fp32 = Learner(tiny_model_dir, LearnerSettings(device="cuda", dtype="fp32"), 2, tmp_path / "fp32")
    g = batch(1)[0]
    prompts = [g.prompt_ids] * len(g.completions)
    a = bf16.logprobs(0, prompts, g.completions, 1.0)
    b = fp32.logprobs(0, prompts, g.completions, 1.0)
    diffs = [abs(x - y) for r, s in zip(a, b, strict=True) for x, y in zip(r, s, strict=True)]
    assert max(diffs) < 0.1 and sum(diffs) / len(diffs) < 0.02
