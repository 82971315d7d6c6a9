"""bench/sampler: generation throughput of every sampler engine on this machine (torch, MLX fp32, MLX int8), the
MLX engine against plain mlx-lm batch_generate (same model and prompts, same run), and which engine
``--engine auto`` picks here, with its throughput relative to the fastest one measured.

    .venv/bin/python bench/sampler.py [--hidden 256] [--layers 4] [--groups 8] [--group-size 8]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from tempfile import TemporaryDirectory

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import batch_generate
from mlx_lm.utils import load_model
from rich.console import Console
from rich.table import Table

from node.engines import auto_engine, make_engine
from trainer.model import load_tokenizer
from trainer.tasks.reverse import ReverseDigitsTask
from trainer.tiny_qwen2 import ROPE_THETA, build_random_model

console = Console()


class _Tok:
    """The two tokenizer attributes batch_generate reads."""

    def __init__(self, eos: int, hf) -> None:
        self.eos_token_ids = [eos]
        self._hf = hf

    def decode(self, ids):
        return self._hf.decode(ids)


def prompts(n_groups: int, group: int, tok) -> list[list[int]]:
    task = ReverseDigitsTask()
    return [[tok.bos_token_id, *tok.encode(task.prompt(s))] for s in range(n_groups) for _ in range(group)]


def node_engine_tps(model_dir: Path, bits, ps, max_tokens: int, group: int, engine: str = "mlx") -> float:
    e = make_engine(engine, model_dir, bits=bits)
    e.generate(ps[:group], temperature=1.0, top_p=1.0, max_tokens=max_tokens, seed=0)  # warm up
    t = time.perf_counter()
    gens = e.generate(ps, temperature=1.0, top_p=1.0, max_tokens=max_tokens, seed=1)
    return sum(len(g.completion_ids) for g in gens) / (time.perf_counter() - t)


def plain_mlx_tps(model_dir: Path, bits, ps, max_tokens: int, tok) -> float:
    model, _ = load_model(model_dir, model_config={"rope_theta": ROPE_THETA})
    if bits:
        nn.quantize(model, group_size=64, bits=bits)
    from mlx_lm.sample_utils import make_sampler

    wrapped = _Tok(tok.eos_token_id, tok)
    batch_generate(model, wrapped, ps[:8], max_tokens=max_tokens, sampler=make_sampler(temp=1.0))
    mx.random.seed(1)
    t = time.perf_counter()
    res = batch_generate(
        model,
        wrapped,
        ps,
        max_tokens=max_tokens,
        return_token_ids=True,
        return_logprobs=True,
        sampler=make_sampler(temp=1.0),
    )
    # batch_generate drops the stop token; count it back so both sides count the same tokens
    n = sum(len(ids) + (len(ids) < max_tokens) for ids in res.token_ids)
    return n / (time.perf_counter() - t)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    args = p.parse_args()
    with TemporaryDirectory() as tmp:
        model_dir = build_random_model(Path(tmp) / "m", layers=args.layers, hidden=args.hidden)
        tok = load_tokenizer(model_dir)
        ps = prompts(args.groups, args.group_size, tok)
        table = Table(title=f"MLX ({mx.default_device()}) generation, {len(ps)} sequences x {args.max_tokens} tokens")
        for col in ("precision", "node engine tok/s", "plain batch_generate tok/s", "engine / plain"):
            table.add_column(col)
        results = {}
        for bits in (None, 8):
            with console.status(f"bits={bits}"):
                ours = node_engine_tps(model_dir, bits, ps, args.max_tokens, args.group_size)
                plain = plain_mlx_tps(model_dir, bits, ps, args.max_tokens, tok)
            results[bits] = ours
            table.add_row(
                "fp32" if bits is None else f"int{bits}", f"{ours:.0f}", f"{plain:.0f}", f"{ours / plain:.2f}"
            )
        with console.status("torch engine"):
            results["torch"] = node_engine_tps(model_dir, None, ps, args.max_tokens, args.group_size, "torch")
        table.add_row("torch engine (fp32)", f"{results['torch']:.0f}", "", "")
        console.print(table)
        console.print(
            f"int8 / fp32 (MLX engine): {results[8] / results[None]:.2f}  "
            "(int8 pays on Metal; on Linux CPU it is expected to be slower)"
        )
        named = {"torch": results["torch"], "mlx": results[8]}  # the node's MLX default is int8
        best = max(results.values())
        chosen = auto_engine()
        console.print(
            f"--engine auto picks {chosen!r} here: {named[chosen]:.0f} tok/s, "
            f"{named[chosen] / best:.2f}x the fastest engine measured ({best:.0f} tok/s)"
        )


if __name__ == "__main__":
    main()
