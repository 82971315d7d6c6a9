"""bench/scale: how the trainer's costs grow with model size. For models of about 3M, 30M and 300M parameters (one
family: the embedded Qwen2 shape, built deterministically), a real swarm on loopback (bootstrap, trainer, one torch
sampler, separate processes) takes a few GRPO steps, and this prints, per size:

- trainer peak RSS per parameter, and the marginal bytes per parameter between sizes (fixed overhead cancels),
  beside the activations autograd kept for the largest micro-batch (trainer/activations.py);
- per step: forward and backward seconds, verification seconds (logprob recomputation) and its cost per token
  scored over the forward's per token trained (one extra forward per rollout token is 1), and the seconds the training
  loop waited for publishing (it names a version and goes on; the next optimizer step waits for the weights file);
- per version: bytes, seconds to publish in the background (write, cut, hash, diff, sign), throughput;
- seconds from a version's announcement to the sampler running it (download + reassembly + hot swap).

A table (bench/results/scale.txt) and a figure (bench/results/scale.png). The batch is small (CPU), so a step here is
short: publishing grows with parameters, a step with parameters x tokens, so the fraction falls with batch size.

    .venv/bin/python bench/scale.py [--sizes 3 30 300] [--steps 3] [--dtype auto] [--nproc 1 2]

With ``--nproc 1 2`` each size also runs with the learner sharded over 2 ranks (FSDP2 on gloo, the trainer's
``--nproc``): a table of each rank's peak RSS (rank 0 is the node too; the others are its children, read from
/proc) and step time, and the marginal bytes per parameter per rank against the single rank's divided by N
(target: within 15%, activations aside). Results: bench/results/scale_nproc.txt.
"""

from __future__ import annotations

import argparse
import itertools
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory

from rich.console import Console
from rich.table import Table

from node.config import write_config_file
from node.identity import load_or_create_key, peer_id_of
from node.metrics import read_jsonl
from node.status import read_status
from trainer.tiny_qwen2 import build_random_model

