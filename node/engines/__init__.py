"""Sampler engines: MLX (int8/int4/full precision) and a torch fallback with the same outputs."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from pathlib import Path

from node.engines.base import Engine, Generation, NotUpdatable
from node.errors import UserError

__all__ = [
    "Engine",
    "Generation",
    "NotUpdatable",
    "auto_engine",
    "engine_factory",
    "install",
    "make_engine",
    "received_encoding",
    "weights_encoding",
]

log = logging.getLogger(__name__)


def mlx_available() -> bool:
    try:
        import mlx.core  # noqa: F401
    except ImportError:
        return False
    return True


def auto_engine(platform: str = sys.platform) -> str:
    """The fastest engine on this platform, as measured by bench/sampler.py: MLX on a Mac (Metal, int8 pays
    there), torch elsewhere (on Linux CPU the mlx-cpu wheel's reference BLAS makes MLX ~3x slower than torch)."""
    return "mlx" if platform == "darwin" and mlx_available() else "torch"


GRID_ENCODINGS = {"8": "int8-grid", "4": "int4-grid"}  # --bits -> the grid encoding (node/weights/grid.py GRID_BITS)


def weights_encoding(engine: str, bits: str, compute: str = "auto", platform: str = sys.platform) -> str:
    """The weights encoding an engine runs best from: ``int8-grid`` (``int4-grid``; node/weights/grid.py: MLX's own
    8-bit (4-bit) group codes, loaded as they are, patched code by code) for an MLX engine with 8-bit (4-bit)
    weights computing in bf16 or fp32 (fp16 cannot hold a bf16 scale exactly); ``native`` (bf16) for every other."""
    name = auto_engine(platform) if engine == "auto" else engine
    grid = GRID_ENCODINGS.get(bits)
    return grid if grid is not None and name == "mlx" and compute in ("auto", "bf16", "fp32") else "native"


def received_encoding(engine: str, bits: str, compute: str, choice: str, platform: str = sys.platform) -> str:
    """The encoding a sampler downloads: its ``--receive-encoding`` choice, where 'auto' is ``weights_encoding``."""
    return weights_encoding(engine, bits, compute, platform) if choice == "auto" else choice


def make_engine(name: str, model_dir: Path, bits: int | None = 8, version: int = 0, compute: str = "auto") -> Engine:
    """Build an engine by name ('auto': see ``auto_engine``); ``compute`` is the dtype it computes in ('auto': MLX
    keeps the version's dtype, as Metal's fast path does; torch computes in fp32). The torch engine does not
    quantize: ``bits`` applies to MLX only."""
    if name == "auto":
        name = auto_engine()
    if name == "mlx":
        from node.engines.mlx_engine import MlxEngine

        return MlxEngine(model_dir, bits=bits, version=version, compute=compute)
    if name == "torch":
        from node.engines.torch_engine import TorchEngine

        return TorchEngine(model_dir, version=version, compute=compute)
    raise UserError(f"unknown engine {name!r}: use mlx, torch or auto")


def engine_factory(name: str, bits: str, compute: str = "auto") -> Callable[[Path, int], Engine]:
    """A sampler's engine maker from its settings: (model dir, version) -> engine.

    The engine's module is imported here, on the caller's thread, not when the maker runs (in a worker thread):
    importing mlx-lm leaves MLX thread-local state on the importing thread, whose destructor takes the GIL, and a
    worker thread that exits while the interpreter shuts down then aborts the process ("terminate called without
    an active exception", exit 134; reproduced in tests/test_engines.py)."""
    name = auto_engine() if name == "auto" else name
    if name == "mlx":
        import node.engines.mlx_engine
    elif name == "torch":
        import node.engines.torch_engine  # noqa: F401
    quant_bits = None if bits == "none" else int(bits)
    return lambda path, version: make_engine(name, path, bits=quant_bits, version=version, compute=compute)


def install(engine: Engine, model_dir: Path, version: int, changes=None) -> str:
    """Put ``version`` (the model dir ``model_dir``) into a running engine: in place, touching only the changed
    elements, when ``changes`` (node.weights.patch.WeightChanges) start from the version the engine runs and the
    engine can; else a full swap. Returns "updated" or "swapped"."""
    update = getattr(engine, "update", None)
    if changes is not None and update is not None and changes.base == engine.version:
        try:
            update(model_dir, version, changes)
            return "updated"
        except NotUpdatable as exc:
            log.info("in-place update to version %d not possible (%s): full swap", version, exc)
    engine.swap(model_dir, version)
    return "swapped"
