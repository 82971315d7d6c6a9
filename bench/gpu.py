"""bench/gpu: the trainer on a GPU, fed by CPU samplers (bench/gpu.sh runs the CUDA tests first, then this).

A real swarm on loopback (bootstrap, trainer, one torch sampler per CPU core left, separate processes, bench/scale's
``run_size``) with a random model of Qwen2.5-0.5B's shape (hidden 896, 24 layers, vocab 151936, 14 heads, 2 KV
heads) trained in bf16 on the GPU. It prints, and writes to bench/results/gpu.txt:

- step time and tokens/s trained; the trainer's busy fraction (learner time over wall time since rollouts came);
- verification cost per token scored (seconds) and over the forward's per token trained;
- version write + publish seconds (in the background) and bytes;
- peak GPU memory (``max_memory_allocated``) in bytes per parameter.

``--device cpu`` is a dry run of the same path with the tiny shape and two samplers, on any machine (it writes
bench/results/gpu_cpu_dryrun.txt, never gpu.txt).

    .venv/bin/python bench/gpu.py [--device cuda] [--steps 6] [--samplers N] [--nproc 1]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.scale import RESULTS, console, run_size

QWEN25_05B = {"layers": 24, "hidden": 896, "vocab_size": 151936, "heads": 14, "kv_heads": 2, "intermediate": 4864}
DRY_RUN = {"layers": 2, "hidden": 128}


def figures(r: dict, device: str) -> list[str]:
    tokens_s = r["tokens"] / max(r["learn_s"], 1e-9)
    per_token = r["verify_s"] / max(r["verify_tokens"], 1)
    lines = [
        f"params {r['params'] / 1e6:.1f}M, device {device}, nproc {r['nproc']}",
        f"step time {r['learn_s']:.2f} s (forward {r['forward_s']:.2f} s, backward {r['backward_s']:.2f} s)",
        f"tokens/s trained {tokens_s:.0f} ({r['tokens']:.0f} completion tokens per step)",
        f"trainer busy fraction {r['busy_fraction']:.2f}",
        f"verification {per_token * 1e3:.3f} ms per token scored; {r['verify_per_forward_token']:.2f}x the forward's"
        " per token trained",
        f"version write+publish {r['publish_bg_s']:.2f} s in the background ({r['publish_bytes'] / 1e6:.1f} MB);"
        f" the loop waited {r['publish_s']:.2f} s per step",
        f"peak trainer RSS {r['peak_rss_mb']:.0f} MB",
    ]
    if device == "cuda":
        lines.append(
            f"peak GPU memory {r['device_peak_mb']:.0f} MB = {r['device_peak_mb'] * (1 << 20) / r['params']:.1f}"
            " bytes per parameter (max_memory_allocated, rank 0)"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--samplers", type=int, default=None, help="default: one per CPU core left (2 on a dry run)")
    ap.add_argument("--nproc", type=int, default=1)
    args = ap.parse_args()
    cuda = args.device == "cuda"
    samplers = args.samplers or (max(1, (os.cpu_count() or 2) - 2) if cuda else 2)
    flags = ["--device", args.device, "--batch-groups", str(2 * samplers), "--max-tokens", "32" if cuda else "8"]
    flags += ["--micro-batch-tokens", "16384" if cuda else "4096", "--publish-dtype", "bf16"]
    t0 = time.time()
    with TemporaryDirectory() as tmp:
        r = run_size(
            Path(tmp),
            494 if cuda else 0,
            args.steps,
            "bf16" if cuda else "fp32",
            "bf16",
            args.nproc,
            shape=QWEN25_05B if cuda else DRY_RUN,
            samplers=samplers,
            trainer_flags=tuple(flags),
        )
    console.print(json.dumps({k: v for k, v in r.items() if k != "rss_trace"}))
    lines = [*figures(r, args.device), f"samplers {samplers}, {args.steps} steps, {time.time() - t0:.0f} s in all"]
    for line in lines:
        console.print(line)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / ("gpu.txt" if cuda else "gpu_cpu_dryrun.txt")
    shape = "Qwen2.5-0.5B-shaped random model, bf16" if cuda else "tiny model, fp32 (a CPU dry run of bench/gpu.sh)"
    out.write_text(f"bench/gpu ({time.strftime('%Y-%m-%d')}, {shape})\n" + "\n".join(lines) + "\n")
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
