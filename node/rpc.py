"""One-shot request/response over a fresh libp2p stream, and a handler wrapper that never lets a peer crash us.

py-libp2p takes the whole host down when a stream handler raises, so ``serve`` catches everything:
protocol errors get an error reply, anything else is logged and the stream is reset.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from libp2p.abc import IHost, INetStream
from libp2p.peer.id import ID

from protocols.errors import PeerClosed, ProtocolError
from protocols.framing import FrameReader, write_message
from protocols.messages import error_reply, raise_if_error

log = logging.getLogger(__name__)

# refusals that are part of normal operation (backpressure; asking for a version this peer does not hold)
QUIET_CODES = frozenset({"rate_limited", "not_found"})

Handler = Callable[[dict[str, Any], ID], Awaitable[dict[str, Any]]]


def serve(name: str, handler: Handler, max_request: int, max_reply: int, timeout: float = 30.0):
    """Wrap ``handler(message, remote_peer) -> reply`` as a py-libp2p stream handler."""

    async def on_stream(stream: INetStream) -> None:
        remote = stream.muxed_conn.peer_id
        try:
            with trio.fail_after(timeout):
                try:
                    message = await FrameReader(stream).read_message(max_request)
                    reply = await handler(message, remote)
                except PeerClosed:
                    return
                except ProtocolError as exc:
                    level = logging.DEBUG if exc.code in QUIET_CODES else logging.WARNING
                    log.log(level, "%s: rejected input from %s: %s", name, remote, exc)
                    reply = error_reply(exc.code, str(exc), getattr(exc, "retry_after", None))
                await write_message(stream, reply, max_reply)
                await stream.close()
        except trio.TooSlowError:
            log.warning("%s: %s timed out", name, remote)
            await _reset(stream)
        except Exception as exc:
            log.warning("%s: stream from %s failed: %s: %s", name, remote, type(exc).__name__, exc)
            await _reset(stream)

    return on_stream


async def _reset(stream: INetStream) -> None:
    try:
        await stream.reset()
    except Exception:
        pass


async def request(
    host: IHost,
    peer_id: ID,
    protocol: str,
    message: dict[str, Any],
    *,
    max_request: int,
    max_reply: int,
    timeout: float = 30.0,
) -> dict[str, Any]:
    """Send one message, return the reply; an error reply raises RemoteError."""
    with trio.fail_after(timeout):
        stream = await host.new_stream(peer_id, [protocol])
        try:
            await write_message(stream, message, max_request)
            reply = await FrameReader(stream).read_message(max_reply)
        except BaseException:
            await _reset(stream)
            raise
        try:
            await stream.close()
        except Exception:
            pass
    return raise_if_error(reply)
