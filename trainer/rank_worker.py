"""A worker rank of a sharded trainer (ranks 1..N-1): join the group, then run rank 0's commands until ``stop``.

Started by rank 0 (``--nproc N``, trainer/distributed.py ``spawn``) as ``python -m trainer.rank_worker``, or by
torchrun through the node's own entry point (node/roles/ranks.py), which lands here for every rank but 0.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import torch

from trainer.distributed import Ranks, die_with_parent, join, leave, serve
from trainer.memory import apply_trainer_malloc_policy


class Worker:
    """What a worker's commands run on: ``open`` builds its shard of the learner, every other command is the
    learner's method of that name."""

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks
        self.learner: Any = None

    def open(self, model_dir: Path, settings: Any, keep: int, work_dir: Path) -> None:
        from trainer.sharded import ShardedLearner

        self.learner = None  # the last one's memory goes before the next one loads
        self.learner = ShardedLearner(self.ranks, model_dir, settings, keep, work_dir)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["learner"], name)


def run_worker(ranks: Ranks) -> None:
    try:
        serve(ranks, Worker(ranks))
    finally:
        leave(ranks)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--init", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--parent", type=int, required=True)
    args = ap.parse_args()
    die_with_parent(args.parent)
    apply_trainer_malloc_policy()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{args.rank} %(levelname)s %(name)s: %(message)s")
    device = torch.device("cuda", args.rank) if args.device == "cuda" else torch.device("cpu")
    run_worker(join(args.rank, args.world, args.init, device))


if __name__ == "__main__":
    main()
