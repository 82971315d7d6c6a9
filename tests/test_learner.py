"""The learner on its own: micro-batched gradients equal the one-pass gradient, bf16 mixed precision publishes
bf16 versions that score like the fp32 master weights, and version files stay bounded."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from trainer.groups import Group
from trainer.learner import Learner
from trainer.settings import LearnerSettings


def groups(n: int, seed: int = 0) -> list[Group]:
    """Groups with prompts and completions of different lengths (so micro-batches pad differently)."""
    rng = random.Random(seed)
    out = []
    for g in range(n):
        prompt = [1, *(rng.randrange(3, 13) for _ in range(rng.randrange(3, 9)))]
        comps = [[rng.randrange(3, 13) for _ in range(rng.randrange(1, 9))] for _ in range(4)]
        lps = [[-1.5] * len(c) for c in comps]
        out.append(
            Group(f"g{g}", "p", 0, "reverse", g, prompt, comps, lps, lps, [0.1, 0.9, 0.4, 0.0], [False] * 4, 1.0)
        )
    return out


def learner(tmp_path, model_dir, **kw) -> Learner:
    return Learner(model_dir, LearnerSettings(**kw), keep_versions=3, work_dir=tmp_path)


def grads(ln: Learner) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in ln.model.named_parameters() if p.grad is not None}


def test_micro_batched_gradients_equal_the_one_pass_gradient(tmp_path, tiny_model_dir):
    batch = groups(6)
    whole = learner(tmp_path / "a", tiny_model_dir, micro_batch_tokens=1 << 20)
    stats_whole, n = whole.backward(batch)
    small = learner(tmp_path / "b", tiny_model_dir, micro_batch_tokens=24)  # many micro-batches of a few rows
    stats_small, n_small = small.backward(batch)
    assert n == n_small == sum(len(c) for g in batch for c in g.completions)
    g1, g2 = grads(whole), grads(small)
    assert g1.keys() == g2.keys() and len(g1) > 10
    for name in g1:
        assert torch.allclose(g1[name], g2[name], rtol=1e-4, atol=1e-7), name
    assert stats_whole.loss == pytest.approx(stats_small.loss, rel=1e-5)
    assert stats_whole.tis_mean == pytest.approx(stats_small.tis_mean, rel=1e-6)


def test_bf16_versions_are_bf16_and_score_close_to_the_fp32_master(tmp_path, tiny_model_dir):
    ln = learner(tmp_path, tiny_model_dir, dtype="bf16", device="cpu")
    metrics = ln.step(groups(4))
    assert metrics["tokens"] > 0 and ln.steps == 1
    assert ln.new_version() == 1
    with safe_open(str(ln.scorer.path(1)), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert next(ln.model.parameters()).dtype == torch.float32  # master weights stay fp32
    out = ln.save_model_dir(tmp_path / "published")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    # the bf16 version scores within bf16 rounding of the fp32 master weights
    fp32 = learner(tmp_path / "fp32", tiny_model_dir, dtype="fp32")
    fp32.model.load_state_dict(ln.model.state_dict())
    fp32.new_version()
    g = groups(2, seed=1)
    prompts = [g[0].prompt_ids] * 4
    ours = ln.logprobs(1, prompts, g[0].completions, 1.0)
    ref = fp32.logprobs(1, prompts, g[0].completions, 1.0)
    diffs = [abs(a - b) for x, y in zip(ours, ref, strict=True) for a, b in zip(x, y, strict=True)]
    assert max(diffs) < 0.1 and sum(diffs) / len(diffs) < 0.02


def test_only_the_kept_versions_stay_on_disk_and_old_ones_cannot_be_scored(tmp_path, tiny_model_dir):
    ln = learner(tmp_path, tiny_model_dir)
    for _ in range(5):
        ln.new_version()
    assert ln.scorer.kept() == [3, 4, 5]
    g = groups(1)[0]
    assert ln.logprobs(2, [g.prompt_ids], g.completions[:1], 1.0) is None
    assert ln.logprobs(3, [g.prompt_ids], g.completions[:1], 1.0) is not None
    ln.skip_to_version(9)  # a restart after versions were published: nothing newer survives
    assert ln.scorer.kept() == [9]


def test_a_version_is_written_while_the_next_step_runs_and_holds_exactly_the_named_weights(tmp_path, tiny_model_dir):
    import threading
    import time

    from trainer.model import load_weights_into

    ln = learner(tmp_path, tiny_model_dir, lr=1e-2)
    ln.step(groups(2))
    version = ln.name_version()
    named = {k: v.clone() for k, v in ln.model.state_dict().items()}
    result: dict[str, object] = {}
    stepping = threading.Thread(target=lambda: result.update(ln.step(groups(2, seed=3))))
    stepping.start()  # forward and backward run now; the optimizer step must wait for the file
    time.sleep(0.5)  # the thing under test: the step is still waiting for the version's file after a while
    assert stepping.is_alive() and ln.steps == 1
    assert all(torch.equal(v, named[k]) for k, v in ln.model.state_dict().items())  # nothing moved yet
    ln.write_version(version)
    stepping.join(timeout=60)
    assert ln.steps == 2 and result["time_version_wait"] >= 0.3
    assert any(not torch.equal(v, named[k]) for k, v in ln.model.state_dict().items())  # the step went on
    written = learner(tmp_path / "check", tiny_model_dir).model
    load_weights_into(written, ln.scorer.path(version))
    assert all(torch.equal(v, named[k]) for k, v in written.state_dict().items())  # the bits named, exactly
    with pytest.raises(ValueError, match="not the one named last"):
        ln.name_version()
        ln.write_version(version)


ARENAS = """
import ctypes, ctypes.util, sys, tempfile, threading
from trainer.memory import limit_malloc_arenas
if sys.argv[1] == "limit":
    assert limit_malloc_arenas(2)
