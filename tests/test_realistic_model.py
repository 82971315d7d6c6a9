"""The realistic test model (trainer/realistic_model.py): trained, peaked like a real checkpoint, opened the same
way by stock transformers, mlx-lm and both engines; reduced-precision compute really happens."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import numpy as np

from trainer.realistic_model import DATASET, question, render_prompt


def test_it_is_a_trained_llama_with_peaked_distributions(realistic_model_dir):
    from trainer.realistic_model import peakedness

    cfg = json.loads((realistic_model_dir / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["rope_theta"] == 5e5 and not cfg["tie_word_embeddings"]
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]
    assert sum(1 for _ in open(realistic_model_dir / DATASET)) == 2500
    peaks = peakedness(realistic_model_dir, prompts=16)
    # mostly near-certain next tokens (a random-init model's top-1 is ~1/V), with some real choices among them
    assert peaks["median_top1"] > 0.95 and peaks["frac_top1_over_0.9"] > 0.4 and peaks["mean_entropy"] > 0.2


def test_stock_mlx_lm_and_transformers_agree_on_it(realistic_model_dir):
    import mlx.core as mx
    import mlx_lm
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.model import LOAD_LOCK

    tok = AutoTokenizer.from_pretrained(realistic_model_dir)
    ids = render_prompt(tok, question(12, 34))
    with LOAD_LOCK:
        hf = AutoModelForCausalLM.from_pretrained(realistic_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([ids])).logits[0].numpy()
    model, _ = mlx_lm.load(str(realistic_model_dir))
    got = np.array(model(mx.array([ids]))[0].astype(mx.float32))
    assert np.abs(got - want).max() < 1e-3  # rope_theta is written flat: stock mlx-lm reads it


def test_engines_compute_in_the_dtype_they_declare(realistic_model_dir):
    from transformers import AutoTokenizer

    from node.engines import make_engine

    tok = AutoTokenizer.from_pretrained(realistic_model_dir)
    prompt = render_prompt(tok, question(3, 4))
    kw = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 12, "seed": 11}
    ref = make_engine("torch", realistic_model_dir, bits=None).generate([prompt] * 4, **kw)
    for compute, lo, hi in (("fp32", 0.0, 1e-4), ("bf16", 1e-4, 2.0)):
        e = make_engine("mlx", realistic_model_dir, bits=None, compute=compute)
        assert e.compute == compute and e.quant == "none"
        gens = e.generate([prompt] * 4, **kw)
        diffs = [
            abs(a - b)
            for g, r in zip(gens, ref, strict=True)
            if g.completion_ids == r.completion_ids
            for a, b in zip(g.logprobs, r.logprobs, strict=True)
        ]
        assert diffs and lo <= max(diffs) < hi, (compute, max(diffs))


def _build_in_a_process(root: str, builds) -> None:
    import time

    import trainer.realistic_model as rm

    def counting_build(path, cfg) -> None:
        with builds.get_lock():
            builds.value += 1
        time.sleep(0.5)  # long enough for the others to arrive while it builds
        Path(path).mkdir(parents=True)
        (Path(path) / rm.DATASET).write_text("built")

    rm.build_realistic_model = counting_build
    rm.cached_realistic_model(cache_dir=Path(root))


def test_callers_at_once_build_the_fixture_once(tmp_path):
    """The suite's workers ask for the fixture at the same moment: one builds it, the others wait and take it."""
    ctx = multiprocessing.get_context("fork")
    builds = ctx.Value("i", 0)
    procs = [ctx.Process(target=_build_in_a_process, args=(str(tmp_path), builds)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert builds.value == 1
