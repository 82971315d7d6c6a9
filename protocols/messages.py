"""Generic reply messages shared by every request/response protocol."""

from __future__ import annotations

from typing import Any

from protocols import WIRE_VERSION
from protocols.errors import RemoteError


def error_reply(code: str, message: str) -> dict[str, Any]:
    return {"v": WIRE_VERSION, "t": "error", "code": code[:64], "message": message[:1024]}


def raise_if_error(reply: dict[str, Any]) -> dict[str, Any]:
    """Turn an error reply into a RemoteError so callers only ever see good replies."""
    if reply.get("t") == "error":
        raise RemoteError(str(reply.get("code", "?"))[:64], str(reply.get("message", ""))[:1024])
    return reply
