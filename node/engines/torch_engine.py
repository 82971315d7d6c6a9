"""Torch fallback engine for machines without MLX: a manual KV-cache decode loop with seeded draws.

Tokens are chosen by the seeded draw rule of protocols/draw.py (via trainer/draws.py, the same float64 code the
trainer replays), so every choice can be checked. ``transformers.generate`` draws from torch's RNG instead,
hence the explicit loop: left-padded prefill, one token per step, finished rows dropped from the cache.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import DynamicCache

from node.engines.base import Generation, NotUpdatable
from node.errors import UserError
from protocols.draw import draw_uniforms
from trainer.draws import draw_tokens
from trainer.model import from_pretrained
from trainer.model_dir import inspect_model_dir

BATCH_SIZE = 64  # sequences decoded together (a GRPO group is one batch)
COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class TorchEngine:
    name = "torch"
    quant = "none"

    def __init__(self, model_dir: Path, version: int = 0, batch_size: int = BATCH_SIZE, compute: str = "fp32") -> None:
        """``compute``: fp32 (the default, "auto" too: exact on bf16 and fp32 versions alike) or bf16."""
        compute = "fp32" if compute == "auto" else compute
        if compute not in COMPUTE_DTYPES:
            raise UserError(f"the torch engine computes in {' or '.join(COMPUTE_DTYPES)}, not {compute!r}")
        self.compute = compute
        info = inspect_model_dir(model_dir)
        self.eos_ids = info.eos_ids
        self.batch_size = batch_size
        self.model = from_pretrained(model_dir, COMPUTE_DTYPES[compute]).eval()
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

    def update(self, model_dir: Path, version: int, changes) -> None:
        """In place: index writes of the changed elements only, each widened exactly from the version's weights file
        (what ``swap``'s load_state_dict computes for them); tied weights share storage and follow."""
        from protocols.weights_file import bf16_to_f32, map_tensors

        path = Path(model_dir) / "model.safetensors"
        if not path.exists():
            raise NotUpdatable("no model.safetensors")
        tensors = map_tensors(path)
        params = self.model.state_dict()
        writes = []
        for name, idx in changes.indices.items():
            if name not in tensors or name not in params:
                raise NotUpdatable(f"{name} is not a parameter of the running model")
            dtype, arr = tensors[name]
            p = params[name]
            if p.numel() != arr.size or not p.is_contiguous():
                raise NotUpdatable(f"{name} has another shape")
            if dtype.startswith("F8_"):  # mapped as their bits, which numpy cannot widen
                raise NotUpdatable(f"{name} is {dtype}")
            writes.append((p, idx, dtype, arr))
        with torch.no_grad():
            for p, idx, dtype, arr in writes:
                picked = arr.reshape(-1)[idx]
                values = bf16_to_f32(picked) if dtype == "BF16" else picked
                p.view(-1)[torch.from_numpy(np.ascontiguousarray(idx))] = torch.from_numpy(
                    np.ascontiguousarray(values)
                ).to(p.dtype)
        self.version = version

    def generate(
        self, prompts: list[list[int]], *, temperature: float, top_p: float, max_tokens: int, seed: int
    ) -> list[Generation]:
        rows = [(seed, k) for k in range(len(prompts))]
        return self.generate_rows(prompts, rows, temperature=temperature, top_p=top_p, max_tokens=max_tokens)

    def generate_rows(
        self,
        prompts: list[list[int]],
        rows: list[tuple[int, int]],
        *,
        temperature: float,
        top_p: float,
        max_tokens: int,
    ) -> list[Generation]:
        """Like ``generate``, each prompt drawn with its own (group seed, sample index): many groups, one call."""
        out: list[Generation] = []
        for i in range(0, len(prompts), self.batch_size):
            j = i + self.batch_size
            out += self._decode(prompts[i:j], rows[i:j], temperature, top_p, max_tokens)
        return out

    @torch.no_grad()
    def _decode(
        self, prompts: list[list[int]], rows: list[tuple[int, int]], temperature: float, top_p: float, max_tokens: int
    ) -> list[Generation]:
        """One batch: left-padded prefill of each distinct prompt once (a GRPO group shares one), its KV cache
        rows repeated for every sample, then one token per step for every unfinished row, finished rows dropped
        from the cache."""
        distinct = list(dict.fromkeys(tuple(p) for p in prompts))
        where = {p: i for i, p in enumerate(distinct)}
        width = max(len(p) for p in distinct)
        ids = torch.zeros(len(distinct), width, dtype=torch.long)
        attn = torch.zeros(len(distinct), width, dtype=torch.long)
        for i, p in enumerate(distinct):
            ids[i, width - len(p) :] = torch.tensor(p)
            attn[i, width - len(p) :] = 1
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        logits = self._forward(ids, attn, pos, cache)
        expand = torch.tensor([where[tuple(p)] for p in prompts])
        cache.batch_select_indices(expand)  # repeats each prompt's rows for its samples
        logits, attn, pos = logits[expand], attn[expand], pos[expand]
        seeds = np.array([s for s, _ in rows], dtype=np.uint64)
        ks = np.array([k for _, k in rows], dtype=np.uint64)
        live = list(range(len(prompts)))
        tokens: list[list[int]] = [[] for _ in prompts]
        logps: list[list[float]] = [[] for _ in prompts]
        finish = ["length"] * len(prompts)
        for t in range(max_tokens):
            u = torch.from_numpy(draw_uniforms(seeds[live], ks[live], t))
            tok, lp = draw_tokens(logits, u, temperature, top_p)
            keep = []
            for j, (x, y) in enumerate(zip(tok.tolist(), lp.tolist(), strict=True)):
                r = live[j]
                tokens[r].append(x)
                logps[r].append(y)
                if x in self.eos_ids:
                    finish[r] = "stop"
                else:
                    keep.append(j)
            if not keep or t == max_tokens - 1:
                break
            if len(keep) < len(live):
                idx = torch.tensor(keep)
                cache.batch_select_indices(idx)
                tok, attn, pos = tok[idx], attn[idx], pos[idx]
                live = [live[j] for j in keep]
            attn = torch.cat([attn, torch.ones(len(live), 1, dtype=torch.long)], dim=1)
            pos = pos[:, -1:] + 1
            logits = self._forward(tok[:, None], attn, pos, cache)
        return [Generation(t, lp, f) for t, lp, f in zip(tokens, logps, finish, strict=True)]

    def _forward(self, ids: torch.Tensor, attn: torch.Tensor, pos: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, cache=cache, use_cache=True)
        return out.logits[:, -1, :].float()
