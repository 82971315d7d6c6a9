"""The trainer's ranks as the node sees them: which learner to open (one rank, ``--nproc N`` ranks started here, or
the ranks torchrun started), a watch that stops the node when a rank dies, and torchrun's ranks 1..N-1, which run
rank 0's learner commands instead of a node (trainer/distributed.py)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import trio

from trainer.device import resolve
from trainer.distributed import PING_EVERY, join_from_env, leave, spawn, under_torchrun
from trainer.leader import LeaderLearner
from trainer.learner import Learner
from trainer.rank_worker import run_worker
from trainer.settings import LearnerSettings

log = logging.getLogger(__name__)


def device_type(settings: LearnerSettings) -> str:
    return resolve(settings.device, settings.dtype, settings.publish_dtype).device.type


def open_learner(model_dir: Path, settings: LearnerSettings, keep: int, work_dir: Path) -> Learner | LeaderLearner:
    """One rank: today's Learner, unchanged. Under torchrun, or with ``--nproc N`` > 1: rank 0's view of a learner
    sharded over every rank (rank 0 starts the others itself with --nproc)."""
    if under_torchrun():
        ranks = join_from_env(device_type(settings))
    elif settings.nproc > 1:
        ranks = spawn(settings.nproc, device_type(settings), log_dir=Path(work_dir))
    else:
        return Learner(model_dir, settings, keep, work_dir)
    log.info("learner sharded over %d ranks (FSDP2, %s)", ranks.world, ranks.device.type)
    return LeaderLearner(ranks, model_dir, settings, keep, work_dir)


def serve_as_worker(settings: LearnerSettings) -> bool:
    """Under torchrun, ranks 1..N-1 of a trainer serve rank 0's commands and start no node: True once done."""
    if not under_torchrun() or int(os.environ["RANK"]) == 0:
        return False  # rank 0 joins the group when it opens its learner
    run_worker(join_from_env(device_type(settings)))
    return True


async def watch_ranks(learner: Learner | LeaderLearner) -> None:
    """While the node runs: a dead rank stops it (the error names the rank); an idle learner pings the workers (a
    no-op command) so their wait for the next command stays short of the collective timeout. When the node stops,
    so do the workers."""
    if not isinstance(learner, LeaderLearner):
        return
    try:
        while True:
            await trio.sleep(1.0)
            if learner.leader.failed is not None:  # a command failed (in a handler's thread, say): stop the node
                raise learner.leader.failed
            if learner.ranks.dead():
                raise learner.ranks.failure(None, grace=0.0)
            if time.monotonic() - learner.leader.last > PING_EVERY:
                await trio.to_thread.run_sync(learner.ping)
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(learner.stop)
            await trio.to_thread.run_sync(leave, learner.ranks, 30.0)
