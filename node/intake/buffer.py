"""Verified groups waiting for a gradient step, and the rule that turns them into a batch.

``take_batch`` is the whole batch policy, a pure function: oldest first; a group more than ``max_staleness``
versions behind is dropped as stale; a group whose rewards are all equal is dropped as carrying no signal.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from trainer.groups import Group, has_signal

Entry = tuple[Group, list[str]]  # a group and its rollout ids


@dataclass
class Taken:
    batch: list[Group] = field(default_factory=list)
    stale: int = 0
    no_signal: int = 0


def take_batch(queue: deque[Entry], want: int, version: int, max_staleness: int) -> Taken:
    """Pop groups from the front of ``queue`` until ``want`` usable ones are found or it runs dry."""
    out = Taken()
    while queue and len(out.batch) < want:
        group, _ = queue.popleft()
        if version - group.version > max_staleness:
            out.stale += 1
        elif not has_signal(group.rewards):
            out.no_signal += 1
        else:
            out.batch.append(group)
    return out


class RolloutBuffer:
    """Accepted groups in arrival order, and every rollout id ever accepted (resends are duplicates)."""

    def __init__(self, max_groups: int = 4096) -> None:
        self.queue: deque[Entry] = deque()
        self.max_groups = max_groups
        self.seen_ids: set[str] = set()

    def __len__(self) -> int:
        return len(self.queue)

    def is_duplicate(self, rollout_id: str) -> bool:
        return rollout_id in self.seen_ids

    def add(self, group: Group, rollout_ids: list[str]) -> int:
        """Buffer a group; returns how many of the oldest groups fell off the end (counted as stale)."""
        self.seen_ids.update(rollout_ids)
        self.queue.append((group, rollout_ids))
        dropped = 0
        while len(self.queue) > self.max_groups:
            self.queue.popleft()
            dropped += 1
        return dropped

    def snapshot(self) -> list[Entry]:
        return list(self.queue)
