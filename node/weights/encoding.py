"""How model.safetensors travels: as trained (fp32), or int8 rowwise (1 byte per parameter, dequantized on arrival).

int8 rowwise: each 2-D float tensor becomes an int8 tensor plus one fp32 scale per row (absmax / 127).
The receiver turns it back into an fp32 safetensors file that stock transformers and mlx-lm open.
"""

from __future__ import annotations

import torch

SCALE_SUFFIX = ".__int8_scale__"


def encode_int8(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if t.dim() == 2 and t.is_floating_point():
            w = t.float()
            scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
            out[name] = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
            out[name + SCALE_SUFFIX] = scale.contiguous()
        else:
            out[name] = t.contiguous()
    return out


def decode_int8(encoded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, t in encoded.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        scale = encoded.get(name + SCALE_SUFFIX)
        out[name] = (t.float() * scale[:, None]).contiguous() if scale is not None else t
    return out
