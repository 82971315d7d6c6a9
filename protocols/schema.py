"""Small field checkers for decoded messages: every field a peer sends is typed and bounded here."""

from __future__ import annotations

import math
from typing import Any

from protocols.errors import SchemaError


def _get(msg: dict[str, Any], name: str) -> Any:
    if name not in msg:
        raise SchemaError(f"missing field {name!r}")
    return msg[name]


def integer(msg: dict[str, Any], name: str, lo: int, hi: int) -> int:
    value = _get(msg, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SchemaError(f"field {name!r} must be an integer")
    if not lo <= value <= hi:
        raise SchemaError(f"field {name!r}={value} is outside [{lo}, {hi}]")
    return value


def number(msg: dict[str, Any], name: str, lo: float, hi: float) -> float:
    value = _get(msg, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SchemaError(f"field {name!r} must be a number")
    value = float(value)
    if not math.isfinite(value) or not lo <= value <= hi:
        raise SchemaError(f"field {name!r}={value} is outside [{lo}, {hi}]")
    return value


def text(msg: dict[str, Any], name: str, max_len: int) -> str:
    value = _get(msg, name)
    if not isinstance(value, str):
        raise SchemaError(f"field {name!r} must be a string")
    if len(value) > max_len:
        raise SchemaError(f"field {name!r} is longer than {max_len} characters")
    return value


def blob(msg: dict[str, Any], name: str, max_len: int, exact: int | None = None) -> bytes:
    value = _get(msg, name)
    if not isinstance(value, bytes):
        raise SchemaError(f"field {name!r} must be bytes")
    if len(value) > max_len or (exact is not None and len(value) != exact):
        raise SchemaError(f"field {name!r} has a bad length {len(value)}")
    return value


def items(msg: dict[str, Any], name: str, max_len: int, min_len: int = 0) -> list[Any]:
    value = _get(msg, name)
    if not isinstance(value, list):
        raise SchemaError(f"field {name!r} must be a list")
    if not min_len <= len(value) <= max_len:
        raise SchemaError(f"field {name!r} must hold {min_len}..{max_len} items, got {len(value)}")
    return value


def int_list(msg: dict[str, Any], name: str, max_len: int, lo: int, hi: int, min_len: int = 0) -> list[int]:
    values = items(msg, name, max_len, min_len)
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise SchemaError(f"field {name!r} holds {v!r}, not an integer in [{lo}, {hi}]")
    return values


def float_list(msg: dict[str, Any], name: str, max_len: int, lo: float, hi: float, min_len: int = 0) -> list[float]:
    values = items(msg, name, max_len, min_len)
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
            raise SchemaError(f"field {name!r} holds {v!r}, not a finite number in [{lo}, {hi}]")
        out.append(float(v))
    return out


def mapping(msg: dict[str, Any], name: str) -> dict[str, Any]:
    value = _get(msg, name)
    if not isinstance(value, dict):
        raise SchemaError(f"field {name!r} must be a map")
    return value


def expect_type(msg: dict[str, Any], expected: str) -> None:
    if msg.get("t") != expected:
        raise SchemaError(f"expected a {expected!r} message, got {msg.get('t')!r}")
