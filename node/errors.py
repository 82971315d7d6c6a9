"""Errors a user can act on; the CLI prints them without a traceback."""


class UserError(Exception):
    """Bad configuration, a bad flag, an unreachable bootstrap peer: say what and exit non-zero."""
