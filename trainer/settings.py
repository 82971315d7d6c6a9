"""Everything the trainer role can be told, in one place (CLI flags map onto these fields)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class TrainerSettings:
    model_dir: Path | None = None  # None: build the embedded tiny model
    task: str = "reverse"
    group_size: int = 8
    groups_per_lease: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 8
    lease_ttl: float = 120.0
    max_staleness: int = 4
    # GRPO
    lr: float = 3e-3
    batch_groups: int = 16
    clip_low: float = 0.2
    clip_high: float = 0.28
    tis_cap: float = 2.0
    kl_beta: float = 0.0
    grad_clip: float = 1.0
    publish_every: int = 1
    max_steps: int | None = None
    checkpoint_every: int = 10
    eval_every: int = 5
    eval_size: int = 64
    torch_threads: int = 1
    seed: int = 0
    # per-peer request limits (token buckets): sustained rate per second and burst
    rollout_rate: float = 8.0
    rollout_burst: float = 32.0
    work_rate: float = 2.0
    work_burst: float = 8.0
    linger_after_finish: float = 2.0  # keep serving the last version briefly after max_steps
