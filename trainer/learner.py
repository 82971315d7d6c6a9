"""The Learner: the policy model, its optimizer, an optional reference model, the version and the step count.

Everything here blocks (torch compute): a trio caller runs it with ``trio.to_thread.run_sync``. One GRPO step:

    batch of verified groups
      -> group-relative advantages per group
      -> micro-batches of rows under a token budget; for each: per-token logprobs under the current weights
         (autocast to the compute dtype), the GRPO loss with truncated importance sampling (trainer/grpo.py)
         normalised by the token count of the WHOLE batch, backward (gradients accumulate)
      -> clip, AdamW step on fp32 master weights

Versions: ``new_version()`` names the current weights as the next version and writes them once, in the publish
dtype, where the scorer (verification) and publishing both take them from. It comes in two halves so that writing
never holds up training: ``name_version()`` (instant) and ``write_version()`` (any thread, while the next step's
forward and backward run); the next optimizer step waits until the file is written, so the bits written are
exactly the bits named, without a second copy of the weights in memory.

Memory per parameter (fp32 master weights): weights 4 + gradients 4 + AdamW 8 + the scoring model in the publish
dtype (2 for bf16, 4 for fp32) = 18-20 bytes, plus activations (bounded by the micro-batch token budget). Nothing
else is model-sized: AdamW is fused (no temporaries), version files are written and read a tensor at a time.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from protocols.draw import TokenDraw
from trainer.activations import ActivationMeter
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


def adamw(params: list[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """AdamW, fused where torch has a kernel for the device (cpu, cuda): faster, and no model-sized temporaries at
    the step (the default multi-tensor path allocates one: 4 more bytes per parameter at the trainer's peak)."""
    try:
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.99), weight_decay=0.0, fused=True)
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.99), weight_decay=0.0, foreach=False)


