"""Rank 0's learner when the learner is sharded: the single-rank Learner's interface, each call that touches the
model broadcast to every rank first (trainer/distributed.py ``Leader``), then run on rank 0's own shard.

The node uses it exactly as it uses a ``Learner``. What differs: calls run one at a time (verification, a version
write and a step never overlap: each is a collective), so a step waits for the version named before it to be
written before it starts, not only before its optimizer step.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from protocols.draw import TokenDraw
from trainer.distributed import Leader, Ranks
from trainer.evaluate import evaluate_with
from trainer.groups import Group
from trainer.settings import LearnerSettings
from trainer.sharded import ShardedLearner
from trainer.tasks import Task


class LeaderLearner:
    def __init__(
        self, ranks: Ranks, model_dir: Path, settings: LearnerSettings, keep_versions: int, work_dir: Path
    ) -> None:
        self.leader = Leader(ranks)
        self.work_dir = Path(work_dir)
        spec = (Path(model_dir), settings, keep_versions, self.work_dir)
        self.inner: ShardedLearner = self.leader.call("open", spec, lambda: ShardedLearner(ranks, *spec))

    def __getattr__(self, name: str) -> Any:  # version, steps, codec, precision, scorer, ...: rank 0's own
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    @property
    def ranks(self) -> Ranks:
        return self.leader.ranks

    # -- training ----------------------------------------------------------------------------------------
    def step(self, groups: list[Group]) -> dict[str, float]:
        self.inner._written.wait()  # the version named before is written (a collective too) before this starts
        return self.leader.call("step", (groups,), lambda: self.inner.step(groups))

    # -- versions ----------------------------------------------------------------------------------------
    def name_version(self, version: int | None = None) -> int:
        return self.inner.name_version(version)  # rank 0 alone names; workers learn it from write_version

    def write_version(self, version: int) -> Path:
        if version != self.inner.version:  # checked before the workers start gathering
            self.inner._written.set()
            raise ValueError(f"version {version} is not the one named last ({self.inner.version})")
        return self.leader.call("write_version", (version,), lambda: self.inner.write_version(version))

    def new_version(self) -> int:
        version = self.name_version()
        self.write_version(version)
        return version

    def skip_to_version(self, version: int) -> None:
        self.leader.call("skip_to_version", (version,), lambda: self.inner.skip_to_version(version))

    def score(
        self, version: int, prompts: list[list[int]], completions: list[list[int]], temperature: float, top_p: float
    ) -> list[list[TokenDraw]] | None:
        if not self.inner.scorer.knows(version):
            return None
        args = (version, prompts, completions, temperature, top_p)
        return self.leader.call("score", args, lambda: self.inner.score(*args))

    def logprobs(
        self, version: int, prompts: list[list[int]], completions: list[list[int]], temperature: float
    ) -> list[list[float]] | None:
        draws = self.score(version, prompts, completions, temperature, 1.0)
        return None if draws is None else [[d.logprob for d in row] for row in draws]

    def save_model_dir(self, out: Path, version: int | None = None) -> Path:
        return self.inner.save_model_dir(out, version)  # rank 0's files only

    # -- evaluation --------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        args = (prompts, max_tokens)
        return self.leader.call("generate", args, lambda: self.inner.generate(*args))

    def evaluate(self, task: Task, n: int, max_tokens: int) -> dict[str, float]:
        """Rank 0 builds the prompts and rewards; the greedy forwards run on every rank."""
        return evaluate_with(lambda prompts: self.generate(prompts, max_tokens), task, self.inner.codec, n)

    # -- checkpoints -------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The learner's part of a checkpoint: a fresh DCP directory (every rank writes its shards) and the
        counters; the node's checkpoint file names it."""
        directory = self.work_dir / "checkpoints" / f"{self.inner.steps:09d}-{time.time_ns()}"
        return self.leader.call("save_state", (directory,), lambda: self.inner.save_state(directory))

    def restore(self, state: dict[str, Any], path: Path | None = None) -> None:
        """From a DCP checkpoint (any world size) or a single-rank one: workers read ``path`` themselves."""
        if "dcp" in state:
            light = {k: state[k] for k in ("dcp", "version", "step")}
            self.leader.call("restore", (light,), lambda: self.inner.restore(light))
            return
        light = {k: state[k] for k in ("version", "step")}
        self.leader.call("restore", (light, path), lambda: self.inner.restore(state))

    # -- the ranks ---------------------------------------------------------------------------------------
    def ping(self) -> None:
        self.leader.ping()

    def stop(self) -> None:
        """Every worker leaves its loop (they exit); safe to call twice, or after a rank died."""
        self.leader.stop()
