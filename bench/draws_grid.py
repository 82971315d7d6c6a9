"""bench/draws_grid: honest int8-grid (int4-grid) samplers against the trainer's verification limits (issue 27).

    .venv/bin/python bench/draws_grid.py [--lr 1e-5] [--versions 50] [--scale 1.0] [--bits 8|4]   # ~30-60 min here

The realistic trained fixture (trainer/realistic_model.py: peaked distributions, what the limits were calibrated
on) takes ``--versions`` real AdamW steps (fp32 master weights) at an RL learning rate on its own task; each
version is published as the learner publishes it (bf16) and encoded as the trainer encodes it (node/weights/grid.py,
``encode_grid_file`` on the previous version's grid file: every group's grid frozen since version 0, re-gridded by
the rule). At the last version an MLX int8 engine is built from the int8-grid model dir, as a sampler installs one
(its codes, scales and biases loaded as they are), and samples GRPO groups (G=8, 16 tokens) of the task at the
settings of bench/draws.py; the trainer replays every token in float64 from the bf16 version (what the learner
scores against: the master as published, not the grid), and every group is checked against the limits of
node/intake/noise.py for its declared mode (mlx/<compute>/q8), one peer's history through the sequential test.

Baseline, in the same run and on the same version: an MLX engine that quantizes the bf16 version itself (a fresh
grid: what an MLX int8 sampler of a bf16 chain runs). Target: 0 int8-grid groups refused, 0 sequential strikes.
The result goes into bench/results/draws.txt (its int8-grid section, replaced on each run) and draws_grid.png.
``--bits 4``: the same for int4-grid versions and MLX int4 engines, which declare q4 and face q4's limits (its own
section, draws_grid_int4.png).
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.draws import CHUNK, MAX_TOKENS, SETTINGS, G, Record  # noqa: E402

OUT = ROOT / "runs" / "draws_grid"
RESULTS = ROOT / "bench" / "results" / "draws.txt"
PLOT = ROOT / "bench" / "results" / "draws_grid.png"
SECTION = "int{bits}-grid samplers (bench/draws_grid.py"
# mode -> (compute, grid?): the grid engine, and the fresh-quantizing baseline beside it ({q}: q8, or q4 at --bits 4)
MODES = {"grid-{q}-bf16": ("bf16", True), "fresh-{q}-bf16": ("bf16", False), "grid-{q}-fp32": ("fp32", True),
         "fresh-{q}-fp32": ("fp32", False)}  # fmt: skip


def modes_of(bits: int) -> dict[str, tuple[str, bool]]:
    return {name.format(q=f"q{bits}"): how for name, how in MODES.items()}


def groups_for(mode: str, setting: tuple[float, float], scale: float) -> int:
    n = (800 if setting == (1.0, 1.0) else 200) * (2 if mode.endswith("fp32") else 1)
    return max(8, int(n * scale))


def train_versions(
    model_dir: Path, lr: float, versions: int, batch: int = 32, seed: int = 0, bits: int = 8
) -> tuple[Path, Path]:
    """(the bf16 model dir, the grid model dir at ``bits``) of the last version, after ``versions`` AdamW steps."""
    import torch

    from node.weights.grid import GridStats, encode_grid_file
    from trainer.base_model import padded_batch
    from trainer.model import load_model, load_tokenizer, save_model_dir
    from trainer.realistic_model import RealisticConfig, _example

    torch.manual_seed(seed)
    model = load_model(model_dir).train()
    tok, cfg, rng = load_tokenizer(model_dir), RealisticConfig(), random.Random(seed + 7)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
    shutil.rmtree(OUT / "versions", ignore_errors=True)
    parent: Path | None = None
    regridded = 0
    stats = GridStats()
    for v in range(versions + 1):
        if v:
            ids, attn, labels = padded_batch([_example(rng, tok, cfg) for _ in range(batch)], tok.pad_token_id)
            loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        bf16 = save_model_dir(model, OUT / "versions" / f"bf16-v{v}", model_dir, torch.bfloat16)
        grid = OUT / "versions" / f"grid-v{v}"
        shutil.copytree(bf16, grid)
        stats = encode_grid_file(bf16 / "model.safetensors", grid / "model.safetensors", parent, bits=bits)
        regridded += stats.regridded if v else 0
        if parent is not None:
            shutil.rmtree(parent.parent, ignore_errors=True)
            shutil.rmtree(OUT / "versions" / f"bf16-v{v - 1}", ignore_errors=True)
        parent = grid / "model.safetensors"
    trained = (
        f"{versions} versions at lr {lr:g}, int{bits}-grid: {regridded} of {stats.groups} groups re-gridded after the "
        "anchor"
    )
    (OUT / "versions" / "trained.txt").write_text(trained + "\n")
    print(trained)
    return OUT / "versions" / f"bf16-v{versions}", OUT / "versions" / f"grid-v{versions}"


def measure(
    bf16: Path, grid: Path, modes: list[str], scale: float, threads: int, bits: int = 8
) -> dict[str, list[Record]]:
    import torch

    from node.engines.mlx_engine import MlxEngine
    from trainer.draws import completion_draws
    from trainer.model import load_model, load_tokenizer
    from trainer.realistic_model import DATASET, cached_realistic_model
    from trainer.tasks.dataset import JsonlTask
    from trainer.text import TextCodec

    torch.set_num_threads(threads)
    tok = load_tokenizer(bf16)
    codec = TextCodec(tok, (tok.eos_token_id,), chat_template=True)
    task = JsonlTask(cached_realistic_model() / DATASET, "numeric")
    scorer = load_model(bf16).eval()  # the bf16 version widened to fp32: the trainer's replay of what it published
    out: dict[str, list[Record]] = {}
    for mode in modes:
        compute, on_grid = modes_of(bits)[mode]
        engine = MlxEngine(grid if on_grid else bf16, bits=bits, batch_size=CHUNK * G, compute=compute)
        records: list[Record] = []
        t0 = time.perf_counter()
        for si, (temp, top_p) in enumerate(SETTINGS):
            first, n = 1_000_000 * (si + 1), groups_for(mode, (temp, top_p), scale)
            for start in range(first, first + n, CHUNK):
                seeds = list(range(start, min(start + CHUNK, first + n)))
                prompts = [codec.encode_prompt(task.prompt(s)) for s in seeds for _ in range(G)]
                rows = [(s, k) for s in seeds for k in range(G)]
                gens = engine.generate_rows(prompts, rows, temperature=temp, top_p=top_p, max_tokens=MAX_TOKENS)
                comps = [g.completion_ids for g in gens]
                with torch.no_grad():
                    flat = completion_draws(scorer, prompts, comps, temp, top_p)
                for i, s in enumerate(seeds):
                    part = slice(i * G, (i + 1) * G)
                    records.append(Record(s, temp, top_p, flat[part], [g.logprobs for g in gens[part]]))
                print(f"\r{mode}: T={temp} top_p={top_p} {len(records)} groups [{time.perf_counter() - t0:.0f} s]",
                      end="", flush=True)  # fmt: skip
        print(flush=True)
        out[mode] = records
    return out


def summary(records: list[Record]) -> tuple[int, int, float, float]:
    """(tokens, flips outside the replayed interval, mean |dlogprob|, max |dlogprob|) of one mode's groups."""
    import numpy as np

    from node.intake.draws import Tolerance, check_draws

    tokens = flips = 0
    errs: list[float] = []
    for r in records:
        for draws, claimed in zip(r.draws, r.claimed, strict=True):
            tokens += len(draws)
            errs += [abs(d.logprob - c) for d, c in zip(draws, claimed, strict=True)]
        c = check_draws(r.draws, r.seed, Tolerance(1e9, 0.0), 1 << 30)  # every token outside its interval
        flips += len(c.flips) + len(c.forged)
    return tokens, flips, float(np.mean(errs)), float(np.max(errs))


