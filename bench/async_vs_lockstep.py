"""bench/async_vs_lockstep: the async swarm (trainer + N sampler nodes on loopback, one process) vs the lockstep
baseline (sample a batch, train, swap weights, repeat), with the same budget: the same number of GRPO steps on the
same number of groups per step. Prints wall time ratio and final eval reward/accuracy of both.

    .venv/bin/python bench/async_vs_lockstep.py [--steps 20] [--samplers 2]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from tempfile import TemporaryDirectory

import trio
from rich.console import Console
from rich.table import Table

from node.engines import engine_factory
from node.local_swarm import settings, start_bootstrap, start_sampler, start_trainer, wait_until
from node.lockstep import run_lockstep
from node.metrics import read_jsonl
from trainer.base_model import build_base_model

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
            linger=0.0,
        )
        for i in range(samplers):
            await start_sampler(nursery, root, f"s{i}", boot)
        await wait_until(lambda: trainer.role.finished.is_set(), 3600, 0.5, what="the swarm's steps")
        elapsed = time.monotonic() - t0
        rollouts = trainer.role.intake.ledger.rollouts_accepted
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
        model_dir = build_base_model(root / "model")
        with console.status("async swarm"):
            swarm = trio.run(run_swarm, root / "swarm", model_dir, args.steps, args.samplers, args.batch_groups)
        s = settings(trainer={"max_tokens": 6, "batch_groups": args.batch_groups, "eval_every": args.steps})
        with console.status("lockstep loop"):
            t0 = time.monotonic()
            records = run_lockstep(
                model_dir, s.trainer, s.learner, args.steps, engine_factory("mlx", "8"), root / "lockstep"
            )
            lockstep = {
                "seconds": time.monotonic() - t0,
                "rollouts": records[-1]["rollouts"],
                "busy": float("nan"),
                **records[-1],
            }
    table = Table(title=f"{args.steps} GRPO steps x {args.batch_groups} groups x 8 (tiny model, reverse task)")
    for col in ("", "wall s", "rollouts generated", "trainer busy", "eval reward", "eval accuracy"):
        table.add_column(col)
    for name, r in (("async swarm", swarm), ("lockstep loop", lockstep)):
        table.add_row(
            name,
            f"{r['seconds']:.1f}",
            str(r["rollouts"]),
            f"{r['busy']:.0%}",
            f"{r['eval_reward']:.3f}",
            f"{r['eval_accuracy']:.3f}",
        )
    console.print(table)
    console.print(f"wall time ratio lockstep/async: {lockstep['seconds'] / swarm['seconds']:.2f}")


if __name__ == "__main__":
    main()
