"""node/libp2p/logs.py: py-libp2p's per-stream errors reach our logging at DEBUG, not the console."""

from __future__ import annotations

import logging

import pytest

from node.libp2p.logs import FORWARD_TO, LIBRARY_LOGGER, route_library_logs

BLOCK = (
    "Failed to open stream to peer 12D3KooW...:\n  Error: MultiselectClient handshake: write failed\n"
    "  Protocols: ['/swarmrl/weights/1']\n  Timeout: 5s"
)


class Records(logging.Handler):
    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def library_logger(monkeypatch):
    """The "libp2p" logger as py-libp2p 0.8.1 leaves it at import (no handlers, no propagation), restored after.
    pytest attaches its capture handler to every non-propagating logger before each test: call ``bare`` first."""
    library = logging.getLogger(LIBRARY_LOGGER)
    monkeypatch.setattr(library, "handlers", list(library.handlers))
    monkeypatch.setattr(library, "propagate", False)
    level = library.level
    library.setLevel(logging.WARNING)
    monkeypatch.delenv("LIBP2P_DEBUG", raising=False)
    yield library
    library.setLevel(level)


@pytest.fixture
def console(monkeypatch):
    """A WARNING-level handler on the root logger (what a console shows), and a DEBUG one (a debug log file)."""
    root = logging.getLogger()
    warning, debug = Records(logging.WARNING), Records(logging.DEBUG)
    monkeypatch.setattr(root, "handlers", [warning, debug])
    level = root.level
    root.setLevel(logging.DEBUG)  # setLevel, not the attribute: loggers cache isEnabledFor until it is called
    yield warning, debug
    root.setLevel(level)


def bare(library: logging.Logger) -> None:
    library.handlers = []  # what a process outside pytest has (the fixture restores pytest's afterwards)


def test_stock_library_errors_go_to_stderr_past_our_logging(library_logger, console, capsys):
    bare(library_logger)
    logging.getLogger("libp2p.host.basic_host").error(BLOCK)
    assert "Failed to open stream" in capsys.readouterr().err  # Python's last-resort handler printed it
    assert console[0].records == [] and console[1].records == []  # never through our handlers


def test_library_errors_reach_our_logging_at_debug_only(library_logger, console, capsys):
    bare(library_logger)
    route_library_logs()
    route_library_logs()  # once is enough: no second handler
    assert len(library_logger.handlers) == 1
    logging.getLogger("libp2p.host.basic_host").error(BLOCK)
    logging.getLogger("libp2p.protocol_muxer.multiselect_client").error("MultiselectClient handshake: write failed")
    warning, debug = console
    assert capsys.readouterr().err == ""
    assert warning.records == []
    assert [(r.name, r.levelno) for r in debug.records] == [
        ("libp2p.host.basic_host", logging.DEBUG),
        ("libp2p.protocol_muxer.multiselect_client", logging.DEBUG),
    ]
    # with our logging at INFO (the CLI without -v), the demoted records are not even handed to the handlers
    logging.getLogger(FORWARD_TO).setLevel(logging.INFO)
    try:
        logging.getLogger("libp2p.host.basic_host").error(BLOCK)
    finally:
        logging.getLogger(FORWARD_TO).setLevel(logging.NOTSET)
    assert len(debug.records) == 2


def test_a_library_error_a_user_can_act_on_keeps_its_level(library_logger, console):
    bare(library_logger)
    route_library_logs()
    logging.getLogger("libp2p.transport.tcp.tcp").error("Failed to start TCP listener for /ip4/1.2.3.4/tcp/1: denied")
    warning, _ = console
    assert [(r.levelno, r.getMessage()[:28]) for r in warning.records] == [
        (logging.ERROR, "Failed to start TCP listener")
    ]
