"""Errors a user can act on; the CLI prints them without a traceback (defined once, in trainer/errors.py)."""

import importlib.util

from trainer.errors import UserError

__all__ = ["UserError", "describe", "require_torch"]


def require_torch(what: str, otherwise: str = "") -> None:
    """torch is the `trainer` extra (a Mac that only samples runs MLX without it): say how to get it, before
    an import deep inside fails."""
    if importlib.util.find_spec("torch") is None:
        raise UserError(f"{what} needs torch, which is not installed: pip install 'swarmrl[trainer]'{otherwise}")


def describe(exc: BaseException) -> str:
    """``Type: message`` of ``exc`` and of each exception it was raised from, outermost first: py-libp2p wraps the
    cause of a failed stream ("failed to open a stream to peer ...") in exceptions that say nothing of it."""
    parts, seen = [], set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        parts.append(f"{type(cause).__name__}: {cause}")
        cause = cause.__cause__ or cause.__context__
    return " <- ".join(parts)
