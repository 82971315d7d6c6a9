"""How model.safetensors travels: ``native`` (as published, bf16 or fp32), or ``int8`` rowwise (1 byte per
parameter, dequantized to fp32 on arrival). numpy only: a sampler never needs torch for this, and numpy has no
bfloat16, so BF16 tensors are read as their bits and widened exactly (a bf16 is the top half of an fp32).

int8 rowwise: each 2-D float tensor becomes an int8 tensor plus one fp32 scale per row (absmax / 127).
The receiver turns it back into an fp32 safetensors file that stock transformers and mlx-lm open.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from node.weights.patch import read_layout, read_span
from protocols.weights import TensorEntry

SCALE_SUFFIX = ".__int8_scale__"
NUMPY_DTYPES = {
    "F32": np.float32,
    "F16": np.float16,
    "F64": np.float64,
    "I8": np.int8,
    "I32": np.int32,
    "I64": np.int64,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def read_float_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file; BF16 ones widened to float32 (exactly)."""
    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    start = 8 + n
    out: dict[str, np.ndarray] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        a, b = meta["data_offsets"]
        raw = data[start + a : start + b]
        if meta["dtype"] == "BF16":
            out[name] = bf16_to_f32(np.frombuffer(raw, dtype="<u2")).reshape(meta["shape"])
        else:
            out[name] = np.frombuffer(raw, dtype=NUMPY_DTYPES[meta["dtype"]]).reshape(meta["shape"])
    return out


FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
SAFETENSORS_WIDTH = {"F32": 4, "I8": 1, "I32": 4, "I64": 8, "U8": 1, "BOOL": 1, "F64": 8, "F16": 2, "BF16": 2}


def _as_float32(raw: np.ndarray, t: TensorEntry) -> np.ndarray:
    if t.dtype == "BF16":
        return bf16_to_f32(raw.view("<u2")).reshape(t.shape)
    return raw.view(NUMPY_DTYPES[t.dtype]).astype(np.float32).reshape(t.shape)


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
    plan.sort(key=lambda p: (-SAFETENSORS_WIDTH[p[1]], p[0]))
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for out, dtype, shape, _src, _part in plan:
        size = int(np.prod(shape, dtype=np.int64)) * SAFETENSORS_WIDTH[dtype]
        header[out] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(src, "rb") as fh, open(dst, "wb") as out_fh:
        out_fh.write(struct.pack("<Q", len(head)) + head)
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


def map_tensors(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    """Every tensor of a safetensors file as (safetensors dtype, read-only memory-mapped numpy view), without
    reading the file: BF16 tensors as their uint16 bits. For engines that need a few elements of a new version."""
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    out: dict[str, tuple[str, np.ndarray]] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        a, b = meta["data_offsets"]
        dtype = np.dtype("<u2") if meta["dtype"] == "BF16" else np.dtype(NUMPY_DTYPES[meta["dtype"]])
        out[name] = (meta["dtype"], mm[8 + n + a : 8 + n + b].view(dtype).reshape(meta["shape"]))
    return out


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16) widened exactly to float32."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


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
