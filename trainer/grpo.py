"""GRPO with off-policy correction, in one readable function per idea.

Per token t of completion i in group g:
    A_i      = (r_i - mean_g r) / (std_g r + eps)                 group-relative advantage
    ratio    = pi_theta(t) / pi_old(t)                            pi_old: trainer's logprob at the rollout's version
    w        = min(pi_old(t) / mu(t), tis_cap)                    truncated importance sampling: mu is the
                                                                  sampler's (int8, maybe stale) logprob
    loss_t   = -w * min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)   (+ beta * KL_k3 to a reference)
    loss     = sum over all tokens / number of tokens             token-level normalization (DAPO); with
                                                                  micro-batches, each sums its tokens and
                                                                  divides by the whole batch's token count
Groups whose rewards are all equal carry no signal and are dropped before a step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossConfig:
    clip_low: float = 0.2
    clip_high: float = 0.28
    tis_cap: float = 2.0
    kl_beta: float = 0.0


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """(r - mean) / (std + eps) over one group's rewards (population std)."""
    return (rewards - rewards.mean()) / (rewards.std(unbiased=False) + eps)


@dataclass
class LossStats:
    loss: float
    clip_fraction: float
    tis_mean: float
    tis_capped_fraction: float
    kl: float


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
    ref_logp: torch.Tensor | None = None,
    token_count: float | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """All tensors [B, T] except ``advantages`` [B]; returns (scalar loss, stats). ``token_count``: the number of
    tokens of the whole batch when this is one micro-batch of it (default: this batch's own count), so that the
    losses and stats of the micro-batches add up to those of the whole batch."""
    adv = advantages[:, None]
    ratio = torch.exp(logp - old_logp)
    clipped = torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    surrogate = torch.minimum(ratio * adv, clipped * adv)
    tis_raw = torch.exp(old_logp - sampler_logp)
    tis = torch.clamp(tis_raw, max=cfg.tis_cap).detach()
    per_token = -tis * surrogate
    kl = torch.zeros_like(per_token)
    if cfg.kl_beta > 0 and ref_logp is not None:
        # k3 estimator of KL(pi_theta || pi_ref): exp(ref - logp) - (ref - logp) - 1, always >= 0
        diff = ref_logp - logp
        kl = torch.exp(diff) - diff - 1
        per_token = per_token + cfg.kl_beta * kl
    n = mask.sum().clamp(min=1) if token_count is None else torch.tensor(float(max(token_count, 1)))
    loss = (per_token * mask).sum() / n
    with torch.no_grad():
        was_clipped = ((ratio * adv) != surrogate).float()
        stats = LossStats(
            loss=loss.item(),
            clip_fraction=((was_clipped * mask).sum() / n).item(),
            tis_mean=((tis * mask).sum() / n).item(),
            tis_capped_fraction=(((tis_raw > cfg.tis_cap).float() * mask).sum() / n).item(),
            kl=((kl * mask).sum() / n).item(),
        )
    return loss, stats
