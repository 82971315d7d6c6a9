"""Errors a user can act on; the CLI prints them without a traceback (defined once, in trainer/errors.py)."""

from trainer.errors import UserError

__all__ = ["UserError"]
