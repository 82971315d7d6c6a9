"""Verified rollouts waiting for a gradient step, idempotent by rollout id, with a staleness bound."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.journal import RolloutJournal


@dataclass(frozen=True)
class VerifiedGroup:
    """One GRPO group the trainer checked itself: rewards are its own, logprobs the sampler's (mu)."""

    group_id: str
    peer: str
    version: int
    task_id: str
    seed: int
    prompt_ids: list[int]
    completions: list[list[int]]
    sampler_logprobs: list[list[float]]  # mu: what the sampler claims (checked within tolerance)
    old_logprobs: list[list[float]]  # pi_old: the trainer's own recomputation at ``version``
    rewards: list[float]
    solved: list[bool]
    temperature: float


class RolloutBuffer:
    """Accepted groups waiting for a step. With a journal, a group is journaled before it counts as accepted
    (and so before its ack goes out); the counters account for every accepted group's fate."""

    def __init__(self, max_groups: int = 4096, journal: RolloutJournal | None = None) -> None:
        self._groups: deque[tuple[VerifiedGroup, list[str]]] = deque()
        self.max_groups = max_groups
        self.journal = journal
        self.seen_ids: set[str] = set()
        self.accepted = 0  # rollouts
        self.groups_accepted = 0
        self.accepted_by_peer: dict[str, int] = {}
        self.dropped_stale = 0  # groups

    def __len__(self) -> int:
        return len(self._groups)

    def is_duplicate(self, rollout_id: str) -> bool:
        return rollout_id in self.seen_ids

    def add(self, group: VerifiedGroup, rollout_ids: list[str]) -> None:
        if self.journal is not None:
            self.journal.append(group, rollout_ids)
        self.restore(group, rollout_ids, count=True)

    def restore(self, group: VerifiedGroup, rollout_ids: list[str], count: bool) -> None:
        """Buffer a group without journaling it (replay); ``count`` it as newly accepted or not."""
        self.seen_ids.update(rollout_ids)
        self._groups.append((group, rollout_ids))
        if count:
            self.accepted += len(rollout_ids)
            self.groups_accepted += 1
            self.accepted_by_peer[group.peer] = self.accepted_by_peer.get(group.peer, 0) + len(rollout_ids)
        while len(self._groups) > self.max_groups:
            self._groups.popleft()
            self.dropped_stale += 1

    def snapshot(self) -> list[tuple[VerifiedGroup, list[str]]]:
        return list(self._groups)

    def take(self, n_groups: int, current_version: int, max_staleness: int) -> list[VerifiedGroup]:
        """Pop up to ``n_groups`` oldest groups, dropping (and counting) those too stale to train on."""
        out: list[VerifiedGroup] = []
        while self._groups and len(out) < n_groups:
            g, _ = self._groups.popleft()
            if current_version - g.version > max_staleness:
                self.dropped_stale += 1
                continue
            out.append(g)
        return out
