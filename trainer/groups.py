"""A verified GRPO group: what the learner trains on. Plain data, no torch, so the intake can build it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Group:
    """One group the trainer checked itself: rewards are its own, ``old_logprobs`` its own recomputation at
    ``version`` (pi_old), ``sampler_logprobs`` what the sampler claimed (mu, checked within tolerance)."""

    group_id: str
    peer: str
    version: int
    task_id: str
    seed: int
    prompt_ids: list[int]
    completions: list[list[int]]
    sampler_logprobs: list[list[float]]
    old_logprobs: list[list[float]]
    rewards: list[float]
    solved: list[bool]
    temperature: float


def has_signal(rewards: list[float]) -> bool:
    """A group whose rewards are all equal has zero advantage everywhere: it teaches nothing."""
    return max(rewards) - min(rewards) > 1e-9