libc = ctypes.CDLL(ctypes.util.find_library("c"))
held, go = [], threading.Barrier(8)
def work():
    go.wait()
    held.extend(bytearray(50_000) for _ in range(200))
threads = [threading.Thread(target=work) for _ in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
path = tempfile.mkstemp()[1]
libc.fopen.restype = ctypes.c_void_p
f = ctypes.c_void_p(libc.fopen(path.encode(), b"w"))
libc.malloc_info(0, f)
libc.fclose(f)
print(open(path).read().count("<heap nr="))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc arenas")
def test_the_trainer_caps_malloc_arenas_so_threads_stop_keeping_their_own_freed_memory():
    """Eight threads allocating at once get arenas of their own by default; with the trainer's cap they share two
    (trainer/memory.py: each arena keeps its own high-water mark of freed tensor buffers)."""

    def arenas(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", ARENAS, mode], capture_output=True, text=True, check=True)
        return int(out.stdout.strip())

    assert arenas("default") > 2
    assert arenas("limit") <= 2


FRAGMENTS = """
import sys
from trainer.memory import map_large_blocks
if sys.argv[1] == "policy":
    assert map_large_blocks()
def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20
base = rss_mb()
big = bytearray(16 << 20)
del big  # a freed mapped block: glibc's default then raises its mmap threshold to 16 MiB
blocks, pins = [], []
for _ in range(200):  # tensor-sized buffers, each followed by a small long-lived object (a record, a hash)
    blocks.append(bytearray(1 << 20))
    pins.append(bytearray(1000))
del blocks
print(rss_mb() - base)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_the_trainer_gives_freed_tensor_sized_buffers_back():
    """200 MiB of 1 MiB buffers, freed while small objects allocated between them live on: by default glibc keeps
    them in the heap (its threshold rose after a large free); with the trainer's fixed mmap threshold each was
    mapped on its own and went back to the system when freed (trainer/memory.py)."""

    def kept_mb(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", FRAGMENTS, mode], capture_output=True, text=True, check=True)
        return int(out.stdout.strip())

    assert kept_mb("default") > 150
    assert kept_mb("policy") < 30


def test_the_activation_meter_counts_what_backward_keeps_not_the_weights():
    from trainer.activations import ActivationMeter

    lin = torch.nn.Linear(64, 32)
    x = torch.randn(10, 64)
    with ActivationMeter(list(lin.parameters())) as meter:
        y = lin(x).relu()  # addmm keeps x (and a view of the weight: not counted); relu keeps its output
    assert meter.bytes == x.nbytes + y.nbytes
    with meter:  # each use counts afresh
        pass
    assert meter.bytes == 0


def test_a_step_reports_its_largest_micro_batch_activations(tmp_path, tiny_model_dir):
    batch = groups(6)
    sizes = {}
    for name, kw in {
        "whole": {"micro_batch_tokens": 1 << 20},
        "small": {"micro_batch_tokens": 24},
        "recomputed": {"micro_batch_tokens": 1 << 20, "activation_checkpointing": True},
    }.items():
        ln = learner(tmp_path / name, tiny_model_dir, **kw)
        metrics = ln.step(batch)
        sizes[name] = ln.activation_bytes
        assert metrics["activation_mb"] == round(ln.activation_bytes / (1 << 20), 1)
        assert metrics["time_forward"] > 0 and metrics["time_backward"] > 0
        assert metrics["forward_tokens"] == sum(len(g.prompt_ids) + len(c) for g in batch for c in g.completions)
    assert 0 < sizes["small"] < sizes["whole"] / 2
    assert 0 < sizes["recomputed"] < sizes["whole"] / 2
