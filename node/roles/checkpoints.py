"""A trainer's state across restarts: the learner and the intake's cut of its journal, checkpointed together, and
the version numbers a restarted trainer must never reuse."""

from __future__ import annotations

import logging
from pathlib import Path

import trio

from node.intake import RolloutIntake
from node.runlog import RunLog
from node.weights.store import ChunkStore
from trainer.checkpoint import load_checkpoint, save_checkpoint
from trainer.leader import LeaderLearner
from trainer.learner import Learner

log = logging.getLogger(__name__)


class Checkpoints:
    def __init__(
        self,
        path: Path,
        learner: Learner | LeaderLearner,
        intake: RolloutIntake,
        store: ChunkStore,
        runlog: RunLog,
    ) -> None:
        self.path, self.learner, self.intake, self.store, self.runlog = path, learner, intake, store, runlog

    def restore(self) -> None:
        """Resume from the checkpoint, if any; then continue after every version named or published before."""
        # versions named before a crash: written (their weights files, before publishing, which runs in the
        # background and may not have finished), or only named and logged (the write follows the name off the loop,
        # and a kill can land between them: burner run e1 named and logged version 5 twice)
        named = max(max(self.learner.scorer.found_at_start, default=-1), self.runlog.highest_version())
        saved = load_checkpoint(self.path)
        if saved is not None:
            self.learner.restore(saved, self.path)
            log.info("resumed from %s at step %d, version %d", self.path, saved["step"], saved["version"])
        self.intake.start(saved)
        published = self.store.latest()
        last = max(named, published[2].version if published is not None else -1)
        if last > self.learner.version:
            # named or published after the last checkpoint, then lost in a crash: never reuse a version number
            self.learner.skip_to_version(last + 1)
            log.info(
                "versions up to %d were named before a restart; continuing as version %d", last, self.learner.version
            )

    async def save(self) -> None:
        """The intake cuts its journal in the event loop; the checkpoint naming that cut is written off the loop;
        then the journal segments it supersedes are dropped."""
        intake_state = self.intake.begin_checkpoint()
        state = {**(await trio.to_thread.run_sync(self.learner.state)), **intake_state}  # sharded: a collective
        await trio.to_thread.run_sync(save_checkpoint, self.path, state)
        self.intake.end_checkpoint(intake_state)
