"""Sampler engines: MLX (int8/int4/full precision) and a torch fallback with the same outputs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from node.engines.base import Engine, Generation
from node.errors import UserError

__all__ = ["Engine", "Generation", "available_engines", "make_engine"]


def available_engines() -> list[str]:
    names = []
    try:
        import mlx.core  # noqa: F401

        names.append("mlx")
    except ImportError:
        pass
    names.append("torch")
    return names


def make_engine(name: str, model_dir: Path, bits: int | None = 8, version: int = 0) -> Engine:
    """Build an engine by name ('auto' picks MLX where it imports, else torch)."""
    if name == "auto":
        name = available_engines()[0]
    if name == "mlx":
        from node.engines.mlx_engine import MlxEngine

        return MlxEngine(model_dir, bits=bits, version=version)
    if name == "torch":
        from node.engines.torch_engine import TorchEngine

        return TorchEngine(model_dir, version=version)
    raise UserError(f"unknown engine {name!r}: use mlx, torch or auto")


def engine_factory(name: str, bits: str) -> Callable[[Path, int], Engine]:
    """A sampler's engine maker from its settings: (model dir, version) -> engine."""
    quant_bits = None if bits == "none" else int(bits)
    return lambda path, version: make_engine(name, path, bits=quant_bits, version=version)
