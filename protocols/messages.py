"""Generic reply messages shared by every request/response protocol."""

from __future__ import annotations

from typing import Any

from protocols import WIRE_VERSION
from protocols.errors import RemoteError


def error_reply(code: str, message: str, retry_after: float | None = None) -> dict[str, Any]:
    reply: dict[str, Any] = {"v": WIRE_VERSION, "t": "error", "code": code[:64], "message": message[:1024]}
    if retry_after is not None:
        reply["retry_after"] = float(retry_after)
    return reply


def raise_if_error(reply: dict[str, Any]) -> dict[str, Any]:
    """Turn an error reply into a RemoteError so callers only ever see good replies."""
    if reply.get("t") == "error":
        retry_after = reply.get("retry_after")
        if isinstance(retry_after, bool) or not isinstance(retry_after, (int, float)) or not 0 <= retry_after <= 3600:
            retry_after = None  # absent, or nonsense from a hostile peer: ignore it
        raise RemoteError(
            str(reply.get("code", "?"))[:64], str(reply.get("message", ""))[:1024], retry_after=retry_after
        )
    return reply
