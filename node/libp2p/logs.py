"""py-libp2p's log records go through our logging, demoted to DEBUG, except the few that mean something to a user.

py-libp2p 0.8.1 configures its "libp2p" logger at import (``libp2p.utils.logging.setup_logging``): no handlers and
``propagate = False`` unless LIBP2P_DEBUG is set. A record at WARNING or above then finds no handler at all, so
Python's last-resort handler prints it to stderr, past any logging setup of ours: the 8-line "Failed to open stream
to peer ..." block for every stream a closing peer refused, "MultiselectClient handshake: write failed", ... Those
are per-stream events that our own code handles and logs where they matter (node.rpc, node.weights).

``route_library_logs`` hangs one handler on the "libp2p" logger that re-issues every record through the
``node.libp2p.library`` logger (so our handlers and levels decide), at DEBUG unless ``user_facing`` says the user
should see it at its own level. With LIBP2P_DEBUG set the library's own configuration is left alone.
"""

from __future__ import annotations

import logging
import os

LIBRARY_LOGGER = "libp2p"
FORWARD_TO = "node.libp2p.library"
# messages (their start) that say something a user can act on: this node cannot listen where it was told to
USER_FACING = (
    "Cannot listen",
    "Failed to start TCP listener",
    "PortDemultiplexer.listen failed",
    "Swarm.listen: no transport",
)


def user_facing(record: logging.LogRecord) -> bool:
    """Whether a library record keeps its level (the rest are demoted to DEBUG)."""
    return record.levelno >= logging.CRITICAL or record.getMessage().startswith(USER_FACING)


class _Forward(logging.Handler):
    """Re-issues library records through our logger, demoted unless ``user_facing``."""

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno > logging.DEBUG and not user_facing(record):
            record.levelno, record.levelname = logging.DEBUG, logging.getLevelName(logging.DEBUG)
        target = logging.getLogger(FORWARD_TO)
        if target.isEnabledFor(record.levelno):  # handle() alone skips the level check: a DEBUG record would
            target.handle(record)  # reach a root handler at NOTSET (what basicConfig makes) at any root level


def route_library_logs() -> None:
    """Install the forwarding handler on py-libp2p's logger (idempotent; a no-op when LIBP2P_DEBUG is set)."""
    if os.environ.get("LIBP2P_DEBUG"):
        return
    library = logging.getLogger(LIBRARY_LOGGER)
    if any(isinstance(h, _Forward) for h in library.handlers):
        return
    library.addHandler(_Forward())
    library.propagate = False  # as py-libp2p leaves it: records reach our handlers once, through FORWARD_TO
