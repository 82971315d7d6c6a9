"""Work leases: which (task, seed) prompts went to which sampler, so returned rollouts can be checked.

Leases are kept in issue order, so expiring them is cheap (the oldest are at the front) however many a flood of
identities asks for; each peer may hold only ``max_open_per_peer`` of them at once.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from protocols.work import SamplingParams, TaskSpec, WorkLease
from trainer.tasks import Task


@dataclass
class LeaseRecord:
    lease: WorkLease
    peer: str
    issued_at: float
    open_seeds: set[int] = field(default_factory=set)


class LeaseBook:
    """Hands out prompts by seed and remembers them until they come back or expire."""

    def __init__(
        self,
        task: Task,
        encode: Callable[[str], list[int]],
        group_size: int,
        sampling: SamplingParams,
        ttl: float = 120.0,
        seed_base: int = 0,
        max_staleness: int | None = None,
    ) -> None:
        self.task = task
        self.encode = encode  # prompt text -> token ids (with BOS)
        self.group_size = group_size
        self.sampling = sampling
        self.ttl = ttl
        self.max_staleness = max_staleness
        self.next_seed = seed_base  # the buffer cursor: saved in checkpoints
        self._leases: dict[str, LeaseRecord] = {}  # insertion order = issue order
        self.open_by_peer: dict[str, int] = {}
        self.issued = 0

    def open_leases(self, peer: str) -> int:
        """Leases ``peer`` holds that are still within their ttl. A lease past its ttl is one the sampler has
        given up on (its groups are still accepted until twice the ttl), so it no longer counts against the peer:
        an abandoned lease must not lock an honest sampler out of work."""
        self._expire()
        if not self.open_by_peer.get(peer):
            return 0
        cutoff = time.monotonic() - self.ttl
        held = 0
        for rec in reversed(self._leases.values()):  # newest first: stop at the first one past its ttl
            if rec.issued_at < cutoff:
                break
            held += rec.peer == peer
        return held

    def issue(self, peer: str, n_groups: int, version: int) -> WorkLease:
        self._expire()
        tasks = []
        for _ in range(n_groups):
            seed = self.next_seed
            self.next_seed += 1
            tasks.append(TaskSpec(self.task.name, seed, self.encode(self.task.prompt(seed))))
        lease = WorkLease(
            secrets.token_hex(8), version, self.group_size, self.sampling, tasks, self.ttl, self.max_staleness
        )
        self._leases[lease.lease_id] = LeaseRecord(lease, peer, time.monotonic(), {t.seed for t in tasks})
        self.open_by_peer[peer] = self.open_by_peer.get(peer, 0) + 1
        self.issued += 1
        return lease

    def _forget(self, lease_id: str) -> None:
        rec = self._leases.pop(lease_id)
        left = self.open_by_peer.get(rec.peer, 1) - 1
        if left > 0:
            self.open_by_peer[rec.peer] = left
        else:
            self.open_by_peer.pop(rec.peer, None)

    def get(self, lease_id: str) -> LeaseRecord | None:
        return self._leases.get(lease_id)

    def close_seed(self, lease_id: str, seed: int) -> None:
        rec = self._leases.get(lease_id)
        if rec is not None:
            rec.open_seeds.discard(seed)
            if not rec.open_seeds:
                self._forget(lease_id)

    def _expire(self) -> None:
        # A late group is still useful; keep leases twice their ttl before forgetting them. Oldest first: stop at
        # the first one still valid.
        cutoff = time.monotonic() - 2 * self.ttl
        while self._leases:
            lid, rec = next(iter(self._leases.items()))
            if rec.issued_at >= cutoff:
                break
            self._forget(lid)
