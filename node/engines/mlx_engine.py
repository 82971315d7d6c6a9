"""MLX sampler engine: mlx-lm model, optional int8/int4 quantization, batched decoding with seeded draws.

Tokens are chosen by the seeded draw rule of protocols/draw.py, so the trainer can replay every choice. That
needs each row's (group seed, sample index, position) at every step, which mlx-lm's ``BatchGenerator`` hides
(it reorders and drops rows as sequences finish): so this engine runs its own decode loop on the mlx-lm model
and a ``BatchKVCache`` (left-padded prefill, finished rows filtered out of the cache). The stop token is kept
with its logprob; logprobs are log_softmax(logits / T), before top-p.
MLX streams belong to the thread that made them, so all of this engine's MLX work runs on one
dedicated thread of its own, whichever thread (event loop or trio worker) calls it.

An int8-grid (int4-grid) version (node/weights/grid.py) holds MLX's own 8-bit (4-bit) group codes, scales and
biases: an engine with weights of that width loads them as they are (the bytes that were hashed and signed; scales
widened exactly to fp32 when it computes in fp32), never re-quantizing; a patch reloads only the tensors it changed.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import BatchKVCache
from mlx_lm.utils import _get_classes, load_config, load_model

from node.engines.base import Generation, NotUpdatable
from node.engines.worker import ComputeThread
from node.errors import UserError
from node.weights.grid import GROUP, file_grid_bits, mlx_tensors
from protocols.draw import draw_uniforms
from trainer.model_dir import inspect_model_dir

QUANT_NAMES = {None: "none", 8: "q8", 4: "q4"}
MX_DTYPES = {"BF16": mx.bfloat16, "F32": mx.float32, "F16": mx.float16}
# what a sampler computes in: "auto" keeps the version's dtype (a bf16 version runs in bf16, as on Metal)
COMPUTE_DTYPES = {"fp32": mx.float32, "bf16": mx.bfloat16, "fp16": mx.float16}
COMPUTE_NAMES = {v: k for k, v in COMPUTE_DTYPES.items()}
PREFILL_STEP = 2048  # prompt tokens per forward pass while prefilling
BATCH_SIZE = 64  # sequences decoded together (a GRPO group is one batch)


class MlxEngine:
    name = "mlx"

    def __init__(
        self,
        model_dir: Path,
        bits: int | None = 8,
        group_size: int = 64,
        version: int = 0,
        batch_size: int = BATCH_SIZE,
        compute: str = "auto",
    ) -> None:
        self.batch_size = batch_size
        if bits not in QUANT_NAMES:
            raise UserError(f"unsupported quantization bits {bits!r}: use 8, 4 or none")
        if compute != "auto" and compute not in COMPUTE_DTYPES:
            raise UserError(f"unsupported compute dtype {compute!r}: use auto, {', '.join(COMPUTE_DTYPES)}")
        info = inspect_model_dir(model_dir)
        self._thread = ComputeThread("mlx-engine")
        self._thread.call(self._init, info, model_dir, bits, group_size, version, compute)

    def _init(self, info, model_dir: Path, bits: int | None, group_size: int, version: int, compute: str) -> None:
        self._stream = mx.new_stream(mx.default_device())  # one stream, owned by this engine's thread
        # draws in float64 where the device has it (CPU): closest to the trainer's float64 replay
        on_cpu = self._stream.device.type == mx.DeviceType.cpu
        self._draw_dtype, self._np_draw_dtype = (mx.float64, np.float64) if on_cpu else (mx.float32, np.float32)
        self.bits = bits
        self.group_size = group_size
        self.quant = QUANT_NAMES[bits]
        self.eos_ids = info.eos_ids
        overrides = {"rope_theta": info.rope_theta} if info.rope_theta is not None else {}
        if self._grid(Path(model_dir)):
            self._init_grid(Path(model_dir), overrides, compute)
            self.version = version
            return
        try:
            self.model, _ = load_model(Path(model_dir), model_config=overrides)
        except Exception as exc:
            raise UserError(f"mlx-lm could not load {model_dir}: {exc}") from None
        floats = [v.dtype for _, v in tree_flatten(self.model.parameters()) if mx.issubdtype(v.dtype, mx.floating)]
        self.dtype = COMPUTE_DTYPES[compute] if compute != "auto" else (floats[0] if floats else mx.float32)
        if self.dtype not in COMPUTE_NAMES:
            raise UserError(f"{model_dir}: weights of dtype {self.dtype} (use a bf16, fp16 or fp32 version)")
        self.model.set_dtype(self.dtype)
        self.compute = COMPUTE_NAMES[self.dtype]  # what the rollouts declare
        if bits is not None:
            nn.quantize(self.model, group_size=group_size, bits=bits)
        self.version = version

    def _grid(self, model_dir: Path) -> bool:
        """Whether ``model_dir`` holds a grid version (which only an engine of its width, in groups of 64, runs)."""
        path = model_dir / "model.safetensors"
        bits = file_grid_bits(path) if path.exists() else None
        if bits is None:
            return False
        if self.bits != bits or self.group_size != GROUP:
            raise UserError(
                f"{model_dir} is an int{bits}-grid version: it runs on {bits}-bit weights in groups of {GROUP}"
            )
        return True

    def _init_grid(self, model_dir: Path, overrides: dict, compute: str) -> None:
        """The model built from its config, quantized where the grid file holds codes, then the file loaded."""
        path = model_dir / "model.safetensors"
        tensors = self._layout(path)
        floats = [d for n, d in tensors.items() if d in MX_DTYPES and not n.endswith((".scales", ".biases"))]
        self.dtype = COMPUTE_DTYPES[compute] if compute != "auto" else MX_DTYPES[floats[0] if floats else "BF16"]
        if self.dtype not in (mx.bfloat16, mx.float32):
            raise UserError(f"{model_dir}: a grid version runs in bf16 or fp32, not {self.dtype}")
        self.compute = COMPUTE_NAMES[self.dtype]
        try:
            config = load_config(model_dir)
            config.update(overrides)
            model_class, args_class = _get_classes(config)
            self.model = model_class(args_class.from_dict(config))
        except Exception as exc:
            raise UserError(f"mlx-lm could not build the model of {model_dir}: {exc}") from None
        self.model.set_dtype(self.dtype)
        nn.quantize(
            self.model,
            group_size=self.group_size,
            bits=self.bits,
            class_predicate=lambda p, m: hasattr(m, "to_quantized") and f"{p}.scales" in tensors,
        )
        self._load_grid(path)

    @staticmethod
    def _layout(path: Path) -> dict[str, str]:
        from protocols.weights_file import read_layout

        return {t.name: t.dtype for t in read_layout(path)[1]}

    def _load_grid(self, path: Path, names: set[str] | None = None) -> None:
        """Load a grid file's tensors (``names`` only, if given) as they are: codes as MLX's packed weight, scales
        and biases bf16 (widened exactly if the engine computes in fp32), other floats in the compute dtype."""
        out: list[tuple[str, mx.array]] = []
        for name, dtype, values in mlx_tensors(path, names):
            a = to_mx(values, dtype)
            out.append((name, a.astype(self.dtype) if mx.issubdtype(a.dtype, mx.floating) else a))
        try:
            self.model.load_weights(out, strict=names is None)
        except ValueError as exc:
            raise UserError(f"the grid weights in {path} do not fit the running model: {exc}") from None
        mx.eval(self.model.parameters())

    def _quantized_paths(self) -> set[str]:
        return {
            name[: -len(".scales")] for name, _ in tree_flatten(self.model.parameters()) if name.endswith(".scales")
        }

    def swap(self, model_dir: Path, version: int) -> None:
        """Hot-swap: load new float weights, re-quantize them the same way, load_weights(strict=True)."""
        inspect_model_dir(model_dir)
        self._thread.call(self._swap, model_dir, version)

    def _swap(self, model_dir: Path, version: int) -> None:
        if self._grid(Path(model_dir)):
            self._load_grid(Path(model_dir) / "model.safetensors")
            self.version = version
            return
        weights: dict[str, mx.array] = {}
        for f in sorted(Path(model_dir).glob("*.safetensors")):
            weights.update(mx.load(str(f)))
        if hasattr(self.model, "sanitize"):
            weights = self.model.sanitize(weights)
        quantized = self._quantized_paths()
        out: list[tuple[str, mx.array]] = []
        for name, w in weights.items():
            w = w.astype(self.dtype) if mx.issubdtype(w.dtype, mx.floating) else w
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

    def update(self, model_dir: Path, version: int, changes) -> None:
        """In place: a quantized weight re-quantizes only the groups holding changed elements (from the version's
        weights file; quantization is per group, so this is exactly what ``swap`` computes for them); any other
        parameter gets index writes of the changed elements."""
        self._thread.call(self._update, Path(model_dir), version, changes)

    def _update(self, model_dir: Path, version: int, changes) -> None:
        from protocols.weights_file import map_tensors

        path = model_dir / "model.safetensors"
        if not path.exists():
            raise NotUpdatable("no model.safetensors")
        if self._grid(model_dir):  # the changed tensors reloaded whole: exact, and cheap next to a version
            self._load_grid(path, set(changes.indices))
            self.version = version
            return
        tensors = map_tensors(path)
        params = dict(tree_flatten(self.model.parameters()))
        quantized = self._quantized_paths()
        out: list[tuple[str, mx.array]] = []
        for name, idx in changes.indices.items():
            if name not in tensors or tensors[name][0] not in MX_DTYPES:
                raise NotUpdatable(f"{name} is not in the weights file, or of an unexpected dtype")
            dtype, arr = tensors[name]
            base = name[: -len(".weight")] if name.endswith(".weight") else None
            if base is not None and base in quantized:
                out += self._requantize(base, dtype, arr, idx, params)
            elif name in params and params[name].size == arr.size and params[name].dtype == self.dtype:
                p = params[name]
                flat = p.reshape(-1)
                flat[mx.array(idx)] = to_mx(arr.reshape(-1)[idx], dtype).astype(self.dtype)
                out.append((name, flat.reshape(p.shape)))
            else:
                raise NotUpdatable(f"{name} does not match the running model")
        self.model.load_weights(out, strict=False)
        mx.eval(self.model.parameters())
        self.version = version

    def _requantize(
        self, base: str, dtype: str, arr: np.ndarray, idx: np.ndarray, params: dict[str, mx.array]
    ) -> list[tuple[str, mx.array]]:
        gs = self.group_size
        w, scales, biases = params[f"{base}.weight"], params[f"{base}.scales"], params.get(f"{base}.biases")
        if arr.ndim != 2 or arr.shape[1] % gs or biases is None or scales.shape != (arr.shape[0], arr.shape[1] // gs):
            raise NotUpdatable(f"{base} is not quantized the way this engine quantizes")
        groups = np.unique(idx // gs)
        rows = to_mx(arr.reshape(-1, gs)[groups], dtype).astype(self.dtype)
        q, s, b = mx.quantize(rows, group_size=gs, bits=self.bits)
        if s.dtype != scales.dtype:
            raise NotUpdatable(f"{base}: the new weights quantize to {s.dtype}, the running ones are {scales.dtype}")
        at = mx.array(groups)
        w_groups = w.reshape(-1, q.shape[-1])
        w_groups[at] = q
        flat_s, flat_b = scales.reshape(-1), biases.reshape(-1)
        flat_s[at] = s.reshape(-1)
        flat_b[at] = b.reshape(-1)
        return [
            (f"{base}.weight", w_groups.reshape(w.shape)),
            (f"{base}.scales", flat_s.reshape(scales.shape)),
            (f"{base}.biases", flat_b.reshape(biases.shape)),
        ]

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
        return self._thread.call(self._generate, prompts, rows, temperature, top_p, max_tokens)

    def _generate(
        self, prompts: list[list[int]], rows: list[tuple[int, int]], temperature: float, top_p: float, max_tokens: int
    ) -> list[Generation]:
        out: list[Generation] = []
        with mx.stream(self._stream):
            for i in range(0, len(prompts), self.batch_size):
                j = i + self.batch_size
                out += self._decode(prompts[i:j], rows[i:j], temperature, top_p, max_tokens)
        return out

    def _decode(
        self, prompts: list[list[int]], rows: list[tuple[int, int]], temperature: float, top_p: float, max_tokens: int
    ) -> list[Generation]:
        """One batch: left-padded prefill of each distinct prompt once (a GRPO group shares one), its KV cache
        rows repeated for every sample, then one token per step for every unfinished row, finished rows dropped
        from the cache. Every row of a step is at the same completion position t."""
        distinct = list(dict.fromkeys(tuple(p) for p in prompts))
        where = {p: i for i, p in enumerate(distinct)}
        pads = [max(len(p) for p in distinct) - len(p) for p in distinct]
        cache = [BatchKVCache(pads) for _ in self.model.layers]
        ids = mx.array([[0] * n + list(p) for p, n in zip(distinct, pads, strict=True)])
        for k in range(0, ids.shape[1] - 1, PREFILL_STEP):
            self.model(ids[:, k : min(k + PREFILL_STEP, ids.shape[1] - 1)], cache=cache)
            mx.eval([c.state for c in cache])
        logits = self.model(ids[:, -1:], cache=cache)[:, -1, :]
        expand = mx.array([where[tuple(p)] for p in prompts])
        for c in cache:
            c.filter(expand)  # repeats each prompt's rows for its samples
        logits = logits[expand]
        seeds = np.array([s for s, _ in rows], dtype=np.uint64)
        ks = np.array([k for _, k in rows], dtype=np.uint64)
        live = list(range(len(prompts)))
        tokens: list[list[int]] = [[] for _ in prompts]
        logps: list[list[float]] = [[] for _ in prompts]
        finish = ["length"] * len(prompts)
        for t in range(max_tokens):
            u = mx.array(draw_uniforms(seeds[live], ks[live], t).astype(self._np_draw_dtype))
            tok, lp = mlx_draw(logits, u, temperature, top_p, self._draw_dtype)
            mx.eval(tok, lp)
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
                idx = mx.array(keep)
                for c in cache:
                    c.filter(idx)
                tok = tok[idx]
                live = [live[j] for j in keep]
            logits = self.model(tok[:, None], cache=cache)[:, -1, :]
        return [Generation(t, lp, f) for t, lp, f in zip(tokens, logps, finish, strict=True)]


def to_mx(values: np.ndarray, dtype: str) -> mx.array:
    """Elements read from a safetensors file (BF16 as uint16 bits) as an MLX array of that dtype, bit for bit."""
    values = np.ascontiguousarray(values)
    return mx.array(values).view(mx.bfloat16) if dtype == "BF16" else mx.array(values)


def _nucleus(p: mx.array, top_p: float) -> mx.array:
    """Kept tokens [B, V]: the smallest highest-p set with mass >= top_p; among tokens tied at the boundary
    probability the lowest ids are kept (protocols/draw.py), computed without a stable sort."""
    vocab = p.shape[-1]
    ranked = -mx.sort(-p, axis=-1)
    n = mx.minimum((mx.cumsum(ranked, axis=-1) < top_p).sum(axis=-1) + 1, vocab)
    threshold = mx.take_along_axis(ranked, (n - 1)[:, None], axis=-1)
    above = p > threshold
    tied = p == threshold
    ties_kept = (n - above.sum(axis=-1))[:, None]
    return above | (tied & (mx.cumsum(tied.astype(mx.int32), axis=-1) <= ties_kept))


def mlx_draw(
    logits: mx.array, u: mx.array, temperature: float, top_p: float, dtype: mx.Dtype = mx.float32
) -> tuple[mx.array, mx.array]:
    """The draw rule of protocols/draw.py on device: logits [B, V], u [B] -> (token ids [B], tempered logprobs
    [B]). ``dtype`` float64 where the device has it (CPU), float32 otherwise (Metal)."""
    x = logits.astype(dtype) / temperature
    logp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    p = mx.exp(logp)
    q = mx.where(_nucleus(p, top_p), p, 0.0) if top_p < 1.0 else p
    c = mx.cumsum(q, axis=-1)
    c = c / c[:, -1:]
    vocab = p.shape[-1]
    last = vocab - 1 - mx.argmax((q > 0)[:, ::-1], axis=-1)
    tokens = mx.minimum((c <= u[:, None]).sum(axis=-1), last)
    return tokens, mx.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0].astype(mx.float32)
