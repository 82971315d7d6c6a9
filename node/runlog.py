"""The trainer's run log: one JSON line per record in ``<data dir>/metrics.jsonl`` (what the demo, the tests and the
benches read), the recent records (for the dashboard's curves), the latest value of each metric (for status), the
reward curve drawn from it; and what a training step's record carries besides the learner's metrics."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from node.metrics import append_jsonl, plot_curve, read_jsonl
from node.runtime import peak_rss_mb

if TYPE_CHECKING:
    from node.intake import RolloutIntake
    from node.weights.outbox import Outbox

T = TypeVar("T")


class RunLog:
    def __init__(self, path: Path, keep: int = 5000) -> None:
        self.path = path
        self.history: deque[dict[str, Any]] = deque(maxlen=keep)  # recent records, bounded
        self.last: dict[str, Any] = {}  # each metric's latest value

    def record(self, step: int, version: int, values: dict[str, Any]) -> None:
        self.last.update(values)
        record = {
            "time": time.time(),
            "step": step,
            "version": version,
            "peak_rss_mb": peak_rss_mb(),  # the high-water mark so far: where in a run memory peaks
            **values,
        }
        self.history.append(record)
        append_jsonl(self.path, record)

    def highest_version(self) -> int:
        """The highest version any record on disk names (-1: none), a dead process's included: a version it named
        and logged but never wrote or published still had its number used."""
        versions = [r.get("version") for r in read_jsonl(self.path)]
        return max((v for v in versions if isinstance(v, int)), default=-1)

    def plot(self, png: Path) -> None:
        """Blocking: the reward and accuracy curves so far as a PNG."""
        plot_curve(read_jsonl(self.path), png)


class StepMeter:
    """What a training step's record adds to the learner's metrics: where the loop's time went, the verifier's
    scoring since the last step, the intake's counters."""

    def __init__(self, intake: RolloutIntake) -> None:
        self.intake = intake
        self.busy_seconds = 0.0
        self._verify_seen = (0.0, 0)  # (scoring seconds, tokens scored) at the last step

    async def busy(self, fn: Callable[..., T], *args: Any) -> T:
        """Run learner work off the event loop, counting its time as the trainer's busy time."""
        t0 = time.monotonic()
        try:
            return await trio.to_thread.run_sync(fn, *args)
        finally:
            self.busy_seconds += time.monotonic() - t0

    def busy_fraction(self) -> float:
        """Busy time over the time since the first rollouts arrived (the trainer's work starts)."""
        start = self.intake.first_accepted_at or time.monotonic()
        return self.busy_seconds / max(time.monotonic() - start, 1e-9)

    def record(self, metrics: dict[str, Any], learn: float, naming: float, outbox: Outbox) -> dict[str, Any]:
        """A step's record: ``learn`` seconds in the learner, ``naming`` seconds naming a version after it."""
        verifier, ledger = self.intake.verifier, self.intake.ledger
        seconds, tokens = verifier.scoring_seconds, verifier.scored_tokens
        (seen_s, seen_t), self._verify_seen = self._verify_seen, (seconds, tokens)
        metrics |= {
            "time_learn": learn,
            "time_publish": naming + metrics.pop("time_version_wait"),  # what the loop waited
            "time_verify": seconds - seen_s,
            "verify_tokens": tokens - seen_t,
            "publish_bytes": outbox.update_bytes,
        }
        return {
            **metrics,
            "busy_fraction": self.busy_fraction(),
            "forged": self.intake.forged,
            "stale_dropped": ledger.groups_stale,
            "zero_signal_groups": ledger.groups_no_signal,
            "rollouts_accepted": ledger.rollouts_accepted,
            "versions_coalesced": outbox.cadence.coalesced,
        }
