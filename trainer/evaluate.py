"""Greedy evaluation of the policy on held-out seeds: the number the demo's curve shows rising."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from trainer.tasks import EVAL_SEED_BASE, Task
from trainer.text import TextCodec

# greedy completions of a batch of prompts of one length (token ids in, completion ids out)
Generate = Callable[[list[list[int]]], list[list[int]]]


@torch.no_grad()
def evaluate(
    model: PreTrainedModel, task: Task, codec: TextCodec, n: int = 64, max_tokens: int = 8
) -> dict[str, float]:
    """Mean reward and exact accuracy of greedy completions on ``n`` held-out prompts."""
    model.eval()
    eos = list(codec.eos_ids)

    def generate(prompts: list[list[int]]) -> list[list[int]]:
        ids = torch.tensor(prompts)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_tokens,
            eos_token_id=eos,
            pad_token_id=eos[0] if eos else 0,
        )
        return out[:, ids.shape[1] :].tolist()

    return evaluate_with(generate, task, codec, n)


def evaluate_with(generate: Generate, task: Task, codec: TextCodec, n: int) -> dict[str, float]:
    """``evaluate`` with any greedy generator (a sharded learner's runs on every rank at once)."""
    seeds = [EVAL_SEED_BASE + i for i in range(n)]
    by_len: dict[int, list[tuple[int, list[int]]]] = {}
    for seed in seeds:
        ids = codec.encode_prompt(task.prompt(seed))
        by_len.setdefault(len(ids), []).append((seed, ids))
    rewards, solved = [], []
    for batch in by_len.values():
        for (seed, _), row in zip(batch, generate([p for _, p in batch]), strict=True):
            text = codec.completion_text(row)
            rewards.append(task.reward(seed, text))
            solved.append(task.solved(seed, text))
    return {"eval_reward": sum(rewards) / n, "eval_accuracy": sum(solved) / n}