console = Console()
RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {3: (4, 256), 30: (10, 512), 300: (24, 1024)}  # millions of parameters -> (layers, hidden)
CLI = [sys.executable, "-P", "-m", "node.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status(d: Path) -> dict:
    try:
        return read_status(d)
    except (OSError, ValueError):
        return {}


def params_of(model_dir: Path) -> int:
    from protocols.weights_file import read_layout

    return sum(t.numel for t in read_layout(model_dir / "model.safetensors").tensors)


def rank_pids(pid: int) -> list[int]:
    """The trainer's rank processes: its children (``--nproc``), read from /proc."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return sorted(out)


def peak_rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def run_size(
    root: Path,
    mparams: int,
    steps: int,
    dtype: str,
    publish_dtype: str = "auto",
    nproc: int = 1,
    shape: dict | None = None,
    samplers: int = 1,
    trainer_flags: tuple[str, ...] = (),
) -> dict:
    """One swarm run; ``shape`` (tiny_config's arguments) overrides the size's, ``trainer_flags`` are appended
    (bench/gpu.py: ``--device cuda``, a bigger batch)."""
    layers, hidden = SHAPES.get(mparams, (0, 0))
    with console.status(f"{mparams}M: building the model"):
        model = build_random_model(root / "model", **(shape or {"layers": layers, "hidden": hidden}))
    n_params = params_of(model)
    port = free_port()
    boot_id = peer_id_of(load_or_create_key(root / "boot" / "identity.key"))
    trainer_id = peer_id_of(load_or_create_key(root / "trainer" / "identity.key"))
    cfg = root / "bootstrap.toml"
    write_config_file(cfg, "scale", [f"/ip4/127.0.0.1/tcp/{port}/p2p/{boot_id}"], str(trainer_id))
    common = ["--config", str(cfg), "--provide-interval", "2", "--status-interval", "0.5"]

    def spawn(role: str, name: str, *extra: str) -> subprocess.Popen:
        mine = ["--model", str(model)] if role == "trainer" else []  # another role's flag is an error
        argv = [*CLI, "node", "--role", role, "--data-dir", str(root / name), *common, *mine, *extra]
        return subprocess.Popen(argv, cwd=root, stdout=open(root / f"{name}.log", "w"), stderr=subprocess.STDOUT)

    procs = [spawn("bootstrap", "boot", "--listen", f"/ip4/127.0.0.1/tcp/{port}")]
    try:
        time.sleep(2)
        for k in range(samplers):
            procs.append(spawn("sampler", f"s{k}", "--listen", "/ip4/127.0.0.1/tcp/0", "--engine", "torch"))
        trainer = spawn(
            "trainer",
            "trainer",
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--max-steps",
            str(steps),
            "--batch-groups",
            "2",
            "--group-size",
            "4",
            "--max-tokens",
            "8",
            "--eval-every",
            "1000",
            "--checkpoint-every",
            "1000",
            "--dashboard",
            "off",
            "--linger",
            "600",
            "--dtype",
            dtype,
            "--publish-dtype",
            publish_dtype,
            "--micro-batch-tokens",
            "4096",
            *(["--nproc", str(nproc)] if nproc > 1 else []),
            *trainer_flags,
        )
        procs.append(trainer)
        deadline = time.time() + 3600
        with console.status(f"{mparams}M ({n_params / 1e6:.1f}M params): {steps} steps") as shown:
            while time.time() < deadline:
                records = read_jsonl(root / "trainer" / "metrics.jsonl")
                done = [r for r in records if "time_learn" in r]
                shown.update(f"{mparams}M ({n_params / 1e6:.1f}M params): step {len(done)}/{steps}")
                end = next((r for r in records if r.get("finished")), None)  # its version is the final one
                if end is not None and status(root / "s0").get("version") == end["version"]:
                    break
                for p in procs:
                    if p.poll() is not None:
                        raise SystemExit(f"a node exited ({p.args[6]}); see {root}/*.log")
                time.sleep(1)
            else:
                raise SystemExit(f"{mparams}M did not finish within an hour")
        t_status, s_status = status(root / "trainer"), status(root / "s0")
        workers = [peak_rss_mb(pid) for pid in rank_pids(trainer.pid)]  # before they exit
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=60)
    steps_done = done[1:] or done  # the first step also pays one-off warm-up
    mean = lambda key: sum(r[key] for r in steps_done) / len(steps_done)  # noqa: E731
    sum_ = lambda key: max(1, sum(r[key] for r in steps_done))  # noqa: E731
    published = [r for r in records if "published" in r]
    return {
        "mparams": mparams,
        "nproc": nproc,
        "rank_peak_rss_mb": [t_status["peak_rss_mb"], *workers],
        "params": n_params,
        "peak_rss_mb": t_status["peak_rss_mb"],
        # the high-water mark before the first step (models loaded), after it (+ gradients, AdamW state, activations)
        "rss_loaded_mb": records[0].get("peak_rss_mb", float("nan")),
        "rss_first_step_mb": done[0].get("peak_rss_mb", float("nan")),
        "rss_per_param": t_status["peak_rss_mb"] * (1 << 20) / n_params,
        "activation_mb": max(r.get("activation_mb", 0.0) for r in done),  # the largest micro-batch's
        "device_peak_mb": max((r.get("device_peak_mb", float("nan")) for r in done), default=float("nan")),
        "busy_fraction": done[-1].get("busy_fraction", float("nan")),
        "verify_tokens": sum(r["verify_tokens"] for r in steps_done) / len(steps_done),
        "learn_s": mean("time_learn"),
        "forward_s": mean("time_forward"),
        "backward_s": mean("time_backward"),
        # verification's cost per token it scored over the forward's per token it trained on (target: <= 1)
        "verify_per_forward_token": (sum(r["time_verify"] for r in steps_done) / sum_("verify_tokens"))
        / (sum(r["time_forward"] for r in steps_done) / sum_("forward_tokens")),
        "verify_s": mean("time_verify"),
        "publish_s": mean("time_publish"),  # what the training loop waited
        "publish_bg_s": sum(r["publish_seconds"] for r in published) / max(1, len(published)),
        "versions": len(published),
        "publish_bytes": published[-1]["publish_bytes"] if published else steps_done[-1]["publish_bytes"],
        "tokens": mean("tokens"),
        "swap_s": s_status.get("last_swap_seconds", float("nan")),
        # the high-water mark as the run went: after which step or publish it rose (MB)
        "rss_trace": [
            (
                ("step" if "time_learn" in r else "publish" if "published" in r else "other"),
                r["version"],
                r["peak_rss_mb"],
            )
            for r in records
            if "peak_rss_mb" in r
        ]
        + [("end", t_status.get("version"), t_status["peak_rss_mb"])],
    }


def plot(rows: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = [r["params"] / 1e6 for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    axes[0].plot(p, [r["rss_per_param"] for r in rows], "o-", label="trainer peak RSS / parameters")
    pairs = list(itertools.pairwise(rows))
    if pairs:
        marginal = [(b["peak_rss_mb"] - a["peak_rss_mb"]) * (1 << 20) / (b["params"] - a["params"]) for a, b in pairs]
        act = [(b["activation_mb"] - a["activation_mb"]) * (1 << 20) / (b["params"] - a["params"]) for a, b in pairs]
        at = [b["params"] / 1e6 for _, b in pairs]
        axes[0].plot(at, marginal, "s-", label="marginal from the size before (fixed overhead cancels)")
        axes[0].plot(at, [m - x for m, x in zip(marginal, act, strict=True)], "^--", label="marginal less activations")
    axes[0].axhline(20, color="grey", ls="--", label="target 20 B/param")
    axes[0].set(
        xscale="log", yscale="log", xlabel="parameters (M)", ylabel="bytes per parameter", title="trainer memory"
    )
    for key, label in (
        ("forward_s", "forward"),
        ("backward_s", "backward"),
        ("verify_s", "verification"),
        ("publish_s", "publishing: the loop waits"),
        ("publish_bg_s", "publishing: in the background"),
    ):
        axes[1].plot(p, [r[key] for r in rows], "o-", label=label)
    axes[1].plot(p, [r["swap_s"] for r in rows], "s--", label="announce -> swapped (sampler)")
    axes[1].set(xscale="log", yscale="log", xlabel="parameters (M)", ylabel="seconds per step", title="time per step")
    axes[2].plot(p, [r["publish_s"] / r["learn_s"] for r in rows], "o-", label="publish wait / forward+backward")
    axes[2].plot(p, [r["verify_per_forward_token"] for r in rows], "o-", label="verify / forward, per token")
    axes[2].axhline(1.0, color="grey", ls=":", label="verify target 1 (one forward per token)")
    axes[2].axhline(0.1, color="grey", ls="--", label="publish target 0.1")
    axes[2].set(xscale="log", xlabel="parameters (M)", ylabel="ratio", title="overheads")
    for ax in axes:
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle("bench/scale: trainer costs by model size (2-core CPU, batch 2 groups x 4 x <=8 tokens)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[3, 30, 300], choices=sorted(SHAPES))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"])
    ap.add_argument("--publish-dtype", default="auto", choices=["auto", "bf16", "fp32"])
    ap.add_argument("--nproc", type=int, nargs="+", default=[1], help="learner ranks to compare (e.g. 1 2)")
    args = ap.parse_args()
    if args.nproc != [1]:
        return main_nproc(args)
    rows = []
    for m in args.sizes:
        with TemporaryDirectory() as tmp:
            rows.append(run_size(Path(tmp), m, args.steps, args.dtype, args.publish_dtype))
        console.print(json.dumps(rows[-1]))
    table = Table(title="bench/scale: trainer costs by model size")
    cols = (
        "params",
        "peak RSS",
        "B/param",
        "activations MB",
        "fwd s",
        "bwd s",
        "verify s",
        "verify/fwd per token",
        "publish wait s",
        "publish bg s",
        "publish MB",
        "publish MB/s",
        "wait/step",
        "announce->swapped s",
    )
    for c in cols:
        table.add_column(c)
    lines = []
    for r in rows:
        cells = (
            f"{r['params'] / 1e6:.1f}M",
            f"{r['peak_rss_mb']:.0f} MB",
            f"{r['rss_per_param']:.1f}",
            f"{r['activation_mb']:.0f}",
            f"{r['forward_s']:.2f}",
            f"{r['backward_s']:.2f}",
            f"{r['verify_s']:.2f}",
            f"{r['verify_per_forward_token']:.2f}",
            f"{r['publish_s']:.2f}",
            f"{r['publish_bg_s']:.2f}",
            f"{r['publish_bytes'] / 1e6:.1f}",
            f"{r['publish_bytes'] / 1e6 / max(r['publish_bg_s'], 1e-9):.0f}",
            f"{r['publish_s'] / r['learn_s']:.2f}",
            f"{r['swap_s']:.2f}",
        )
        table.add_row(*cells)
        lines.append("  ".join(f"{c}={v}" for c, v in zip(cols, cells, strict=True)))
    for a, b in itertools.pairwise(rows):
        marginal = (b["peak_rss_mb"] - a["peak_rss_mb"]) * (1 << 20) / (b["params"] - a["params"])
        lines.append(f"marginal trainer RSS {a['mparams']}M -> {b['mparams']}M: {marginal:.1f} bytes per parameter")
        for key, what in (("rss_loaded_mb", "models loaded"), ("rss_first_step_mb", "after the first step")):
            m = (b[key] - a[key]) * (1 << 20) / (b["params"] - a["params"])
            lines.append(f"  of which, peak until {what}: {m:.1f} bytes per parameter")
        act = (b["activation_mb"] - a["activation_mb"]) * (1 << 20) / (b["params"] - a["params"])
        lines.append(f"  activations (largest micro-batch, in every peak above): {act:.2f} bytes per parameter")
        lines.append(f"  peak over the run less activations: {marginal - act:.1f} bytes per parameter")
    console.print(table)
    for line in lines[len(rows) :]:
        console.print(line)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "scale.txt").write_text(
        f"bench/scale ({time.strftime('%Y-%m-%d')}, this 2-core CPU box, dtype {args.dtype}, "
        f"publish dtype {args.publish_dtype})\n" + "\n".join(lines) + "\n"
    )
    plot(rows, RESULTS / "scale.png")
    console.print(f"wrote {RESULTS / 'scale.txt'} and {RESULTS / 'scale.png'}")


def nproc_lines(rows: list[dict]) -> list[str]:
    """Per size and rank count: each rank's peak RSS and the step's times; then, between sizes, each rank's marginal
    bytes per parameter against the single rank's / N (fixed overheads cancel; activations are not sharded)."""
    lines = []
    for r in rows:
        ranks = "  ".join(f"rank{i}={mb:.0f} MB" for i, mb in enumerate(r["rank_peak_rss_mb"]))
        lines.append(
            f"{r['params'] / 1e6:.1f}M nproc={r['nproc']}: {ranks}  step s={r['learn_s']:.2f} (fwd {r['forward_s']:.2f}"
            f" bwd {r['backward_s']:.2f})  verify s={r['verify_s']:.2f}  publish bg s={r['publish_bg_s']:.2f}"
        )
    by = {(r["mparams"], r["nproc"]): r for r in rows}
    sizes = sorted({r["mparams"] for r in rows})
    for a, b in itertools.pairwise(sizes):
        one_a, one_b = by.get((a, 1)), by.get((b, 1))
        if one_a is None or one_b is None:
            continue
        dp = one_b["params"] - one_a["params"]
        single = (one_b["rank_peak_rss_mb"][0] - one_a["rank_peak_rss_mb"][0]) * (1 << 20) / dp
        act = (one_b["activation_mb"] - one_a["activation_mb"]) * (1 << 20) / dp
        lines.append(f"marginal {a}M -> {b}M, 1 rank: {single:.1f} bytes per parameter (activations {act:.2f})")
        for n in sorted({r["nproc"] for r in rows} - {1}):
            ra, rb = by.get((a, n)), by.get((b, n))
            if ra is None or rb is None:
                continue
            target = (single - act) / n + act
            for i, (ma, mb) in enumerate(zip(ra["rank_peak_rss_mb"], rb["rank_peak_rss_mb"], strict=False)):
                m = (mb - ma) * (1 << 20) / dp
                lines.append(
                    f"  nproc={n} rank{i}: {m:.1f} bytes per parameter; target {target:.1f} (1 rank's / {n} plus"
                    f" activations): {m / target:.2f}x"
                )
            lines.append(
                f"  nproc={n} step time {rb['learn_s']:.2f} s vs 1 rank {one_b['learn_s']:.2f} s at {b}M:"
                f" {one_b['learn_s'] / rb['learn_s']:.2f}x"
            )
    return lines


def main_nproc(args: argparse.Namespace) -> None:
    """Runs accumulate in bench/results/scale_nproc.json by (size, ranks): a run of 300M alone is reported beside
    the 3M and 30M runs measured before (the marginal bytes per parameter need two sizes)."""
    kept = RESULTS / "scale_nproc.json"
    rows = json.loads(kept.read_text()) if kept.exists() else []
    for m in args.sizes:
        for n in args.nproc:
            with TemporaryDirectory() as tmp:
                row = run_size(Path(tmp), m, args.steps, args.dtype, args.publish_dtype, n)
            row = {k: v for k, v in row.items() if k != "rss_trace"}
            console.print(json.dumps(row))
            rows = [r for r in rows if (r["mparams"], r["nproc"]) != (m, n)] + [row]
            RESULTS.mkdir(exist_ok=True)
            kept.write_text(json.dumps(rows, indent=1))
    rows.sort(key=lambda r: (r["mparams"], r["nproc"]))
    lines = nproc_lines(rows)
    for line in lines:
        console.print(line)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "scale_nproc.txt").write_text(
        f"bench/scale --nproc {' '.join(map(str, args.nproc))} ({time.strftime('%Y-%m-%d')}, this 2-core CPU box,"
        f" gloo, dtype {args.dtype}, publish dtype {args.publish_dtype}; peak RSS per rank, rank 0 is the node)\n"
        + "\n".join(lines)
        + "\n"
    )
    plot_nproc(rows, RESULTS / "scale_nproc.png")
    console.print(f"wrote {RESULTS / 'scale_nproc.txt'} and {RESULTS / 'scale_nproc.png'}")


def plot_nproc(rows: list[dict], png: Path) -> None:
    """Peak RSS per rank and step time, by size, one bar per rank and rank count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["mparams"] for r in rows})
    bars = sorted({(r["nproc"], i) for r in rows for i in range(len(r["rank_peak_rss_mb"]))})
    by = {(r["mparams"], r["nproc"]): r for r in rows}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / max(len(bars), 1)
    for k, (n, i) in enumerate(bars):
        xs = [j + k * width for j, m in enumerate(sizes) if (m, n) in by]
        ys = [by[(m, n)]["rank_peak_rss_mb"][i] for m in sizes if (m, n) in by]
        axes[0].bar(xs, ys, width, label=f"nproc {n}, rank {i}")
    axes[0].set(
        xticks=[j + 0.4 - width / 2 for j in range(len(sizes))], ylabel="peak RSS (MB)", title="memory per rank"
    )
    axes[0].set_xticklabels([f"{by[(m, 1)]['params'] / 1e6:.0f}M" if (m, 1) in by else f"{m}M" for m in sizes])
    for n in sorted({r["nproc"] for r in rows}):
        pts = [(by[(m, n)]["params"] / 1e6, by[(m, n)]["learn_s"]) for m in sizes if (m, n) in by]
        axes[1].plot(*zip(*pts, strict=True), "o-", label=f"nproc {n}")
    axes[1].set(xscale="log", xlabel="parameters (M)", ylabel="seconds per step", title="step time")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("bench/scale --nproc: the learner sharded over ranks (FSDP2, gloo, 2-core CPU box)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