def plot(rows: dict[str, tuple], path: Path, bits: int = 8) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    names = list(rows)
    axes[0].bar(names, [rows[n][1] / max(1, rows[n][0]) * 1e3 for n in names], color=["C0", "C1", "C0", "C1"])
    axes[0].set_ylabel("tokens outside their replayed interval / 1000")
    axes[1].bar(names, [rows[n][2] for n in names], color=["C0", "C1", "C0", "C1"])
    axes[1].set_ylabel("mean |claimed - replayed logprob| (nats)")
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(f"int{bits}-grid (frozen grids) vs a fresh MLX int{bits} grid, same version")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def replace_section(text: str, section: str, lines: list[str]) -> str:
    """``text`` with the block of lines headed ``section`` (up to the next grid section's header, or the end)
    replaced by ``lines``, or ``lines`` appended: each width's section is kept apart, in place."""
    old = text.rstrip("\n").split("\n") if text else []
    starts = [i for i, line in enumerate(old) if "-grid samplers (bench/draws_grid.py" in line]
    mine = next((i for i in starts if old[i].startswith(section)), None)
    if mine is None:
        return "\n".join(old + lines) + "\n"
    end = next((i for i in starts if i > mine), len(old))
    return "\n".join(old[:mine] + lines + old[end:]) + "\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--versions", type=int, default=50)
    p.add_argument("--scale", type=float, default=1.0, help="multiply every group count")
    p.add_argument("--bits", type=int, choices=(8, 4), default=8, help="int8-grid or int4-grid samplers")
    p.add_argument("--modes", default="", help="comma-separated (default: all four of --bits)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reuse", action="store_true", help="sample the versions trained by the last run again")
    args = p.parse_args()
    from trainer.realistic_model import cached_realistic_model

    t0 = time.perf_counter()
    last = OUT / "versions" / f"grid-v{args.versions}"
    trained = OUT / "versions" / "trained.txt"
    reusable = trained.exists() and f"int{args.bits}-grid" in trained.read_text()
    if args.reuse and (last / "model.safetensors").exists() and reusable:
        bf16, grid = OUT / "versions" / f"bf16-v{args.versions}", last
        print(f"reusing {bf16} and {grid} ({(OUT / 'versions' / 'trained.txt').read_text().strip()})")
    else:
        bf16, grid = train_versions(cached_realistic_model(), args.lr, args.versions, bits=args.bits)
    by_mode: dict[str, list[Record]] = {}
    for mode in args.modes.split(",") if args.modes else modes_of(args.bits):  # results written after each mode
        by_mode.update(measure(bf16, grid, [mode], args.scale, args.threads, args.bits))
        write(by_mode, args, time.perf_counter() - t0)


