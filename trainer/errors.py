"""The one error type for bad user input (a model directory, a task, a flag, a peer address).

The CLI prints it as one line and exits 2, without a traceback. It lives here, in the package every other
one may import, so that trainer/ can raise it without importing node/.
"""


class UserError(Exception):
    """Bad configuration, a bad flag, an unreachable bootstrap peer: say what and exit non-zero."""