class Learner:
    def __init__(self, model_dir: Path, settings: LearnerSettings, keep_versions: int, work_dir: Path) -> None:
        torch.manual_seed(settings.seed)
        torch.set_num_threads(settings.torch_threads)
        self.model_dir = Path(model_dir)
        self.settings = settings
        self.precision: Precision = resolve(settings.device, settings.dtype, settings.publish_dtype)
        info = inspect_model_dir(model_dir)
        self.codec = TextCodec(load_tokenizer(model_dir), info.eos_ids, settings.chat_template)
        # policy: what forward passes run (the model itself here; a sharded learner's wraps it, trainer/sharded.py)
        self.model, self.policy = self._load_policy(model_dir)
        self.optimizer = adamw(list(self.model.parameters()), settings.lr)
        self.activations = ActivationMeter(list(self.model.parameters()))
        self.activation_bytes = 0  # the largest micro-batch's activations in the last step
        self.time_forward = self.time_backward = 0.0  # the last step's, summed over its micro-batches (seconds)
        self.forward_tokens = 0  # prompt and completion tokens the last step's forward passes took (unpadded)
        self.loss_cfg = LossConfig(settings.clip_low, settings.clip_high, settings.tis_cap, settings.kl_beta)
        self.ref_model = self._load_reference(model_dir) if settings.kl_beta > 0 else None
        self.version = 0
        self.steps = 0
        self._written = threading.Event()  # the named version's file is on disk (the weights may change again)
        self._written.set()
        self.scorer = self._make_scorer(model_dir, keep_versions, Path(work_dir) / "versions")
        self._name_version(0)

    # -- what a sharded learner (trainer/sharded.py) does its own way ------------------------------------
    def _load_policy(self, model_dir: Path) -> tuple[PreTrainedModel, torch.nn.Module]:
        """The fp32 model, and what its forward passes run (here the same)."""
        model = load_model(model_dir, torch.float32, self.precision.device).eval()
        if self.settings.activation_checkpointing:
            model.activation_checkpointing_enable()
            model.config.use_cache = False
        return model, model

    def _load_reference(self, model_dir: Path) -> torch.nn.Module:
        return load_model(model_dir, self.precision.scoring, self.precision.device).eval()

    def _make_scorer(self, model_dir: Path, keep: int, root: Path) -> Scorer:
        return Scorer(model_dir, self.precision, keep, root, self.settings.micro_batch_tokens)

    def _clip_gradients(self) -> float:
        """Clip the gradients' global norm to ``grad_clip``; the norm before clipping."""
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.grad_clip).item()

    # -- training ----------------------------------------------------------------------------------------
    def backward(self, groups: list[Group]) -> tuple[LossStats, int]:
        """Gradients of the GRPO loss on ``groups`` in ``.grad``, accumulated over micro-batches: (stats, tokens)."""
        rows = rows_of(groups)
        n_tokens = sum(len(r.completion) for r in rows)
        totals = [0.0] * len(fields(LossStats))
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        self.activation_bytes = 0
        self.time_forward = self.time_backward = 0.0
        lengths = [len(r.prompt) + len(r.completion) for r in rows]
        self.forward_tokens = sum(lengths)
        for idx in self._micro_batches(lengths):
            if not idx:
                self._idle_pass()
                continue
            stats = self._accumulate([rows[i] for i in idx], n_tokens)
            totals = [a + b for a, b in zip(totals, vars(stats).values(), strict=True)]
        return self._batch_stats(totals), n_tokens

    def _micro_batches(self, lengths: list[int]) -> list[list[int]]:
        """The micro-batches (row indices) this learner runs (a sharded one: this rank's share, maybe empty)."""
        return micro_batches(lengths, self.settings.micro_batch_tokens)

    def _idle_pass(self) -> None:
        """An empty micro-batch (a sharded rank with no rows still joins its peers' collectives; never here)."""

    def _batch_stats(self, totals: list[float]) -> LossStats:
        """The whole batch's loss stats from this learner's sums (a sharded one adds the other ranks')."""
        return LossStats(*totals)

    def step(self, groups: list[Group]) -> dict[str, float]:
        """One GRPO optimizer step on ``groups``; returns its metrics."""
        totals, n_tokens = self.backward(groups)
        grad_norm = self._clip_gradients()
        t0 = time.perf_counter()
        self._written.wait()  # a version being written still reads these weights
        waited = time.perf_counter() - t0
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
            "time_version_wait": waited,
            "activation_mb": round(self.activation_bytes / (1 << 20), 1),
            "time_forward": self.time_forward,
            "time_backward": self.time_backward,
            "forward_tokens": self.forward_tokens,
            **self._device_memory(),
        }

    def _device_memory(self) -> dict[str, float]:
        """On CUDA, the peak of memory allocated on this rank's GPU so far (MB): what bench/gpu.sh reports."""
        if self.precision.device.type != "cuda":
            return {}
        return {"device_peak_mb": round(torch.cuda.max_memory_allocated(self.precision.device) / (1 << 20), 1)}

    def _accumulate(self, rows: list[Row], n_tokens: int) -> LossStats:
        """Forward and backward one micro-batch; its loss is scaled by the whole batch's token count, so the summed
        gradients equal those of one pass over the batch."""
        prompts, comps, temps = [r.prompt for r in rows], [r.completion for r in rows], [r.temperature for r in rows]
        device = self.precision.device
        t0 = time.perf_counter()
        with self.precision.autocast(), self.activations:
            logp, mask = token_logprobs(self.policy, prompts, comps, temps)
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
        self.activation_bytes = max(self.activation_bytes, self.activations.bytes)
        self.precision.synchronize()
        t1 = time.perf_counter()
        loss.backward()
        self.precision.synchronize()
        self.time_forward += t1 - t0
        self.time_backward += time.perf_counter() - t1
        return stats

    # -- versions ----------------------------------------------------------------------------------------
    def _name_version(self, version: int) -> None:
        self.name_version(version)
        self.write_version(version)

    def name_version(self, version: int | None = None) -> int:
        """Name the current weights as version ``version`` (the next one by default); ``write_version`` must follow
        (from any thread). Until it is done, the next optimizer step waits."""
        self._written.wait()
        self.version = self.version + 1 if version is None else version
        self._written.clear()
        return self.version

    def write_version(self, version: int) -> Path:
        """Write the named version's weights file, in the publish dtype, where scoring and publishing read it."""
        try:
            if version != self.version:
                raise ValueError(f"version {version} is not the one named last ({self.version})")
            path = self.scorer.path(version)
            write_weights(self.model, path, self.precision.publish)
            self.scorer.forget_older_than(version)
            return path
        finally:
            self._written.set()

    def new_version(self) -> int:
        """Name the current weights as the next version and write them (both halves at once)."""
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

    def save_model_dir(self, out: Path, version: int | None = None) -> Path:
        """A written version (the current one by default) as a model directory, for publishing: its weights file is
        hard-linked in."""
        version = self.version if version is None else version
        return write_model_dir(self.model, self.scorer.path(version), out, self.model_dir, self.precision.publish)

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

    def restore(self, state: dict[str, Any], path: Path | None = None) -> None:
        """Resume from ``state`` (read from ``path``): this learner's own checkpoint, or one that N ranks wrote
        (its model and optimizer in a DCP directory, trainer/sharded_state.py)."""
        if "dcp" in state:
            from trainer.sharded_state import load_unsharded

            load_unsharded(self.model, self.optimizer, Path(state["dcp"]))
        else:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        self.steps = state["step"]
        self._name_version(state["version"])
