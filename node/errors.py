"""Errors a user can act on; the CLI prints them without a traceback (defined once, in trainer/errors.py)."""

import importlib.util

from trainer.errors import UserError

__all__ = ["UserError", "require_torch"]


def require_torch(what: str, otherwise: str = "") -> None:
    """torch is the `trainer` extra (a Mac that only samples runs MLX without it): say how to get it, before
    an import deep inside fails."""
    if importlib.util.find_spec("torch") is None:
        raise UserError(f"{what} needs torch, which is not installed: pip install 'swarmrl[trainer]'{otherwise}")
