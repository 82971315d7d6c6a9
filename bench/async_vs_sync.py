"""bench/async: the async swarm (trainer + N sampler nodes on loopback, one process) vs a synchronous
sample-then-train loop, with the same budget: the same number of GRPO steps on the same number of
groups per step. Prints wall time ratio and final eval reward/accuracy of both.

    .venv/bin/python bench/async_vs_sync.py [--steps 20] [--samplers 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory

import trio
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from node.engines import make_engine
from tests.swarm_helpers import start_bootstrap, start_sampler, start_trainer, wait_until
from trainer.metrics import read_jsonl
from trainer.settings import TrainerSettings
from trainer.sync_loop import run_sync
from trainer.tiny_model import build_tiny_model

console = Console()


async def run_swarm(root: Path, model_dir: Path, steps: int, samplers: int, batch: int) -> dict:
    async with trio.open_nursery() as nursery:
        boot = await start_bootstrap(nursery, root)
        t0 = time.monotonic()
        trainer = await start_trainer(
            nursery,
            root,
            boot,
            model_dir,
            max_tokens=6,
            batch_groups=batch,
            max_steps=steps,
            eval_every=steps,
            linger_after_finish=0.0,
        )
        for i in range(samplers):
            await start_sampler(nursery, root, f"s{i}", boot)
        await wait_until(lambda: trainer.role.finished.is_set(), timeout=3600, interval=0.5)
        elapsed = time.monotonic() - t0
        rollouts = trainer.role.buffer.accepted
        busy = trainer.role.last_metrics.get("busy_fraction", 0.0)
        nursery.cancel_scope.cancel()
    last = [r for r in read_jsonl(root / "trainer" / "metrics.jsonl") if "eval_reward" in r][-1]
    return {"seconds": elapsed, "rollouts": rollouts, "busy": busy, **last}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--samplers", type=int, default=2)
    p.add_argument("--batch-groups", type=int, default=8)
    args = p.parse_args()
    with TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = build_tiny_model(root / "model")
        with console.status("async swarm"):
            swarm = trio.run(run_swarm, root / "swarm", model_dir, args.steps, args.samplers, args.batch_groups)
        settings = TrainerSettings(max_tokens=6, batch_groups=args.batch_groups, eval_every=args.steps)
        with console.status("synchronous loop"):
            t0 = time.monotonic()
            records = run_sync(
                model_dir,
                settings,
                args.steps,
                lambda path, v: make_engine("mlx", path, bits=8, version=v),
                root / "sync",
            )
            sync = {
                "seconds": time.monotonic() - t0,
                "rollouts": records[-1]["rollouts"],
                "busy": float("nan"),
                **records[-1],
            }
    table = Table(title=f"{args.steps} GRPO steps x {args.batch_groups} groups x 8 (tiny model, reverse task)")
    for col in ("", "wall s", "rollouts generated", "trainer busy", "eval reward", "eval accuracy"):
        table.add_column(col)
    for name, r in (("async swarm", swarm), ("sync loop", sync)):
        table.add_row(
            name,
            f"{r['seconds']:.1f}",
            str(r["rollouts"]),
            f"{r['busy']:.0%}",
            f"{r['eval_reward']:.3f}",
            f"{r['eval_accuracy']:.3f}",
        )
    console.print(table)
    console.print(f"wall time ratio sync/async: {sync['seconds'] / swarm['seconds']:.2f}")


if __name__ == "__main__":
    main()
