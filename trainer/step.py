"""One GRPO optimizer step on a batch of verified groups (blocking: run it off the event loop)."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from trainer.buffer import VerifiedGroup
from trainer.grpo import LossConfig, group_advantages, grpo_loss
from trainer.policy import token_logprobs


def pad(rows: list[list[float]], width: int) -> torch.Tensor:
    out = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r)
    return out


def train_step(
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    groups: list[VerifiedGroup],
    cfg: LossConfig,
    grad_clip: float,
    version: int,
    ref_model: PreTrainedModel | None = None,
) -> dict[str, float]:
    prompts, comps, temps, old, mu, advs = [], [], [], [], [], []
    for g in groups:
        adv = group_advantages(torch.tensor(g.rewards))
        for c, o, m, a in zip(g.completions, g.old_logprobs, g.sampler_logprobs, adv.tolist(), strict=True):
            prompts.append(g.prompt_ids)
            comps.append(c)
            temps.append(g.temperature)
            old.append(o)
            mu.append(m)
            advs.append(a)
    model.train()
    logp, mask = token_logprobs(model, prompts, comps, temps)
    width = logp.shape[1]
    ref = None
    if ref_model is not None and cfg.kl_beta > 0:
        with torch.no_grad():
            ref, _ = token_logprobs(ref_model, prompts, comps, temps)
    loss, stats = grpo_loss(logp, pad(old, width), pad(mu, width), torch.tensor(advs), mask, cfg, ref)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip).item()
    optimizer.step()
    model.eval()
    rewards = [r for g in groups for r in g.rewards]
    return {
        "loss": stats.loss,
        "clip_fraction": stats.clip_fraction,
        "tis_mean": stats.tis_mean,
        "tis_capped": stats.tis_capped_fraction,
        "kl": stats.kl,
        "grad_norm": grad_norm,
        "reward": sum(rewards) / len(rewards),
        "solved": sum(s for g in groups for s in g.solved) / len(rewards),
        "staleness": sum(version - g.version for g in groups) / len(groups),
        "groups": len(groups),
    }
