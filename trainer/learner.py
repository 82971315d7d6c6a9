"""The Learner: the policy model, its optimizer, an optional reference model, the version and the step count.

Everything here blocks (torch compute): a trio caller runs it with ``trio.to_thread.run_sync``. One GRPO step:

    batch of verified groups
      -> group-relative advantages per group
      -> micro-batches of rows under a token budget; for each: per-token logprobs under the current weights
         (autocast to the compute dtype), the GRPO loss with truncated importance sampling (trainer/grpo.py)
         normalised by the token count of the WHOLE batch, backward (gradients accumulate)
      -> clip, AdamW step on fp32 master weights

Versions: ``new_version()`` names the current weights as the next version and writes them once, in the publish
dtype, where the scorer (verification) and publishing both take them from.

Memory per parameter (fp32 master weights): weights 4 + gradients 4 + AdamW 8 + the scoring model in the publish
dtype (2 for bf16, 4 for fp32) = 18-20 bytes, plus activations (bounded by the micro-batch token budget).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from protocols.draw import TokenDraw
from trainer.device import Precision, resolve
from trainer.evaluate import evaluate
from trainer.groups import Group
from trainer.grpo import LossConfig, LossStats, group_advantages, grpo_loss
from trainer.model import load_model, load_tokenizer, micro_batches, token_logprobs, write_model_dir, write_weights
from trainer.model_dir import inspect_model_dir
from trainer.scorer import Scorer
from trainer.settings import LearnerSettings
from trainer.tasks import Task
from trainer.text import TextCodec


@dataclass
class Row:
    prompt: list[int]
    completion: list[int]
    temperature: float
    old: list[float]
    mu: list[float]
    advantage: float


def pad(rows: list[list[float]], width: int, device: torch.device) -> torch.Tensor:
    out = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r)
    return out.to(device)


def rows_of(groups: list[Group]) -> list[Row]:
    rows = []
    for g in groups:
        adv = group_advantages(torch.tensor(g.rewards)).tolist()
        for c, o, m, a in zip(g.completions, g.old_logprobs, g.sampler_logprobs, adv, strict=True):
            rows.append(Row(g.prompt_ids, c, g.temperature, o, m, a))
    return rows


class Learner:
    def __init__(self, model_dir: Path, settings: LearnerSettings, keep_versions: int, work_dir: Path) -> None:
        torch.manual_seed(settings.seed)
        torch.set_num_threads(settings.torch_threads)
        self.model_dir = Path(model_dir)
        self.settings = settings
        self.precision: Precision = resolve(settings.device, settings.dtype, settings.publish_dtype)
        info = inspect_model_dir(model_dir)
        self.codec = TextCodec(load_tokenizer(model_dir), info.eos_ids, settings.chat_template)
        self.model = load_model(model_dir, torch.float32, self.precision.device).eval()
        if settings.activation_checkpointing:
            self.model.gradient_checkpointing_enable()
            self.model.config.use_cache = False
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=settings.lr, betas=(0.9, 0.99), weight_decay=0.0)
        self.loss_cfg = LossConfig(settings.clip_low, settings.clip_high, settings.tis_cap, settings.kl_beta)
        self.ref_model = None
        if settings.kl_beta > 0:
            self.ref_model = load_model(model_dir, self.precision.scoring, self.precision.device).eval()
        self.version = 0
        self.steps = 0
        self.scorer = Scorer(
            model_dir, self.precision, keep_versions, Path(work_dir) / "versions", settings.micro_batch_tokens
        )
        self._name_version(0)

    # -- training ----------------------------------------------------------------------------------------
    def backward(self, groups: list[Group]) -> tuple[LossStats, int]:
        """Gradients of the GRPO loss on ``groups`` in ``.grad``, accumulated over micro-batches: (stats, tokens)."""
        rows = rows_of(groups)
        n_tokens = sum(len(r.completion) for r in rows)
        totals = LossStats(0.0, 0.0, 0.0, 0.0, 0.0)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        lengths = [len(r.prompt) + len(r.completion) for r in rows]
        for idx in micro_batches(lengths, self.settings.micro_batch_tokens):
            stats = self._accumulate([rows[i] for i in idx], n_tokens)
            totals = LossStats(*(a + b for a, b in zip(vars(totals).values(), vars(stats).values(), strict=True)))
        return totals, n_tokens

    def step(self, groups: list[Group]) -> dict[str, float]:
        """One GRPO optimizer step on ``groups``; returns its metrics."""
        totals, n_tokens = self.backward(groups)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.grad_clip).item()
        self.optimizer.step()
        self.model.eval()
        self.steps += 1
        rewards = [r for g in groups for r in g.rewards]
        return {
            "loss": totals.loss,
            "clip_fraction": totals.clip_fraction,
            "tis_mean": totals.tis_mean,
            "tis_capped": totals.tis_capped_fraction,
            "kl": totals.kl,
            "grad_norm": grad_norm,
            "reward": sum(rewards) / len(rewards),
            "solved": sum(s for g in groups for s in g.solved) / len(rewards),
            "staleness": sum(self.version - g.version for g in groups) / len(groups),
            "groups": len(groups),
            "tokens": n_tokens,
        }

    def _accumulate(self, rows: list[Row], n_tokens: int) -> LossStats:
        """Forward and backward one micro-batch; its loss is scaled by the whole batch's token count, so the summed
        gradients equal those of one pass over the batch."""
        prompts, comps, temps = [r.prompt for r in rows], [r.completion for r in rows], [r.temperature for r in rows]
        device = self.precision.device
        with self.precision.autocast():
            logp, mask = token_logprobs(self.model, prompts, comps, temps)
            ref = None
            if self.ref_model is not None:
                with torch.no_grad():
                    ref, _ = token_logprobs(self.ref_model, prompts, comps, temps)
        width = logp.shape[1]
        loss, stats = grpo_loss(
            logp,
            pad([r.old for r in rows], width, device),
            pad([r.mu for r in rows], width, device),
            torch.tensor([r.advantage for r in rows], device=device),
            mask,
            self.loss_cfg,
            ref,
            token_count=n_tokens,
        )
        loss.backward()
        return stats

    # -- versions ----------------------------------------------------------------------------------------
    def _name_version(self, version: int) -> None:
        self.version = version
        write_weights(self.model, self.scorer.path(version), self.precision.publish)
        self.scorer.forget_older_than(version)

    def new_version(self) -> int:
        """Name the current weights as the next version (written once, in the publish dtype)."""
        self._name_version(self.version + 1)
        return self.version

    def skip_to_version(self, version: int) -> None:
        """Call the current weights ``version`` (a restarted trainer never reuses a published number)."""
        self._name_version(version)

    def logprobs(
        self, version: int, prompts: list[list[int]], completions: list[list[int]], temperature: float
    ) -> list[list[float]] | None:
        """Per-token logprobs at ``version`` exactly, or None when that version is no longer kept."""
        return self.scorer.logprobs(version, prompts, completions, temperature)

    def score(
        self, version: int, prompts: list[list[int]], completions: list[list[int]], temperature: float, top_p: float
    ) -> list[list[TokenDraw]] | None:
        """Logprobs and seeded-draw intervals at ``version`` (what verification checks), or None if not kept."""
        return self.scorer.score(version, prompts, completions, temperature, top_p)

    def save_model_dir(self, out: Path) -> Path:
        """The current version as a model directory (for publishing): its weights file is hard-linked in."""
        return write_model_dir(self.model, self.scorer.path(self.version), out, self.model_dir, self.precision.publish)

    # -- evaluation --------------------------------------------------------------------------------------
    def evaluate(self, task: Task, n: int, max_tokens: int) -> dict[str, float]:
        with self.precision.autocast():
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
        self._name_version(state["version"])
