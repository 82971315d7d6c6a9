"""Torch fallback engine for machines without MLX: transformers generate, same outputs as the MLX engine."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from node.engines.base import Generation
from node.errors import UserError
from trainer.model_dir import inspect_model_dir


class TorchEngine:
    name = "torch"
    quant = "torch"

    def __init__(self, model_dir: Path, version: int = 0) -> None:
        info = inspect_model_dir(model_dir)
        self.eos_ids = info.eos_ids
        self.pad_id = info.config.get("pad_token_id") or 0
        try:
            self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        except Exception as exc:
            raise UserError(f"transformers could not load {model_dir}: {exc}") from None
        self.version = version

    def swap(self, model_dir: Path, version: int) -> None:
        from safetensors.torch import load_file

        inspect_model_dir(model_dir)
        state: dict[str, torch.Tensor] = {}
        for f in sorted(Path(model_dir).glob("*.safetensors")):
            state.update(load_file(str(f)))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        missing = [m for m in missing if not (m == "lm_head.weight" and self.model.config.tie_word_embeddings)]
        if missing or unexpected:
            raise UserError(f"weights in {model_dir} do not fit: missing {missing[:3]}, unexpected {unexpected[:3]}")
        if self.model.config.tie_word_embeddings:
            self.model.tie_weights()
        self.version = version

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], *, temperature: float, top_p: float, max_tokens: int, seed: int
    ) -> list[Generation]:
        torch.manual_seed(seed)
        out = []
        # Group identical prompts (a GRPO group) into one batch: no padding needed.
        by_prompt: dict[tuple[int, ...], list[int]] = {}
        for i, p in enumerate(prompts):
            by_prompt.setdefault(tuple(p), []).append(i)
        results: dict[int, Generation] = {}
        for prompt, rows in by_prompt.items():
            ids = torch.tensor([list(prompt)] * len(rows))
            res = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=temperature,
                top_p=top_p,
                top_k=0,
                max_new_tokens=max_tokens,
                eos_token_id=list(self.eos_ids),
                pad_token_id=self.pad_id,
                output_logits=True,
                return_dict_in_generate=True,
            )
            new = res.sequences[:, ids.shape[1] :]
            logits = torch.stack(res.logits, dim=1).float() / temperature
            lps = torch.log_softmax(logits, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
            for j, row in enumerate(rows):
                toks = new[j].tolist()
                end = next((k for k, t in enumerate(toks) if t in self.eos_ids), None)
                n = len(toks) if end is None else end + 1
                reason = "stop" if end is not None else "length"
                results[row] = Generation(toks[:n], lps[j, :n].tolist(), reason)
        out = [results[i] for i in range(len(prompts))]
        return out
