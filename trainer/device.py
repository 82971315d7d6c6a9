"""Where the learner runs and in what precision.

``--device auto`` takes CUDA, then Apple's MPS, then the CPU. ``--dtype bf16`` is the standard mixed precision:
master weights and AdamW state stay fp32 (so small updates are not lost to bf16 rounding), forward and backward
run under bf16 autocast, and versions are published as bf16 (what samplers load and quantize). ``fp32`` does
everything in fp32 and publishes fp32. The default is bf16 on CUDA and fp32 elsewhere (CPU bf16 matmuls are
slow on most CPUs, and MPS autocast is incomplete).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from trainer.errors import UserError
from trainer.settings import DEVICES, DTYPES


@dataclass(frozen=True)
class Precision:
    device: torch.device
    compute: torch.dtype  # autocast dtype for forward/backward (fp32: no autocast)
    publish: torch.dtype  # what versions are published (and scored) in

    @property
    def name(self) -> str:
        return "bf16" if self.compute == torch.bfloat16 else "fp32"

    @property
    def scoring(self) -> torch.dtype:
        """The scoring model's dtype: the publish dtype, but fp32 when computing in fp32 (bf16 versions of an fp32
        learner are then scored in fp32 arithmetic on their exact bits, as the torch sampler engine runs them)."""
        return torch.float32 if self.compute == torch.float32 else self.publish

    def synchronize(self) -> None:
        """Wait for the device's queued work (a timer read after this counts it); nothing to wait for on CPU."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elif self.device.type == "mps":
            torch.mps.synchronize()

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.compute == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute)


def cuda_available() -> bool:
    return torch.cuda.is_available()


def mps_available() -> bool:
    return bool(getattr(torch.backends, "mps", None)) and torch.backends.mps.is_available()


def resolve(device: str = "auto", dtype: str = "auto", publish: str = "auto") -> Precision:
    if device not in DEVICES:
        raise UserError(f"unknown device {device!r}: use one of {', '.join(DEVICES)}")
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    if device == "auto":
        device = "cuda" if cuda_available() else "mps" if mps_available() else "cpu"
    elif device == "cuda" and not cuda_available():
        raise UserError("--device cuda: torch sees no CUDA device here (is this torch build a CUDA one?)")
    elif device == "mps" and not mps_available():
        raise UserError("--device mps: torch sees no MPS device here")
    if dtype == "auto":
        dtype = "bf16" if device == "cuda" else "fp32"
    compute = torch.bfloat16 if dtype == "bf16" else torch.float32
    if publish not in DTYPES:
        raise UserError(f"unknown publish dtype {publish!r}: use one of {', '.join(DTYPES)}")
    published = compute if publish == "auto" else torch.bfloat16 if publish == "bf16" else torch.float32
    return Precision(torch.device(device), compute, published)
