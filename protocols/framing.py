"""Length-prefixed msgpack frames over a libp2p stream, with a hard size cap on every read.

py-libp2p's ``read()`` returns at most ~64 KiB and raises StreamEOF at the end, and its ``read_exactly``
gives up on large reads, so frames are assembled here with our own loop. The length header is checked
against the cap *before* any body byte is buffered, so an oversized frame costs nothing.

Decoding is bounded too: besides the byte cap, a message may hold at most ``max_containers`` maps and arrays in
all. Without that, a valid 8 MB body of 8 million empty maps decodes into ~550 MB of Python objects (a "decode
bomb"); each message type passes the count its largest honest instance needs.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, Protocol

import msgpack

from protocols import WIRE_VERSION
from protocols.errors import FrameTooLarge, MalformedMessage, PeerClosed, UnsupportedVersion

HEADER = struct.Struct(">I")
READ_CHUNK = 1 << 16
MAX_CONTAINERS = 1024  # maps + arrays in one message, unless its type says otherwise


class ByteStream(Protocol):
    async def read(self, n: int | None = None) -> bytes: ...
    async def write(self, data: bytes) -> None: ...


def pack(message: dict[str, Any]) -> bytes:
    """Encode one message (a dict that already carries ``v`` and ``t``) to msgpack bytes."""
    return msgpack.packb(message, use_bin_type=True)


class _TooManyContainers(Exception):
    pass


def unpack(body: bytes | bytearray, max_size: int, max_containers: int = MAX_CONTAINERS) -> dict[str, Any]:
    """Decode msgpack bytes into a message dict, refusing anything that is not a versioned map, and any body with
    more than ``max_containers`` maps and arrays (counted as they are built, so a bomb stops early)."""
    built = 0

    def count(obj: Any) -> Any:
        nonlocal built
        built += 1
        if built > max_containers:
            raise _TooManyContainers
        return obj

    try:
        obj = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            max_bin_len=max_size,
            max_str_len=max_size,
            max_array_len=max_size,
            max_map_len=max_size,
            max_ext_len=0,
            object_hook=count,
            list_hook=count,
        )
    except _TooManyContainers:
        raise MalformedMessage(f"message holds more than {max_containers} maps and arrays") from None
    except Exception as exc:  # msgpack raises many unrelated types for bad input
        raise MalformedMessage(f"undecodable msgpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(obj, dict):
        raise MalformedMessage(f"message must be a map, got {type(obj).__name__}")
    version = obj.get("v")
    if version != WIRE_VERSION:
        raise UnsupportedVersion(f"wire version {version!r} is not supported (this node speaks {WIRE_VERSION})")
    if not isinstance(obj.get("t"), str):
        raise MalformedMessage("message has no type field 't'")
    return obj


def frame(message: dict[str, Any], max_size: int) -> bytes:
    """Encode a message as header + body; refuse to send what the receiver would refuse."""
    body = pack(message)
    if len(body) > max_size:
        raise FrameTooLarge(f"frame of {len(body)} B exceeds the {max_size} B limit")
    return HEADER.pack(len(body)) + body


async def write_message(stream: ByteStream, message: dict[str, Any], max_size: int) -> None:
    await stream.write(frame(message, max_size))


class FrameReader:
    """Reads whole frames from one stream, keeping any bytes that belong to the next frame."""

    def __init__(self, stream: ByteStream) -> None:
        self._stream = stream
        self._buf = bytearray()

    async def _fill(self, n: int) -> None:
        from libp2p.network.stream.exceptions import StreamError

        while len(self._buf) < n:
            try:
                data = await self._stream.read(min(READ_CHUNK, n - len(self._buf)))
            except StreamError as exc:
                raise PeerClosed(f"stream ended after {len(self._buf)} of {n} bytes ({type(exc).__name__})") from None
            if not data:
                raise PeerClosed(f"stream ended after {len(self._buf)} of {n} bytes")
            self._buf += data

    def _take(self, n: int) -> bytes:
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    async def read_length(self, max_size: int) -> int:
        """The next frame's announced length, refusing one over ``max_size`` before any body byte is read."""
        await self._fill(HEADER.size)
        (length,) = HEADER.unpack(self._take(HEADER.size))
        if length > max_size:
            raise FrameTooLarge(f"peer announced a {length} B frame; the limit is {max_size} B")
        return length

    async def read_exactly(self, length: int, meter: Callable[[int], None] | None = None) -> bytes | bytearray:
        """``length`` bytes. Unmetered (a reply we asked for), a large body is read straight into one buffer of
        its size (one copy, not three). Metered (a request: an announced length is only a claim), the body grows
        as bytes arrive, and ``meter(n)`` is told of each ``n`` bytes read before they are kept: it raises to
        refuse them. A header alone holds nothing."""
        if meter is not None:
            return await self._read_metered(length, meter)
        if self._buf or length < READ_CHUNK:
            await self._fill(length)
            return self._take(length)
        from libp2p.network.stream.exceptions import StreamError

        out = bytearray(length)
        view = memoryview(out)
        pos = 0
        while pos < length:
            try:
                data = await self._stream.read(min(READ_CHUNK, length - pos))
            except StreamError as exc:
                raise PeerClosed(f"stream ended after {pos} of {length} bytes ({type(exc).__name__})") from None
            if not data:
                raise PeerClosed(f"stream ended after {pos} of {length} bytes")
            view[pos : pos + len(data)] = data
            pos += len(data)
        return out

    async def _read_metered(self, length: int, meter: Callable[[int], None]) -> bytearray:
        from libp2p.network.stream.exceptions import StreamError

        kept = min(len(self._buf), length)
        meter(kept)
        out = bytearray(self._take(kept))
        while len(out) < length:
            try:
                data = await self._stream.read(min(READ_CHUNK, length - len(out)))
            except StreamError as exc:
                raise PeerClosed(f"stream ended after {len(out)} of {length} bytes ({type(exc).__name__})") from None
            if not data:
                raise PeerClosed(f"stream ended after {len(out)} of {length} bytes")
            meter(len(data))  # may refuse them: they are dropped, and the frame with them
            out += data
        return out

    async def read_body(self, max_size: int) -> bytes | bytearray:
        """Return the next frame's raw body, refusing one whose header announces more than ``max_size``."""
        return await self.read_exactly(await self.read_length(max_size))

    async def read_message(self, max_size: int, max_containers: int = MAX_CONTAINERS) -> dict[str, Any]:
        return unpack(await self.read_body(max_size), max_size, max_containers)
