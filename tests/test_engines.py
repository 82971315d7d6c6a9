"""Sampler engines: logprobs agree with the trainer's torch recomputation (fp32 tightly, int8 within a stated
tolerance), the stop token keeps its logprob, hot swap really changes the weights, bad model dirs fail clearly."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from node.engines import make_engine
from node.errors import UserError
from trainer.model import load_model, token_logprobs
from trainer.tiny_qwen2 import EOS_ID, build_random_model

PROMPT = [1, 4, 5, 6, 7, 8, 23]  # <bos>12345>
FP32_TOL = 1e-4  # measured ~5e-7
INT8_TOL = 5e-2  # measured ~5e-3 per token on the tiny model
INT4_TOL = 0.5


def reference(model_dir, completions, temperature=1.0):
    model = load_model(model_dir).eval()
    with torch.no_grad():
        lp, _ = token_logprobs(model, [PROMPT] * len(completions), completions, temperature)
    return [lp[i, : len(c)].numpy() for i, c in enumerate(completions)]


def max_diff(gens, ref):
    return max(float(np.abs(np.array(g.logprobs) - r).max()) for g, r in zip(gens, ref, strict=True))


@pytest.mark.parametrize(
    ("engine", "bits", "tol"),
    [("mlx", None, FP32_TOL), ("mlx", 8, INT8_TOL), ("mlx", 4, INT4_TOL), ("torch", None, FP32_TOL)],
)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_the_trainer(tiny_model_dir, engine, bits, tol, temperature):
    e = make_engine(engine, tiny_model_dir, bits=bits)
    gens = e.generate([PROMPT] * 8, temperature=temperature, top_p=1.0, max_tokens=10, seed=3)
    assert all(len(g.completion_ids) == len(g.logprobs) > 0 for g in gens)
    assert max_diff(gens, reference(tiny_model_dir, [g.completion_ids for g in gens], temperature)) < tol


def test_stop_token_is_kept_with_its_logprob(tiny_model_dir):
    e = make_engine("mlx", tiny_model_dir, bits=None)
    gens = e.generate([PROMPT] * 64, temperature=1.0, top_p=1.0, max_tokens=24, seed=0)
    stopped = [g for g in gens if g.finish_reason == "stop"]
    assert stopped, "no completion hit <eos>: the test needs one"
    for g in stopped:
        assert g.completion_ids[-1] == EOS_ID and EOS_ID not in g.completion_ids[:-1]
    assert all(len(g.completion_ids) == 24 for g in gens if g.finish_reason == "length")
    ref = reference(tiny_model_dir, [g.completion_ids for g in stopped])
    assert max_diff(stopped, ref) < FP32_TOL


@pytest.mark.parametrize(("engine", "bits", "tol"), [("mlx", 8, INT8_TOL), ("torch", None, FP32_TOL)])
def test_hot_swap_serves_the_new_version(tmp_path, tiny_model_dir, engine, bits, tol):
    other = build_random_model(tmp_path / "v1", seed=1)
    e = make_engine(engine, tiny_model_dir, bits=bits)
    before = e.generate([PROMPT] * 8, temperature=1.0, top_p=1.0, max_tokens=8, seed=5)
    e.swap(other, version=1)
    assert e.version == 1
    after = e.generate([PROMPT] * 8, temperature=1.0, top_p=1.0, max_tokens=8, seed=5)
    assert max_diff(after, reference(other, [g.completion_ids for g in after])) < tol
    assert max_diff(before, reference(other, [g.completion_ids for g in before])) > 10 * tol


def test_bad_model_dirs_fail_clearly(tmp_path, tiny_model_dir):
    with pytest.raises(UserError, match="not a directory"):
        make_engine("mlx", tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match=r"no config\.json"):
        make_engine("torch", empty)
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        make_engine("mlx", broken)
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt9"}))
    with pytest.raises(UserError, match="model_type"):
        make_engine("mlx", broken)
    (broken / "config.json").write_text(json.dumps(cfg))
    (broken / "model.safetensors").unlink()
    with pytest.raises(UserError, match="safetensors"):
        make_engine("torch", broken)
    bigger = build_random_model(tmp_path / "bigger", hidden=64)
    e = make_engine("mlx", tiny_model_dir, bits=8)
    with pytest.raises(UserError, match="do not fit"):
        e.swap(bigger, version=1)


# A worker thread builds the engine (the sampler does it in trio's thread cache), and that thread exits while the
# interpreter shuts down: the finalizer below keeps shutdown busy for a second, so the worker's idle wake-up lands
# inside it. Importing mlx-lm on such a thread left MLX thread-local state whose destructor took the GIL, and the
# process aborted (exit 134) after every test had passed.
_EXIT_SCRIPT = """
import sys, threading, time
from pathlib import Path
from node.engines import engine_factory
make = engine_factory(sys.argv[2], "8")
built = threading.Event()
def build():
    make(Path(sys.argv[1]), 0)
    built.set()
    time.sleep(1.0)
threading.Thread(target=build, daemon=True).start()
built.wait()
time.sleep(0.3)
class SlowShutdown:
    def __del__(self):
        time.sleep(1.5)
KEEP = SlowShutdown()
"""


@pytest.mark.parametrize("engine", ["mlx", "torch"])
def test_a_process_that_built_an_engine_in_a_worker_thread_exits_cleanly(tiny_model_dir, engine):
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_SCRIPT, str(tiny_model_dir), engine],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-500:]}"


def test_loads_in_several_threads_at_once_all_get_real_weights(tiny_model_dir):
    """A demo or test swarm builds the trainer's model and samplers' engines in threads of one process; transformers'
    from_pretrained patches process-wide state per call, and without the load lock 4 threads x 12 loads here left
    every thread a model on the meta device ("Cannot copy out of meta tensor")."""
    import threading

    errors: list[str] = []

    def load(i: int) -> None:
        try:
            for _ in range(12):
                if i % 2:
                    model = make_engine("torch", tiny_model_dir, compute="bf16").model
                else:
                    model = load_model(tiny_model_dir)
                if any(p.is_meta for p in model.parameters()):
                    raise AssertionError("a parameter was left on the meta device")
        except Exception as exc:
            errors.append(f"thread {i}: {exc!r}"[:300])

    threads = [threading.Thread(target=load, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert torch.get_default_dtype() == torch.float32  # no thread's bf16 load left its default behind


def test_an_error_is_described_with_every_exception_it_was_raised_from():
    from node.errors import describe

    def failing() -> None:
        try:
            try:
                raise TimeoutError("response timed out after 10s")
            except TimeoutError as inner:
                raise ConnectionError("stream negotiation failed") from inner
        except ConnectionError:
            raise RuntimeError("failed to open a stream to peer P")  # noqa: B904 (implicit context, as py-libp2p)

    try:
        failing()
    except RuntimeError as exc:
        assert describe(exc) == (
            "RuntimeError: failed to open a stream to peer P <- ConnectionError: stream negotiation failed"
            " <- TimeoutError: response timed out after 10s"
        )
    assert describe(ValueError("plain")) == "ValueError: plain"
