"""MLX sampler engine: mlx-lm model, optional int8/int4 quantization, continuous batching via BatchGenerator.

``BatchGenerator`` is used directly because ``batch_generate`` drops the stop token and its logprob.
mlx-lm reports logprobs before temperature; they are re-tempered here per sampled token.
MLX streams belong to the thread that made them, so all of this engine's MLX work runs on one
dedicated thread of its own, whichever thread (event loop or trio worker) calls it.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load_model

from node.engines.base import Generation
from node.engines.worker import ComputeThread
from node.errors import UserError
from trainer.model_dir import inspect_model_dir

QUANT_NAMES = {None: "none", 8: "q8", 4: "q4"}


class MlxEngine:
    name = "mlx"

    def __init__(self, model_dir: Path, bits: int | None = 8, group_size: int = 64, version: int = 0) -> None:
        if bits not in QUANT_NAMES:
            raise UserError(f"unsupported quantization bits {bits!r}: use 8, 4 or none")
        info = inspect_model_dir(model_dir)
        self._thread = ComputeThread("mlx-engine")
        self._thread.call(self._init, info, model_dir, bits, group_size, version)

    def _init(self, info, model_dir: Path, bits: int | None, group_size: int, version: int) -> None:
        self._stream = mx.new_stream(mx.default_device())  # one stream, owned by this engine's thread
        self.bits = bits
        self.group_size = group_size
        self.quant = QUANT_NAMES[bits]
        self.eos_ids = info.eos_ids
        overrides = {"rope_theta": info.rope_theta} if info.rope_theta is not None else {}
        try:
            self.model, _ = load_model(Path(model_dir), model_config=overrides)
        except Exception as exc:
            raise UserError(f"mlx-lm could not load {model_dir}: {exc}") from None
        if bits is not None:
            nn.quantize(self.model, group_size=group_size, bits=bits)
        self.version = version

    def _quantized_paths(self) -> set[str]:
        return {
            name[: -len(".scales")] for name, _ in tree_flatten(self.model.parameters()) if name.endswith(".scales")
        }

    def swap(self, model_dir: Path, version: int) -> None:
        """Hot-swap: load new float weights, re-quantize them the same way, load_weights(strict=True)."""
        inspect_model_dir(model_dir)
        self._thread.call(self._swap, model_dir, version)

    def _swap(self, model_dir: Path, version: int) -> None:
        weights: dict[str, mx.array] = {}
        for f in sorted(Path(model_dir).glob("*.safetensors")):
            weights.update(mx.load(str(f)))
        if hasattr(self.model, "sanitize"):
            weights = self.model.sanitize(weights)
        quantized = self._quantized_paths()
        out: list[tuple[str, mx.array]] = []
        for name, w in weights.items():
            base = name[: -len(".weight")] if name.endswith(".weight") else None
            if base is not None and base in quantized:
                q, scales, biases = mx.quantize(w, group_size=self.group_size, bits=self.bits)
                out += [(name, q), (f"{base}.scales", scales), (f"{base}.biases", biases)]
            else:
                out.append((name, w))
        try:
            self.model.load_weights(out, strict=True)
        except ValueError as exc:
            raise UserError(f"weights in {model_dir} do not fit the running model: {exc}") from None
        mx.eval(self.model.parameters())
        self.version = version

    def generate(
        self, prompts: list[list[int]], *, temperature: float, top_p: float, max_tokens: int, seed: int
    ) -> list[Generation]:
        return self._thread.call(self._generate, prompts, temperature, top_p, max_tokens, seed)

    def _generate(
        self, prompts: list[list[int]], temperature: float, top_p: float, max_tokens: int, seed: int
    ) -> list[Generation]:
        mx.random.seed(seed % (1 << 32))
        gen = BatchGenerator(
            self.model,
            max_tokens=max_tokens,
            stop_tokens=[[t] for t in self.eos_ids],
            stream=self._stream,
            sampler=make_sampler(temp=temperature, top_p=top_p if top_p < 1.0 else 0.0),
        )
        try:
            uids = gen.insert(prompts, [max_tokens] * len(prompts))
            tokens: dict[int, list[int]] = {u: [] for u in uids}
            logps: dict[int, list[mx.array]] = {u: [] for u in uids}
            finish: dict[int, str] = {}
            while responses := gen.next_generated():
                for r in responses:
                    tokens[r.uid].append(r.token)
                    lp = r.logprobs
                    if temperature != 1.0:
                        scaled = lp / temperature
                        lp = scaled - mx.logsumexp(scaled)
                    logps[r.uid].append(lp[r.token])
                    if r.finish_reason is not None:
                        finish[r.uid] = r.finish_reason
        finally:
            gen.close()
        flat = [x for u in uids for x in logps[u]]
        values = mx.stack(flat).astype(mx.float32).tolist() if flat else []
        out, i = [], 0
        for u in uids:
            n = len(tokens[u])
            out.append(Generation(tokens[u], values[i : i + n], finish.get(u, "length")))
            i += n
        return out
