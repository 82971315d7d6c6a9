"""The Learner: the policy model, its optimizer, an optional reference model, the version and the step count.

Everything here blocks (torch compute): a trio caller runs it with ``trio.to_thread.run_sync``. One GRPO step:

    batch of verified groups
      -> group-relative advantages per group
      -> per-token logprobs under the current weights (one forward pass over the batch)
      -> GRPO loss with truncated importance sampling (trainer/grpo.py), token-level normalisation
      -> backward, clip, AdamW step

Versions: ``new_version()`` names the current weights as the next version and keeps a snapshot of them, so
rollouts sampled on any of the last ``keep_versions`` versions can be scored at exactly that version.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from trainer.evaluate import evaluate
from trainer.groups import Group
from trainer.grpo import LossConfig, group_advantages, grpo_loss
from trainer.model import load_model, load_tokenizer, save_model_dir, token_logprobs
from trainer.scorer import Scorer
from trainer.settings import LearnerSettings
from trainer.tasks import Task
from trainer.text import TextCodec


def pad(rows: list[list[float]], width: int) -> torch.Tensor:
    out = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r)
    return out


class Learner:
    def __init__(self, model_dir: Path, settings: LearnerSettings, keep_versions: int) -> None:
        torch.manual_seed(settings.seed)
        torch.set_num_threads(settings.torch_threads)
        self.model_dir = Path(model_dir)
        self.settings = settings
        self.codec = TextCodec(load_tokenizer(model_dir))
        self.model = load_model(model_dir).eval()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=settings.lr, betas=(0.9, 0.99), weight_decay=0.0)
        self.loss_cfg = LossConfig(settings.clip_low, settings.clip_high, settings.tis_cap, settings.kl_beta)
        self.ref_model = load_model(model_dir).eval() if settings.kl_beta > 0 else None
        self.version = 0
        self.steps = 0
        self.scorer = Scorer(model_dir, keep=keep_versions)
        self.scorer.remember(self.version, self.model.state_dict())

    # -- training ----------------------------------------------------------------------------------------
    def step(self, groups: list[Group]) -> dict[str, float]:
        """One GRPO optimizer step on ``groups``; returns its metrics."""
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
        self.model.train()
        logp, mask = token_logprobs(self.model, prompts, comps, temps)
        width = logp.shape[1]
        ref = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref, _ = token_logprobs(self.ref_model, prompts, comps, temps)
        loss, stats = grpo_loss(logp, pad(old, width), pad(mu, width), torch.tensor(advs), mask, self.loss_cfg, ref)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.grad_clip).item()
        self.optimizer.step()
        self.model.eval()
        self.steps += 1
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
            "staleness": sum(self.version - g.version for g in groups) / len(groups),
            "groups": len(groups),
        }

    # -- versions ----------------------------------------------------------------------------------------
    def new_version(self) -> int:
        """Name the current weights as the next version and keep them for scoring."""
        self.version += 1
        self.scorer.remember(self.version, self.model.state_dict())
        return self.version

    def skip_to_version(self, version: int) -> None:
        """Call the current weights ``version`` (a restarted trainer never reuses a published number)."""
        self.version = version
        self.scorer.forget_all()
        self.scorer.remember(version, self.model.state_dict())

    def logprobs(
        self, version: int, prompts: list[list[int]], completions: list[list[int]], temperature: float
    ) -> list[list[float]] | None:
        """Per-token logprobs at ``version`` exactly, or None when that version is no longer kept."""
        return self.scorer.logprobs(version, prompts, completions, temperature)

    def save_model_dir(self, out: Path) -> Path:
        """The current weights as a model directory (for publishing)."""
        return save_model_dir(self.model, out, self.model_dir)

    # -- evaluation --------------------------------------------------------------------------------------
    def evaluate(self, task: Task, n: int, max_tokens: int) -> dict[str, float]:
        return evaluate(self.model, task, self.codec, n, max_tokens)

    # -- checkpoints -------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "version": self.version,
            "step": self.steps,
        }

    def restore(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = state["step"]
        self.skip_to_version(state["version"])