def write(by_mode: dict[str, list[Record]], args: argparse.Namespace, seconds: float) -> None:
    from bench.draws_report import check_all

    rows = {m: summary(r) for m, r in by_mode.items()}
    b, q = args.bits, f"q{args.bits}"
    section = SECTION.format(bits=b)
    lines = [
        f"{section}, {time.strftime('%Y-%m-%d')}): the realistic fixture after {args.versions} AdamW versions at lr "
        f"{args.lr:g}, each encoded on its parent's grid file (grids frozen since version 0, re-gridded by the rule); "
        f"an MLX int{b} engine built from the int{b}-grid model dir as a sampler installs it, against one that "
        "quantizes the bf16 version itself (fresh grid), same version, same seeds; the trainer replays from the bf16 "
        f"version (float64); each declares {q} and faces {q}'s limits. {seconds:.0f} s. "
        f"{(OUT / 'versions' / 'trained.txt').read_text().strip()}.",
        *check_all(by_mode),
    ]
    for mode, (tokens, flips, mean_err, max_err) in rows.items():
        rate = 1e3 * flips / max(1, tokens)
        lines.append(f"{mode:<14} tokens {tokens:>7}: outside the replayed interval {flips} ({rate:.2f} per 1000), "
                     f"|dlogprob| mean {mean_err:.2e} max {max_err:.2e}")  # fmt: skip
    for c in ("bf16", "fp32"):
        g, f = rows.get(f"grid-{q}-{c}"), rows.get(f"fresh-{q}-{c}")
        if g and f:
            ratio = (g[1] / max(1, g[0])) / max(1e-12, f[1] / max(1, f[0]))
            lines.append(f"ratio grid / fresh ({c} compute): flips per token {ratio:.2f}x, mean |dlogprob| "
                         f"{g[2] / f[2]:.2f}x")  # fmt: skip
    print("\n".join(lines))
    RESULTS.write_text(replace_section(RESULTS.read_text() if RESULTS.exists() else "", section, lines))
    png = PLOT if b == 8 else PLOT.with_name(f"draws_grid_int{b}.png")
    plot(rows, png, b)
    print(f"wrote {RESULTS} and {png}")


if __name__ == "__main__":
    main()
