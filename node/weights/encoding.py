"""How model.safetensors travels: as trained (fp32), or int8 rowwise (1 byte per parameter, dequantized on
arrival). numpy only: a sampler never needs torch for this.

int8 rowwise: each 2-D float tensor becomes an int8 tensor plus one fp32 scale per row (absmax / 127).
The receiver turns it back into an fp32 safetensors file that stock transformers and mlx-lm open.
"""

from __future__ import annotations

import numpy as np

SCALE_SUFFIX = ".__int8_scale__"


def encode_int8(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for name, t in state.items():
        if t.ndim == 2 and np.issubdtype(t.dtype, np.floating):
            w = t.astype(np.float32)
            scale = np.maximum(np.abs(w).max(axis=1) / np.float32(127.0), np.float32(1e-12)).astype(np.float32)
            q = np.clip(np.round(w / scale[:, None]), -127, 127).astype(np.int8)
            out[name] = np.ascontiguousarray(q)
            out[name + SCALE_SUFFIX] = np.ascontiguousarray(scale)
        else:
            out[name] = np.ascontiguousarray(t)
    return out


def decode_int8(encoded: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for name, t in encoded.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        scale = encoded.get(name + SCALE_SUFFIX)
        out[name] = np.ascontiguousarray(t.astype(np.float32) * scale[:, None]) if scale is not None else t
    return out
