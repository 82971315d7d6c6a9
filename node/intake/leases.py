"""Work leases: which (task, seed) prompts went to which sampler, so returned rollouts can be checked."""

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
        self._leases: dict[str, LeaseRecord] = {}
        self.issued = 0

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
        self.issued += 1
        return lease

    def get(self, lease_id: str) -> LeaseRecord | None:
        return self._leases.get(lease_id)

    def close_seed(self, lease_id: str, seed: int) -> None:
        rec = self._leases.get(lease_id)
        if rec is not None:
            rec.open_seeds.discard(seed)
            if not rec.open_seeds:
                del self._leases[lease_id]

    def _expire(self) -> None:
        # A late group is still useful; keep leases twice their ttl before forgetting them.
        cutoff = time.monotonic() - 2 * self.ttl
        for lid in [lid for lid, r in self._leases.items() if r.issued_at < cutoff]:
            del self._leases[lid]
