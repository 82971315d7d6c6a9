"""`swarmrl demo`: a local swarm on loopback as separate processes (bootstrap + trainer + N samplers),
with progress bars; the trainer learns the built-in task and the reward visibly rises.
Writes <out>/trainer/metrics.jsonl and <out>/reward_curve.png."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from node.base_model import ensure_base_model
from node.config import write_config_file
from node.errors import require_torch
from node.identity import load_or_create_key, peer_id_of
from node.metrics import plot_curve, read_jsonl
from node.status import read_status

console = Console()


def add_demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--samplers", type=int, default=3)
    p.add_argument("--steps", type=int, default=40, help="GRPO steps to train")
    p.add_argument("--model", type=Path, help="a local model dir (default: the embedded base model, pretrained once)")
    p.add_argument("--out", type=Path, default=Path("runs/demo"))
    p.add_argument("--port", type=int, default=4101, help="bootstrap node's TCP port on 127.0.0.1")
    p.add_argument("--engine", default="auto", choices=["auto", "mlx", "torch"])
    p.add_argument("--bits", default="8", choices=["8", "4", "none"])
    p.add_argument("--task", default="reverse")
    p.add_argument("--timeout", type=float, default=1800.0, help="give up after this many seconds")


def read_status_quietly(data_dir: Path) -> dict:
    try:
        return read_status(data_dir)
    except (OSError, ValueError):
        return {}


def node_cmd(role: str, data_dir: Path, config: Path, *extra: str) -> list[str]:
    # -P: never import from the working directory, where a data dir named like a package (say "trainer/")
    # would shadow the installed one
    return [
        sys.executable,
        "-P",
        "-m",
        "node.cli",
        "node",
        "--role",
        role,
        "--config",
        str(config),
        "--data-dir",
        str(data_dir),
        "--provide-interval",
        "5",
        *extra,
    ]


def cmd_demo(args: argparse.Namespace) -> int:
    require_torch("swarmrl demo (it runs a trainer)")
    out: Path = args.out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    boot_id = peer_id_of(load_or_create_key(out / "bootstrap" / "identity.key"))
    trainer_id = peer_id_of(load_or_create_key(out / "trainer" / "identity.key"))
    config = out / "bootstrap.toml"
    write_config_file(config, "demo", [f"/ip4/127.0.0.1/tcp/{args.port}/p2p/{boot_id}"], str(trainer_id))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    loopback = "/ip4/127.0.0.1/tcp/0"
    building = lambda: console.status("pretraining the embedded base model (once; ~30-60 s)")  # noqa: E731
    model = args.model or ensure_base_model(out.parent / ".base-model", building)
    specs = [("bootstrap", "bootstrap", ["--listen", f"/ip4/127.0.0.1/tcp/{args.port}"])]
    trainer_args = ["--listen", loopback, "--task", args.task, "--max-steps", str(args.steps), "--model", str(model)]
    specs.append(("trainer", "trainer", trainer_args))
    bits = [] if args.engine == "torch" else ["--bits", args.bits]  # torch does not quantize: --bits is an error
    specs += [
        ("sampler", f"sampler{i}", ["--listen", loopback, "--engine", args.engine, *bits]) for i in range(args.samplers)
    ]
    console.print(
        f"[bold]swarmrl demo[/]: 1 trainer + {args.samplers} samplers on 127.0.0.1, task {args.task!r}, "
        f"{args.steps} GRPO steps; logs in {out}/"
    )
    procs: list[subprocess.Popen] = []
    metrics_path = out / "trainer" / "metrics.jsonl"
    try:
        for role, name, extra in specs:
            log = open(out / f"{name}.log", "w")
            procs.append(
                subprocess.Popen(
                    node_cmd(role, out / name, config, *extra), env=env, stdout=log, stderr=subprocess.STDOUT
                )
            )
            if role == "bootstrap":
                time.sleep(1.5)
        first_eval = last_eval = None
        dashboard_shown = False
        plain = not console.is_terminal  # logs, CI: one plain line every few steps instead of a live bar
        last_line = -1
        with Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            console=console,
        ) as progress:
            bar = progress.add_task("training", total=args.steps, info="waiting for the swarm...")
            deadline = time.time() + args.timeout
            while time.time() < deadline:
                time.sleep(1.0)
                records = read_jsonl(metrics_path)
                train = [r for r in records if "reward" in r]
                evals = [r for r in records if "eval_reward" in r]
                if evals:
                    first_eval = first_eval or evals[0]
                    last_eval = evals[-1]
                if train:
                    r = train[-1]
                    info = (
                        f"rollout reward {r['reward']:.2f}  eval reward "
                        f"{last_eval['eval_reward'] if last_eval else float('nan'):.2f}  "
                        f"accuracy {last_eval['eval_accuracy'] if last_eval else float('nan'):.2f}  "
                        f"v{r['version']}  busy {r['busy_fraction']:.0%}"
                    )
                    progress.update(bar, completed=r["step"], info=info)
                    if plain and r["step"] >= last_line + 5:
                        last_line = r["step"]
                        print(f"step {r['step']}/{args.steps}: {info}", flush=True)
                if not dashboard_shown:
                    url = read_status_quietly(out / "trainer").get("dashboard")
                    if url:
                        progress.console.print(f"dashboard: {url}")
                        dashboard_shown = True
                dead = [(p, s) for p, s in zip(procs, specs, strict=True) if p.poll() is not None]
                if dead:
                    p, (role, name, _) = dead[0]
                    if (role == "trainer" and p.returncode == 0) or (train and train[-1]["step"] >= args.steps):
                        break
                    console.print(f"[red]{name} exited with code {p.returncode}; see {out / (name + '.log')}")
                    return 1
                if train and train[-1]["step"] >= args.steps and last_eval and last_eval["step"] >= args.steps:
                    break
            else:
                console.print(f"[red]timed out after {args.timeout:.0f} s")
                return 1
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
    records = read_jsonl(metrics_path)
    plot_curve(records, out / "reward_curve.png", title=f"swarmrl demo: {args.samplers} samplers, task {args.task!r}")
    if first_eval and last_eval:
        console.print(
            f"eval reward {first_eval['eval_reward']:.3f} -> {last_eval['eval_reward']:.3f}, "
            f"exact accuracy {first_eval['eval_accuracy']:.3f} -> {last_eval['eval_accuracy']:.3f}"
        )
    console.print(f"metrics: {metrics_path}\nplot:    {out / 'reward_curve.png'}")
    return 0
