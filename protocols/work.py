"""Work protocol: a sampler asks the trainer for prompts; the trainer answers with a lease.

A lease names tasks by (task_id, seed) so the trainer can rebuild every prompt itself when the rollouts
come back, and never has to trust the prompt ids a sampler echoes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from protocols import WIRE_VERSION
from protocols import schema as s

PROTOCOL_ID = "/swarmrl/work/1.0.0"
# a work request is ~100 B (max_groups and a SamplerReport of two integers and a 32-character engine name): 4 KiB
# leaves room for new optional fields, and a stream that announces more is refused before its body is read
MAX_REQUEST_FRAME = 4 << 10
MAX_REQUEST_CONTAINERS = 4  # the request map and its report
# a lease of MAX_GROUPS_PER_LEASE prompts is what needs room: the reply limit (the sampler reads leases with it)
MAX_FRAME = 1 << 20
MAX_GROUPS_PER_LEASE = 64
MAX_PROMPT_TOKENS = 4096
MAX_NEW_TOKENS = 4096
MAX_GROUP_SIZE = 64
MAX_TOKEN_ID = (1 << 31) - 1


@dataclass(frozen=True)
class SamplingParams:
    temperature: float
    top_p: float
    max_tokens: int

    def to_wire(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p, "max_tokens": self.max_tokens}

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> SamplingParams:
        return cls(
            temperature=s.number(m, "temperature", 0.05, 10.0),
            top_p=s.number(m, "top_p", 0.01, 1.0),
            max_tokens=s.integer(m, "max_tokens", 1, MAX_NEW_TOKENS),
        )


@dataclass(frozen=True)
class TaskSpec:
    task_id: str
    seed: int
    prompt_ids: list[int]

    def to_wire(self) -> dict[str, Any]:
        return {"task_id": self.task_id, "seed": self.seed, "prompt_ids": self.prompt_ids}

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> TaskSpec:
        return cls(
            task_id=s.text(m, "task_id", 64),
            seed=s.integer(m, "seed", 0, (1 << 63) - 1),
            prompt_ids=s.int_list(m, "prompt_ids", MAX_PROMPT_TOKENS, 0, MAX_TOKEN_ID, min_len=1),
        )


@dataclass(frozen=True)
class SamplerReport:
    """What a sampler says about itself with each work request, for the trainer's dashboard only: nothing is
    decided on it (it is unverified), so it is shown as the sampler's own word."""

    version: int
    bytes_served: int
    engine: str

    def to_wire(self) -> dict[str, Any]:
        return {"version": self.version, "bytes_served": self.bytes_served, "engine": self.engine}

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> SamplerReport:
        return cls(
            version=s.integer(m, "version", -1, 1 << 40),
            bytes_served=s.integer(m, "bytes_served", 0, 1 << 62),
            engine=s.text(m, "engine", 32),
        )


@dataclass(frozen=True)
class WorkRequest:
    max_groups: int
    report: SamplerReport | None = None  # optional (older samplers send none)

    def to_wire(self) -> dict[str, Any]:
        extra = {} if self.report is None else {"report": self.report.to_wire()}
        return {"v": WIRE_VERSION, "t": "work_request", "max_groups": self.max_groups, **extra}

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> WorkRequest:
        s.expect_type(m, "work_request")
        report = SamplerReport.from_wire(s.mapping(m, "report")) if "report" in m else None
        return cls(max_groups=s.integer(m, "max_groups", 1, MAX_GROUPS_PER_LEASE), report=report)


@dataclass(frozen=True)
class WorkLease:
    lease_id: str
    version: int
    group_size: int
    sampling: SamplingParams
    tasks: list[TaskSpec]
    expires_in: float
    # groups sampled on a version more than this many behind the trainer's are refused (None: not told)
    max_staleness: int | None = None

    def to_wire(self) -> dict[str, Any]:
        extra = {} if self.max_staleness is None else {"max_staleness": self.max_staleness}
        return {
            **extra,
            "v": WIRE_VERSION,
            "t": "lease",
            "lease_id": self.lease_id,
            "version": self.version,
            "group_size": self.group_size,
            "sampling": self.sampling.to_wire(),
            "tasks": [t.to_wire() for t in self.tasks],
            "expires_in": self.expires_in,
        }

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> WorkLease:
        s.expect_type(m, "lease")
        tasks = s.items(m, "tasks", MAX_GROUPS_PER_LEASE)
        return cls(
            lease_id=s.text(m, "lease_id", 64),
            version=s.integer(m, "version", 0, 1 << 40),
            group_size=s.integer(m, "group_size", 1, MAX_GROUP_SIZE),
            sampling=SamplingParams.from_wire(s.mapping(m, "sampling")),
            tasks=[TaskSpec.from_wire(t if isinstance(t, dict) else {}) for t in tasks],
            expires_in=s.number(m, "expires_in", 0.0, 86400.0),
            max_staleness=s.integer(m, "max_staleness", 0, 1 << 20) if "max_staleness" in m else None,
        )
