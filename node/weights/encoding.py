"""How model.safetensors travels: ``native`` (as published, bf16 or fp32), or ``int8`` rowwise (1 byte per
parameter, dequantized to fp32 on arrival). numpy only: a sampler never needs torch for this, and numpy has no
bfloat16, so BF16 tensors are read as their bits and widened exactly (a bf16 is the top half of an fp32).

int8 rowwise: each 2-D float tensor becomes an int8 tensor plus one fp32 scale per row (absmax / 127).
The receiver turns it back into an fp32 safetensors file that stock transformers and mlx-lm open.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from protocols.weights_file import (
    DTYPE_WIDTHS,
    PT_METADATA,
    TensorEntry,
    bf16_to_f32,
    elements,
    encode_header,
    read_layout,
    read_span,
)

SCALE_SUFFIX = ".__int8_scale__"
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")


def read_float_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file; BF16 ones widened to float32 (exactly)."""
    _head, tensors = read_layout(path)
    out: dict[str, np.ndarray] = {}
    with open(path, "rb") as fh:
        for t in tensors:
            values = elements(read_span(fh, t.offset, t.nbytes), t)
            out[t.name] = bf16_to_f32(values) if t.dtype == "BF16" else values
    return out


def _as_float32(raw: np.ndarray, t: TensorEntry) -> np.ndarray:
    values = elements(raw, t)
    return bf16_to_f32(values) if t.dtype == "BF16" else values.astype(np.float32)


def encode_int8_file(src: Path, dst: Path) -> None:
    """``encode_int8`` from file to file with one tensor in memory at a time (a trainer publishes multi-GB files;
    reading one whole would cost its size again at the trainer's peak). Tensors are laid out widest dtype first, by
    name, so every one starts aligned to its width."""
    _head, tensors = read_layout(src)
    plan: list[tuple[str, str, list[int], TensorEntry, str]] = []  # (out name, dtype, shape, source, part)
    for t in tensors:
        floating = t.dtype in FLOAT_DTYPES
        if len(t.shape) == 2 and floating:
            plan += [(t.name, "I8", t.shape, t, "q"), (t.name + SCALE_SUFFIX, "F32", [t.shape[0]], t, "scale")]
        else:
            plan.append((t.name, "F32" if floating else t.dtype, t.shape, t, "float" if floating else "raw"))
    plan.sort(key=lambda p: (-DTYPE_WIDTHS[p[1]], p[0]))
    layout = encode_header([(out, dtype, shape) for out, dtype, shape, _src, _part in plan], PT_METADATA)
    with open(src, "rb") as fh, open(dst, "wb") as out_fh:
        out_fh.write(layout.head)
        for _out, _dtype, _shape, t, part in plan:
            raw = read_span(fh, t.offset, t.nbytes)
            if part == "raw":
                out_fh.write(raw.data)
                continue
            w = _as_float32(raw, t)
            if part == "float":
                out_fh.write(np.ascontiguousarray(w).tobytes())
                continue
            q, scale = quantize_rows(w)
            out_fh.write((q if part == "q" else scale).tobytes())


def quantize_rows(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int8 rowwise: (q, one fp32 scale per row = absmax / 127)."""
    scale = np.maximum(np.abs(w).max(axis=1) / np.float32(127.0), np.float32(1e-12)).astype(np.float32)
    q = np.clip(np.round(w / scale[:, None]), -127, 127).astype(np.int8)
    return np.ascontiguousarray(q), np.ascontiguousarray(scale)


def encode_int8(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for name, t in state.items():
        if t.ndim == 2 and np.issubdtype(t.dtype, np.floating):
            out[name], out[name + SCALE_SUFFIX] = quantize_rows(t.astype(np.float32))
        else:
            out[name] = np.ascontiguousarray(t.astype(np.float32) if np.issubdtype(t.dtype, np.floating) else t)
    return out


def decode_int8(encoded: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for name, t in encoded.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        scale = encoded.get(name + SCALE_SUFFIX)
        out[name] = np.ascontiguousarray(t.astype(np.float32) * scale[:, None]) if scale is not None else t
    return out
