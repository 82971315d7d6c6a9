"""One-shot request/response over a fresh libp2p stream, and a handler wrapper that never lets a peer crash us or
hold our memory.

py-libp2p takes the whole host down when a stream handler raises, so ``serve`` catches everything: protocol
errors get an error reply, anything else is logged and the stream is reset. What a hostile peer can cost is bounded
before any work is done for it, in this order:

1. ``admit(peer)`` runs when the stream opens, before a byte is read (rate limits, bans): a flood costs a lookup;
   ``peer`` is a ``Remote``: the authenticated peer id, with the IP its connection comes from;
2. at most ``streams_per_peer`` streams of one protocol from one peer are served at once (the rest: "busy");
3. the frame's announced length must fit the message type's limit (a peer that announces more is told so and hung
   up on: both sides size frames by protocols/, so no honest peer does; ``on_oversized_frame``), and the
   ``FrameBudget`` must have room for it now; its body's bytes are then reserved as they arrive (never on the
   announced length: a header costs nothing to send, so 40 identities announcing 1 MiB frames and sending nothing
   once held a process-wide 256 MiB), within caps per peer, per protocol and in all: a frame over any of them is
   refused ("busy");
4. the body must arrive at ``min_rate`` bytes/s or better (plus a grace period): a slow-loris stream is cut;
5. a body of more than ``OFFLOAD_BYTES`` is decoded in a worker thread (the event loop keeps serving), with a cap
   on maps and arrays per message (protocols/framing.py).

Streams are reused: a request leaves its stream open for the next request to the same peer and protocol
(``StreamPool``), and a served stream takes requests until it idles ``IDLE_TIMEOUT`` seconds. A stream open costs
a multistream negotiation through Noise, which in a swarm of polls and small chunk requests was most of the CPU.

Streams open lazily (``open_stream``, as go-libp2p's single-protocol ``NewStream`` does): the multistream header,
the protocol and the first message leave together, and the listener's two echoes are read with the first reply.
py-libp2p's ``new_stream`` waits for each echo in turn: two round trips before the first byte of a request, 0.34 s
to a peer 170 ms away (a far sampler heard of a pushed version 0.5 s after publication, 0.09 s of it one way).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio
from libp2p.abc import IHost, INetStream
from libp2p.connection_types import ConnectionType
from libp2p.exceptions import ParseError
from libp2p.host.exceptions import StreamFailure
from libp2p.io.exceptions import IncompleteReadError, MessageTooLarge
from libp2p.network.stream.exceptions import StreamClosed, StreamEOF, StreamReset
from libp2p.peer.id import ID
from libp2p.stream_muxer.exceptions import MuxedConnUnavailable, MuxedStreamError
from libp2p.utils import encode_delim
from libp2p.utils.varint import decode_varint_with_size

from node.libp2p.conns import network_of
from protocols.errors import FrameTooLarge, PeerClosed, ProtocolError, RemoteError
from protocols.framing import MAX_CONTAINERS, FrameReader, unpack, write_message
from protocols.messages import error_reply, raise_if_error

log = logging.getLogger(__name__)

# refusals that mean "not now", without blame: the client waits and asks again (``backpressure``)
BACKPRESSURE_CODES = frozenset({"rate_limited", "busy"})
# refusals that are part of normal operation (backpressure; asking for a version this peer does not hold)
QUIET_CODES = BACKPRESSURE_CODES | {"not_found"}
PEER_GONE = (StreamReset, StreamEOF, StreamClosed, MuxedStreamError, MuxedConnUnavailable)
MAX_PAUSE = 30.0  # the longest a peer's retry_after makes a client wait: a peer cannot park us
OFFLOAD_BYTES = 64 << 10  # decode bodies larger than this off the event loop
IDLE_TIMEOUT = 30.0  # a served stream with no new request for this long is closed

Handler = Callable[[dict[str, Any], ID], Awaitable[dict[str, Any]]]
# told after each reply whether it was written out whole (True) or not (False: the stream failed or timed out)
ReplySent = Callable[[dict[str, Any], bool], None]


# per network (hosts in one process each have their own): who is told of a stream whose peer announced a frame over
# its message type's limit (the connection manager: it hangs up on the peer and cools its address). Refused without
# it, each such stream still cost a protocol negotiation and an error reply: 40 identities reopening ~64 a second took
# ~0.2 of the trainer's cores (bench/hostile ``headers``)
_OVERSIZED: weakref.WeakKeyDictionary[Any, Callable[[INetStream], None]] = weakref.WeakKeyDictionary()


def on_oversized_frame(network: Any, handler: Callable[[INetStream], None]) -> None:
    """Tell ``handler(stream)`` of every served stream on ``network`` whose peer announced an oversized frame."""
    _OVERSIZED[network] = handler


def _oversized(stream: INetStream) -> None:
    network = network_of(stream)
    handler = _OVERSIZED.get(network) if network is not None else None
    if handler is not None:
        try:
            handler(stream)
        except Exception as exc:  # the refusal stands either way
            log.debug("oversized-frame handler failed: %s", exc)


def backpressure(exc: BaseException) -> float | None:
    """Seconds to wait before asking this peer again, if ``exc`` is its refusal for load (no blame); else None.

    The one backpressure rule every client follows: the peer's ``retry_after``, 1 s when it named none, at most
    ``MAX_PAUSE``."""
    if not isinstance(exc, RemoteError) or exc.code not in BACKPRESSURE_CODES:
        return None
    return min(exc.retry_after or 1.0, MAX_PAUSE)


class Busy(ProtocolError):
    """Refused for now, without blame: come back after ``retry_after`` seconds."""

    code = "busy"

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class FrameBudget:
    """Bytes of request frames held in memory while they arrive: in all, per protocol and per peer (over all its
    streams and protocols), so that neither one peer nor one protocol can spend what the others need. A peer's
    cap fits the largest request frame of any protocol (rollouts: 8 MiB), so one whole frame always fits."""

    total: int = 256 << 20
    per_protocol: int = 128 << 20
    per_peer: int = 16 << 20
    used: int = 0
    by_protocol: dict[str, int] = field(default_factory=dict)
    by_peer: dict[ID, int] = field(default_factory=dict)

    def refusal(self, protocol: str, peer: ID, n: int) -> str | None:
        """Why ``n`` more bytes from ``peer`` on ``protocol`` cannot be held now; None when they can."""
        if self.by_peer.get(peer, 0) + n > self.per_peer:
            return f"{self.by_peer.get(peer, 0) >> 10} KiB of this peer's requests are arriving already"
        if self.by_protocol.get(protocol, 0) + n > self.per_protocol:
            return f"{self.by_protocol.get(protocol, 0) >> 20} MiB of {protocol} requests are arriving already"
        if self.used + n > self.total:
            return f"{self.used >> 20} MiB of requests are arriving already"
        return None

    def take(self, protocol: str, peer: ID, n: int) -> None:
        """Hold ``n`` bytes, or raise Busy (holding nothing) when a cap has no room for them."""
        why = self.refusal(protocol, peer, n)
        if why is not None:
            raise Busy(f"{why}; retry shortly")
        self._add(protocol, peer, n)

    def give(self, protocol: str, peer: ID, n: int) -> None:
        self._add(protocol, peer, -n)

    def _add(self, protocol: str, peer: ID, n: int) -> None:
        if not n:
            return
        self.used += n
        for book, key in ((self.by_protocol, protocol), (self.by_peer, peer)):
            left = book.get(key, 0) + n
            if left:
                book[key] = left
            else:
                del book[key]  # an idle peer leaves nothing behind

    @contextmanager
    def claim(self, protocol: str, peer: ID) -> Iterator[Callable[[int], None]]:
        """A meter for one frame: call it with each ``n`` bytes that arrived (it raises Busy when a cap has no
        room for them); what it holds is given back when the block ends."""
        held = 0

        def meter(n: int) -> None:
            nonlocal held
            self.take(protocol, peer, n)
            held += n

        try:
            yield meter
        finally:
            if held:
                self.give(protocol, peer, held)


BUDGET = FrameBudget()


@dataclass
class StreamCaps:
    """Streams of one protocol being served per peer."""

    per_peer: int
    active: dict[ID, int] = field(default_factory=dict)

    @contextmanager
    def hold(self, peer: ID):
        if self.active.get(peer, 0) >= self.per_peer:
            raise Busy(f"{self.per_peer} requests from this peer are already being served")
        self.active[peer] = self.active.get(peer, 0) + 1
        try:
            yield
        finally:
            self.active[peer] -= 1
            if not self.active[peer]:
                del self.active[peer]


class Remote(ID):
    """A stream's authenticated peer (its connection's peer id, never an id a message names), with the IP that
    connection comes from (None: relayed through another peer, or unknown). It is that peer's ID in every respect
    (equal, hashed and printed alike), so what keys on the peer is unchanged, and what limits per IP finds it here."""

    def __init__(self, peer: ID, ip: str | None) -> None:
        super().__init__(peer.to_bytes())
        self.ip = ip

    @classmethod
    def of(cls, stream: INetStream) -> Remote:
        conn = stream.muxed_conn
        ip = None
        try:
            if conn.get_connection_type() != ConnectionType.RELAYED:  # a relayed peer's address is its relay's
                address = stream.get_remote_address()
                ip = address[0] if address else None
        except Exception:  # a transport that cannot say: no IP, the peer id still keys every limit
            pass
        return cls(conn.peer_id, ip)


async def decode(body: bytes | bytearray, max_size: int, max_containers: int) -> dict[str, Any]:
    if len(body) > OFFLOAD_BYTES:
        return await trio.to_thread.run_sync(unpack, body, max_size, max_containers)
    return unpack(body, max_size, max_containers)


def serve(
    name: str,
    handler: Handler,
    max_request: int,
    max_reply: int,
    timeout: float = 30.0,
    *,
    admit: Callable[[ID], None] | None = None,
    max_containers: int = MAX_CONTAINERS,
    streams_per_peer: int = 8,
    min_rate: float = 64 << 10,
    budget: FrameBudget = BUDGET,
    reply_sent: ReplySent | None = None,
):
    """Wrap ``handler(message, remote_peer) -> reply`` as a py-libp2p stream handler (see the module docstring).
    ``reply_sent(reply, ok)`` follows every reply the handler returned, once its write ended (a server that must
    know when bytes left, not when it decided to send them: writes wait for the link).

    A stream may carry one request after another (the client keeps it for the next one: opening a stream costs a
    multistream negotiation, more CPU than a small request itself); it is closed after ``IDLE_TIMEOUT`` seconds
    without a request, after an error reply, or when the client closes it."""
    caps = StreamCaps(streams_per_peer)

    async def on_stream(stream: INetStream) -> None:
        remote = Remote.of(stream)
        try:
            with caps.hold(remote):
                reader = FrameReader(stream)
                while True:
                    with trio.move_on_after(IDLE_TIMEOUT) as idle:
                        try:
                            length = await reader.read_length(max_request)
                        except PeerClosed:
                            await _close(stream)  # the client is done with this stream
                            return
                        except ProtocolError as exc:
                            await _refuse(stream, name, remote, exc, max_reply)
                            if isinstance(exc, FrameTooLarge):
                                _oversized(stream)
                            return
                    if idle.cancelled_caught:
                        await stream.close()
                        return
                    with trio.fail_after(timeout):
                        try:
                            if admit is not None:
                                admit(remote)
                            if (why := budget.refusal(name, remote, length)) is not None:
                                raise Busy(f"{why}; retry shortly")  # would not fit now: refused before its body
                            with budget.claim(name, remote) as meter, trio.fail_after(10.0 + length / min_rate):
                                body = await reader.read_exactly(length, meter)
                            message = await decode(body, max_request, max_containers)
                            del body
                            reply = await handler(message, remote)
                        except PeerClosed:
                            return
                        except ProtocolError as exc:
                            await _refuse(stream, name, remote, exc, max_reply)
                            return
                        sent = False
                        try:
                            await write_message(stream, reply, max_reply)
                            sent = True
                        finally:
                            if reply_sent is not None:
                                reply_sent(reply, sent)
        except Busy as exc:  # too many streams from this peer already: say so, then close
            await _refuse(stream, name, remote, exc, max_reply)
        except trio.TooSlowError:
            log.warning("%s: %s timed out", name, remote)
            await _reset(stream)
        except Exception as exc:
            # a peer that went away mid-request (a superseded chunk request, a node stopping) is routine
            level = logging.DEBUG if isinstance(exc, PEER_GONE) else logging.WARNING
            log.log(level, "%s: stream from %s failed: %s: %s", name, remote, type(exc).__name__, exc)
            await _reset(stream)

    return on_stream


async def _refuse(stream: INetStream, name: str, remote: ID, exc: ProtocolError, max_reply: int) -> None:
    """An error reply, then the stream is closed (what follows the refused frame on it cannot be trusted)."""
    level = logging.DEBUG if exc.code in QUIET_CODES else logging.WARNING
    log.log(level, "%s: rejected input from %s: %s", name, remote, exc)
    try:
        with trio.fail_after(10):
            await write_message(stream, error_reply(exc.code, str(exc), getattr(exc, "retry_after", None)), max_reply)
            await stream.close()
    except Exception:
        await _reset(stream)


async def _reset(stream: INetStream) -> None:
    """Reset (RST) the stream, also from a cancelled scope (a timeout, a request superseded): unshielded, the
    reset itself would be cancelled before it went out, and the peer would go on sending into a dead stream."""
    with trio.CancelScope(shield=True), trio.move_on_after(1.0):
        try:
            await stream.reset()
        except Exception:
            pass


@dataclass
class _Idle:
    stream: INetStream
    since: float


class StreamPool:
    """Streams a request left open, by (local host, peer, protocol), for the next request to the same place. At
    most ``per_key`` are kept, none reused past ``max_idle`` seconds (under the server's ``IDLE_TIMEOUT``): the next
    request to the same place closes those (a connection's close resets whatever is left)."""

    def __init__(self, per_key: int = 8, max_idle: float = IDLE_TIMEOUT / 2) -> None:
        self.per_key = per_key
        self.max_idle = max_idle
        self.idle: dict[tuple[str, str, str], list[_Idle]] = {}

    def take(self, key: tuple[str, str, str]) -> tuple[INetStream | None, list[INetStream]]:
        """(a kept stream to reuse, or None; the streams kept past ``max_idle``, which the caller must close).

        A stream dropped without a close is never released: py-libp2p frees a stream's slot in its host-wide stream
        semaphore (10,000, shared by inbound and outbound streams; a full one makes every new stream wait) only on
        a close or a reset, and the peer's idle close alone does not do it. A sampler dropped one or two a minute."""
        entries = self.idle.pop(key, [])
        now = trio.current_time()
        fresh = [e for e in entries if now - e.since < self.max_idle]
        stale = [e.stream for e in entries if now - e.since >= self.max_idle]
        kept = fresh.pop().stream if fresh else None  # the newest: given last
        if fresh:
            self.idle[key] = fresh
        return kept, stale

    def give(self, key: tuple[str, str, str], stream: INetStream) -> bool:
        entries = self.idle.setdefault(key, [])
        if len(entries) >= self.per_key:
            return False
        entries.append(_Idle(stream, trio.current_time()))
        return True


POOL = StreamPool()
MULTISTREAM = "/multistream/1.0.0"
MAX_ECHO = 1024  # bytes a listener's multistream answer may announce
LAZY_READ = 64 << 10  # the most one read of a lazy stream's echoes takes (what came with them is kept)


def encode_line(text: str) -> bytes:
    return text.encode() + b"\n"


def take_delimited(buf: bytes, limit: int) -> tuple[bytes, int] | None:
    """The first varint-length-prefixed item whole in ``buf`` and the bytes it spans, or None while it is not all
    there. MessageTooLarge when it announces more than ``limit``; ParseError for a varint over 10 bytes."""
    if not buf:
        return None
    try:
        length, size = decode_varint_with_size(buf[:10])  # what is there of it: a partial value if cut short
    except ValueError as exc:  # its 10th byte is not its last
        raise ParseError("a varint longer than 10 bytes") from exc
    if buf[size - 1] & 0x80:
        return None  # the varint is not all there yet
    if length > limit:
        raise MessageTooLarge(f"an item of {length} bytes announced; at most {limit}")
    end = size + length
    return (bytes(buf[size:end]), end) if len(buf) >= end else None


class LazyStream:
    """A stream whose protocol was proposed but not yet confirmed: its first read reads the listener's two echoes
    (the multistream header, then the protocol or "na") before any data. Everything else is the stream's.

    Reads are buffered: the echoes are read as the bytes arrive, not a byte at a time, and a short read takes what
    has come and keeps the rest for the next reads (``_rest``). Each read of a yamux stream is a few task switches
    and some CPU: read a byte at a time, the echoes and a DHT reply were 27 switches of the asking task
    (bench/lookup_steps.py). At N = 256 on one box, where a switch waits a pass of a loop 0.5 s behind, fewer
    switches shortened lookups only as far as they also saved CPU (docs/capacity.md, "Locks that do not yield")."""

    def __init__(self, stream: INetStream, protocol: str) -> None:
        self._stream = stream
        self._protocol = protocol
        self._agreed = False
        self._rest = b""

    async def read(self, n: int | None = None) -> bytes:
        if not self._agreed:
            await self._agree()
        if not self._rest:
            if n is None or n < 0 or n >= LAZY_READ:
                return await self._stream.read(n)
            self._rest = await self._stream.read(LAZY_READ)  # a varint read a byte at a time: one read for all
        take = len(self._rest) if n is None or n < 0 else n
        data, self._rest = self._rest[:take], self._rest[take:]
        return data

    async def _agree(self) -> None:
        buf, echoes = b"", []
        try:
            while len(echoes) < 2:
                item = take_delimited(buf, MAX_ECHO)
                if item is None:
                    chunk = await self._stream.read(LAZY_READ)
                    if not chunk:
                        raise IncompleteReadError(f"the stream ended after {len(buf)} bytes of its echoes")
                    buf += chunk
                    continue
                echoes.append(item[0])
                buf = buf[item[1] :]
        except (ParseError, IncompleteReadError, MessageTooLarge) as exc:
            raise StreamFailure(f"{self._protocol}: no multistream answer: {exc}") from exc
        header, answer = echoes
        if header != encode_line(MULTISTREAM) or answer != encode_line(self._protocol):
            raise StreamFailure(f"{self._protocol}: the peer answered {header[:64]!r}, {answer[:64]!r}")
        self._agreed, self._rest = True, buf

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


async def open_stream(host: IHost, peer_id: ID, protocol: str, first: bytes = b"") -> INetStream:
    """A new stream to ``peer_id`` speaking ``protocol``, negotiated lazily (see the module docstring): no round
    trip here; a peer that does not speak it fails the first read with ``StreamFailure``. ``first`` (a request)
    leaves in the same write as the header and the protocol: one write fewer is several task switches fewer."""
    stream = await host.get_network().new_stream(peer_id)
    try:
        await stream.write(encode_delim(MULTISTREAM.encode()) + encode_delim(protocol.encode()) + first)
    except BaseException:
        await _reset(stream)
        raise
    stream.set_protocol(protocol)
    return LazyStream(stream, protocol)  # type: ignore[return-value]


class AnswerClock:
    """How long answers to this node's requests take, and so how long the next one may: TCP's retransmission timer
    (RFC 6298). ``timeout`` is SRTT + 4 RTTVAR over the answers timed (``answered``), within [``floor``,
    ``ceiling``]; after a request ran out at W seconds (``late``) the next waits at least 2W (Karn's backoff), until
    one is answered. A fixed deadline tuned on an idle machine abandons every answer of a loaded one and asks
    again, adding the load that made it slow: at N = 128 on one box (bench/swarm_scale) work requests took 15-40 s
    against a fixed 30 s, 109 of 128 samplers' last error was that timeout, and the trainer issued a lease for every
    retry. A trusted peer that never answers still costs at most ``ceiling`` a request. (Chunk replies, from peers
    that may be hostile, follow node/weights/policy.py ``OwnDelay`` instead: the quickest replies, not the mean.)"""

    def __init__(self, floor: float, ceiling: float) -> None:
        self.floor, self.ceiling = floor, ceiling
        self.srtt: float | None = None
        self.rttvar = 0.0
        self.backoff = 0.0  # after requests that ran out: at least this long (0: none since the last answer)

    def timeout(self) -> float:
        base = self.floor if self.srtt is None else max(self.floor, self.srtt + 4 * self.rttvar)
        return min(self.ceiling, max(base, self.backoff))

    def answered(self, seconds: float) -> None:
        if self.srtt is None:
            self.srtt, self.rttvar = seconds, seconds / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - seconds)
            self.srtt = 0.875 * self.srtt + 0.125 * seconds
        self.backoff = 0.0

    def late(self, waited: float) -> None:
        """A request got no answer in ``waited`` seconds."""
        self.backoff = min(self.ceiling, 2 * max(self.backoff, waited))


class Clock(Protocol):
    """What the timing of a request teaches: ``AnswerClock``, node/weights/policy.py ``OwnDelay``."""

    def answered(self, seconds: float) -> None: ...

    def late(self, waited: float) -> None: ...


@contextmanager
def timed_by(clock: Clock, deadline: float) -> Iterator[None]:
    """Teach ``clock`` how the request in this block, given ``deadline`` seconds, went: a reply (an error reply too)
    took so long; running out (``trio.TooSlowError``) backs it off. Anything else (a reset, a peer gone) says
    nothing of how long answers take here."""
    asked = trio.current_time()
    try:
        yield
    except RemoteError:
        clock.answered(trio.current_time() - asked)
        raise
    except trio.TooSlowError:
        clock.late(deadline)
        raise
    clock.answered(trio.current_time() - asked)


async def request(
    host: IHost,
    peer_id: ID,
    protocol: str,
    message: dict[str, Any],
    *,
    max_request: int,
    max_reply: int,
    timeout: float = 30.0,
    max_containers: int = MAX_CONTAINERS,
    pool: StreamPool = POOL,
) -> dict[str, Any]:
    """Send one message, return the reply; an error reply raises RemoteError. The stream is kept for the next
    request to the same peer and protocol; a kept stream the peer has meanwhile closed is replaced by a new one."""
    key = (str(host.get_id()), str(peer_id), protocol)
    with trio.fail_after(timeout):
        while True:
            kept, stale = pool.take(key)
            for old in stale:
                await _close(old)
            stream = kept or await open_stream(host, peer_id, protocol)
            try:
                await write_message(stream, message, max_request)
                reply = await decode(await FrameReader(stream).read_body(max_reply), max_reply, max_containers)
                break
            except PeerClosed:
                await _reset(stream)
                if kept is None:
                    raise
                continue  # the peer had closed the kept stream (idle, restarted): once more on a fresh one
            except BaseException as exc:
                await _reset(stream)
                if kept is not None and isinstance(exc, Exception) and not isinstance(exc, ProtocolError):
                    continue  # a kept stream that broke meanwhile (its connection closed): once more, fresh
                raise
    if reply.get("t") == "error" or not pool.give(key, stream):
        await _close(stream)  # the server closes after an error reply; and the pool is full
    return raise_if_error(reply)


async def _close(stream: INetStream) -> None:
    """Close a stream we are done with, or reset it where the close fails or is cancelled (a request's deadline
    firing while it closes a stale stream): either releases its slot in its host (``StreamPool.take``); a close that
    raised, or was cut short, left it held."""
    try:
        await stream.close()
    except Exception:
        await _reset(stream)
    except BaseException:  # cancelled mid-close: reset (shielded), then let the cancellation go on
        await _reset(stream)
        raise
