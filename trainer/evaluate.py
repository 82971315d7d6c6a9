"""Greedy evaluation of the policy on held-out seeds: the number the demo's curve shows rising."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from trainer.tasks import Task

EVAL_SEED_BASE = 10**12  # far from the seeds handed out for training


@torch.no_grad()
def evaluate(
    model: PreTrainedModel,
    task: Task,
    encode: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    eos_ids: tuple[int, ...],
    n: int = 64,
    max_tokens: int = 8,
) -> dict[str, float]:
    seeds = [EVAL_SEED_BASE + i for i in range(n)]
    by_len: dict[int, list[tuple[int, list[int]]]] = {}
    for seed in seeds:
        ids = encode(task.prompt(seed))
        by_len.setdefault(len(ids), []).append((seed, ids))
    rewards, solved = [], []
    model.eval()
    for batch in by_len.values():
        ids = torch.tensor([p for _, p in batch])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_tokens,
            eos_token_id=list(eos_ids),
            pad_token_id=eos_ids[0] if eos_ids else 0,
        )
        for (seed, _), row in zip(batch, out[:, ids.shape[1] :].tolist(), strict=True):
            end = next((k for k, t in enumerate(row) if t in eos_ids), len(row))
            text = decode(row[:end])
            rewards.append(task.reward(seed, text))
            solved.append(task.solved(seed, text))
    return {"eval_reward": sum(rewards) / n, "eval_accuracy": sum(solved) / n}
