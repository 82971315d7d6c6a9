"""Rollout protocol: a sampler sends one finished GRPO group straight to the trainer, which acks it.

Submissions are idempotent by rollout id: a resend after a lost ack is answered ``duplicate``, never
counted twice. Nothing here is trusted: the trainer rebuilds the prompt from (task_id, seed), recomputes
rewards, and checks the claimed logprobs (see node/intake/verify.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from protocols import WIRE_VERSION
from protocols import schema as s
from protocols.work import MAX_GROUP_SIZE, MAX_NEW_TOKENS, MAX_PROMPT_TOKENS, MAX_TOKEN_ID

PROTOCOL_ID = "/swarmrl/rollout/1.0.0"
MAX_FRAME = 8 << 20
MAX_ACK_FRAME = 1 << 20
QUANT_MODES = ("none", "q8", "q4")  # weight quantization
ENGINES = ("mlx", "torch")
COMPUTE_DTYPES = ("fp32", "bf16", "fp16")  # what the sampler's forward pass computes in


def frame_limit(group_size: int, max_tokens: int) -> int:
    """The largest rollout frame an honest sampler sends for a lease of this shape (prompt of MAX_PROMPT_TOKENS):
    a trainer refuses anything larger before reading it. Per sample: rollout id <= 130 B, token ids <= 5 B and
    logprobs 9 B per token, finish reason, reward and keys; per group: ids, names and the prompt's tokens."""
    per_sample = 256 + 14 * max_tokens
    return min(MAX_FRAME, 2048 + 5 * MAX_PROMPT_TOKENS + group_size * per_sample)


def max_containers(group_size: int) -> int:
    """Maps and arrays in an honest group: the group, its prompt and samples lists, and three per sample."""
    return 16 + 4 * group_size


FINISH_REASONS = ("stop", "length")


@dataclass(frozen=True)
class Sample:
    rollout_id: str
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    claimed_reward: float | None = None  # the sampler's own score; the trainer recomputes and compares

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "rollout_id": self.rollout_id,
            "completion_ids": self.completion_ids,
            "logprobs": self.logprobs,
            "finish_reason": self.finish_reason,
        }
        if self.claimed_reward is not None:
            out["reward"] = self.claimed_reward
        return out

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> Sample:
        ids = s.int_list(m, "completion_ids", MAX_NEW_TOKENS, 0, MAX_TOKEN_ID, min_len=1)
        logprobs = s.float_list(m, "logprobs", MAX_NEW_TOKENS, -1e4, 1e-3)
        if len(logprobs) != len(ids):
            raise s.SchemaError(f"{len(logprobs)} logprobs for {len(ids)} completion tokens")
        reason = s.text(m, "finish_reason", 16)
        if reason not in FINISH_REASONS:
            raise s.SchemaError(f"unknown finish_reason {reason!r}")
        claimed = s.number(m, "reward", -1e6, 1e6) if "reward" in m else None
        return cls(s.text(m, "rollout_id", 128), ids, logprobs, reason, claimed)


@dataclass(frozen=True)
class RolloutGroup:
    group_id: str
    lease_id: str
    task_id: str
    seed: int
    version: int
    sampler: str
    prompt_ids: list[int]
    temperature: float
    top_p: float
    quant: str
    samples: list[Sample]
    draw: str | None = None  # the sampling rule the tokens were drawn by (protocols/draw.py RULE); None: unknown
    # the sampler's engine and compute dtype: with ``quant`` its declared mode, whose noise the trainer's limits
    # allow for (node/intake/noise.py); the trainer binds a peer to the mode it declared first
    engine: str = "torch"
    compute: str = "fp32"

    def to_wire(self) -> dict[str, Any]:
        extra = {} if self.draw is None else {"draw": self.draw}
        return {
            **extra,
            "v": WIRE_VERSION,
            "t": "rollouts",
            "group_id": self.group_id,
            "lease_id": self.lease_id,
            "task_id": self.task_id,
            "seed": self.seed,
            "version": self.version,
            "sampler": self.sampler,
            "prompt_ids": self.prompt_ids,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "quant": self.quant,
            "engine": self.engine,
            "compute": self.compute,
            "samples": [x.to_wire() for x in self.samples],
        }

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> RolloutGroup:
        s.expect_type(m, "rollouts")
        raw_samples = s.items(m, "samples", MAX_GROUP_SIZE, min_len=1)
        quant = s.text(m, "quant", 16)
        if quant not in QUANT_MODES:
            raise s.SchemaError(f"unknown quant mode {quant!r}")
        engine, compute = s.text(m, "engine", 16), s.text(m, "compute", 16)
        if engine not in ENGINES:
            raise s.SchemaError(f"unknown engine {engine!r}")
        if compute not in COMPUTE_DTYPES:
            raise s.SchemaError(f"unknown compute dtype {compute!r}")
        samples = [Sample.from_wire(x if isinstance(x, dict) else {}) for x in raw_samples]
        if len({x.rollout_id for x in samples}) != len(samples):
            raise s.SchemaError("rollout ids repeat inside one group")
        return cls(
            group_id=s.text(m, "group_id", 128),
            lease_id=s.text(m, "lease_id", 64),
            task_id=s.text(m, "task_id", 64),
            seed=s.integer(m, "seed", 0, (1 << 63) - 1),
            version=s.integer(m, "version", 0, 1 << 40),
            sampler=s.text(m, "sampler", 128),
            prompt_ids=s.int_list(m, "prompt_ids", MAX_PROMPT_TOKENS, 0, MAX_TOKEN_ID, min_len=1),
            temperature=s.number(m, "temperature", 0.05, 10.0),
            top_p=s.number(m, "top_p", 0.01, 1.0),
            quant=quant,
            samples=samples,
            draw=s.text(m, "draw", 32) if "draw" in m else None,
            engine=engine,
            compute=compute,
        )


@dataclass
class RolloutAck:
    accepted: list[str] = field(default_factory=list)
    duplicate: list[str] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)

    def to_wire(self) -> dict[str, Any]:
        return {
            "v": WIRE_VERSION,
            "t": "ack",
            "accepted": self.accepted,
            "duplicate": self.duplicate,
            "rejected": [[rid, reason[:512]] for rid, reason in self.rejected],  # room for the limits applied
        }

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> RolloutAck:
        s.expect_type(m, "ack")
        rejected = []
        for item in s.items(m, "rejected", MAX_GROUP_SIZE):
            if not (isinstance(item, list) and len(item) == 2 and all(isinstance(x, str) for x in item)):
                raise s.SchemaError("rejected entries must be [rollout_id, reason]")
            rejected.append((item[0], item[1]))
        accepted = s.items(m, "accepted", MAX_GROUP_SIZE)
        duplicate = s.items(m, "duplicate", MAX_GROUP_SIZE)
        if not all(isinstance(x, str) for x in accepted + duplicate):
            raise s.SchemaError("ack ids must be strings")
        return cls(accepted, duplicate, rejected)
