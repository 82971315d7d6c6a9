"""Verified groups waiting for a gradient step, and the rule that turns them into a batch.

``take_batch`` is the whole batch policy, a pure function: oldest first; a group more than ``max_staleness``
versions behind is dropped as stale; a group whose rewards are all equal is dropped as carrying no signal.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from trainer.groups import Group, has_signal

Entry = tuple[Group, list[str]]  # a group and its rollout ids


@dataclass
class Taken:
    batch: list[Group] = field(default_factory=list)
    stale: int = 0
    no_signal: int = 0


def take_batch(queue: deque[Entry], want: int, version: int, max_staleness: int, taken: Counter | None = None) -> Taken:
    """Take up to ``want`` usable groups, oldest first, but no peer more than its fair share: ``want`` divided among
    the peers with groups waiting (``taken`` counts what each already has in this batch). A peer's groups over its
    share wait for the next batch, so a flood of groups from one identity (or a few) cannot crowd out the others;
    if the batch would otherwise wait for groups that are not there, they fill it (the policy is work-conserving)."""
    out = Taken()
    taken = taken if taken is not None else Counter()
    peers = len({g.peer for g, _ in queue} | set(taken))
    share = max(1, -(-(want + sum(taken.values())) // max(1, peers)))  # ceil
    kept: list[Entry] = []
    while queue and len(out.batch) < want:
        entry = queue.popleft()
        group = entry[0]
        if version - group.version > max_staleness:
            out.stale += 1
        elif not has_signal(group.rewards):
            out.no_signal += 1
        elif taken[group.peer] >= share:
            kept.append(entry)
        else:
            taken[group.peer] += 1
            out.batch.append(group)
    while kept and len(out.batch) < want:  # nobody else had groups waiting: don't stall the step for fairness
        entry = kept.pop(0)
        taken[entry[0].peer] += 1
        out.batch.append(entry[0])
    queue.extendleft(reversed(kept))
    return out


def fate(group: Group) -> str:
    """What became of an accepted group that is neither buffered nor trained (a journal compaction's tally):
    dropped as carrying no signal, or as stale (too old, or fallen off the buffer's end)."""
    return "stale" if has_signal(group.rewards) else "no_signal"


class SeenIds:
    """Rollout ids already accepted, by the version they were sampled on: a resend is answered "duplicate". Ids of
    versions too old to be accepted again are forgotten (a resend of one is refused as stale anyway), so this set
    does not grow with the length of a run."""

    def __init__(self) -> None:
        self.by_version: dict[int, set[str]] = {}

    def __contains__(self, rollout_id: str) -> bool:
        return any(rollout_id in ids for ids in self.by_version.values())

    def __len__(self) -> int:
        return sum(len(ids) for ids in self.by_version.values())

    def add(self, version: int, ids: list[str]) -> None:
        self.by_version.setdefault(version, set()).update(ids)

    def discard(self, version: int, ids: list[str]) -> None:
        self.by_version.get(version, set()).difference_update(ids)

    def forget_before(self, version: int) -> None:
        for v in [v for v in self.by_version if v < version]:
            del self.by_version[v]


class RolloutBuffer:
    """Accepted groups in arrival order, and the rollout ids accepted recently (resends are duplicates)."""

    def __init__(self, max_groups: int = 4096) -> None:
        self.queue: deque[Entry] = deque()
        self.max_groups = max_groups
        self.seen_ids = SeenIds()

    def __len__(self) -> int:
        return len(self.queue)

    def is_duplicate(self, rollout_id: str) -> bool:
        return rollout_id in self.seen_ids

    def add(self, group: Group, rollout_ids: list[str]) -> int:
        """Buffer a group; returns how many of the oldest groups fell off the end (counted as stale)."""
        self.seen_ids.add(group.version, rollout_ids)
        self.queue.append((group, rollout_ids))
        dropped = 0
        while len(self.queue) > self.max_groups:
            self.queue.popleft()
            dropped += 1
        return dropped

    def snapshot(self) -> list[Entry]:
        return list(self.queue)
