"""The policy as a transformers causal LM: loading it, saving it as a model directory, and the per-token
logprobs that GRPO and verification need."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from trainer.errors import UserError
from trainer.model_dir import TOKENIZER_FILES, flatten_rope_theta, inspect_model_dir

transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()


def load_model(model_dir: Path) -> PreTrainedModel:
    inspect_model_dir(model_dir)
    try:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    except Exception as exc:
        raise UserError(f"transformers could not load {model_dir}: {exc}") from None


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerFast:
    try:
        return PreTrainedTokenizerFast.from_pretrained(model_dir)
    except Exception as exc:
        raise UserError(f"cannot load the tokenizer in {model_dir}: {exc}") from None


def save_model_dir(model: PreTrainedModel, out: Path, tokenizer_source: Path) -> Path:
    """Write ``model`` as a model directory that stock transformers and mlx-lm open (tokenizer files copied from
    ``tokenizer_source``, rope_theta flat)."""
    out = Path(out)
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_source / name).exists() and not (out / name).exists():
            shutil.copy(tokenizer_source / name, out / name)
    flatten_rope_theta(out)
    return out


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
