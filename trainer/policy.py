"""The trainer's policy: a transformers causal LM in fp32 and the per-token logprobs GRPO and verification need."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from node.checkpoint import inspect_checkpoint
from node.errors import UserError

transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()


def load_model(model_dir: Path) -> PreTrainedModel:
    inspect_checkpoint(model_dir)
    try:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    except Exception as exc:
        raise UserError(f"transformers could not load {model_dir}: {exc}") from None


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerFast:
    try:
        return PreTrainedTokenizerFast.from_pretrained(model_dir)
    except Exception as exc:
        raise UserError(f"cannot load the tokenizer in {model_dir}: {exc}") from None


def token_logprobs(
    model: PreTrainedModel,
    prompts: list[list[int]],
    completions: list[list[int]],
    temperature: float | list[float] = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of each completion token under ``model`` at ``temperature``: ([B, Lmax], mask [B, Lmax]).

    Sequences are right-padded; with a causal model, padding after a sequence never changes its logits.
    """
    seqs = [p + c for p, c in zip(prompts, completions, strict=True)]
    width = max(len(s) for s in seqs)
    cmax = max(len(c) for c in completions)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attn = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
    logits = model(input_ids=ids, attention_mask=attn).logits.float()
    temps = torch.tensor(temperature if isinstance(temperature, list) else [temperature] * len(seqs))
    out = torch.zeros(len(seqs), cmax)
    mask = torch.zeros(len(seqs), cmax)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        rows = logits[i, len(p) - 1 : len(p) - 1 + len(c)] / temps[i]
        lp = torch.log_softmax(rows, dim=-1).gather(-1, torch.tensor(c).unsqueeze(-1)).squeeze(-1)
        out[i, : len(c)] = lp
        mask[i, : len(c)] = 1
    return out, mask
