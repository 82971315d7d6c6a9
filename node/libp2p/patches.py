"""Every py-libp2p 0.8.1 fix, in one table (``PATCHES``), and the ten applied in place by ``apply()``.

``PATCHES`` names each fix: the upstream bug (``upstream``), the library code it replaces or overrides
(``target``), ours (``ours``), the test that reproduces the bug on stock code (``test``) and the report ready to
send upstream (``docs/upstream/libp2p-<name>.md``). Rows with ``install`` are class methods or module constants
that ``apply()`` (``build_host`` calls it, through ``node.libp2p.install``) replaces in place; the originals are
kept, so ``unapply()`` / ``disabled()`` restore stock behaviour for tests that compare. The other rows are subclass
overrides in node/libp2p/nat.py and private reads in node/libp2p/access.py, used where reachability and discovery
build their objects. ``INTERNALS`` lists the private names we read without fixing anything. Written against
libp2p==0.8.1 exactly (node/libp2p/version.py refuses any other version). Line numbers below are 0.8.1's.

The in-place fixes:

1. yamux: the connection's read loop blocks on sends (issue 14)
-----------------------------------------------------------------
``Yamux.handle_incoming`` (stream_muxer/yamux/yamux.py) is the only task that reads the secured connection, yet it
awaits ``Yamux._write_frame`` in three places: the ACK for an inbound SYN (l. 1377), the RST for a duplicate SYN
(l. 1375) and the pong for a ping (l. 1487; ``_measure_rtt_loop`` pings 0.5 s after start, then every 30 s).
``_write_frame`` (l. 851) takes the connection's ``_write_lock`` and writes to the socket. When both peers push data
at once, each side's writers fill their TCP send buffer; the lock is then held by a data writer parked in
``send_all``. Both read loops reach one of those writes (a ping is enough), wait for the lock, stop reading their
socket, so neither TCP pipe drains and neither writer ever finishes: a permanent deadlock with no error (the 5 s
zero-window timeout in ``YamuxStream.write`` does not fire, the writers are in the socket send, not waiting for
credit). A window update is not sent by the read loop in 0.8.1, but by the *application reader* inside
``YamuxStream.read`` (l. 529/581 -> ``_auto_tune_and_send_window_update`` l. 458 -> ``send_window_update`` l. 332 ->
``_write_frame``), so readers also stall behind the same lock and queue up behind data frames, which is how the
deadlock first looked ("blocked writing a window update").

The fix (``Yamux._handle_incoming_with_ready_signal`` and ``Yamux._write_frame`` replaced):

* each connection gets a small control queue and a sender task, started next to the read loop and cancelled with it;
* a frame the read loop wants to send (ACK, RST, pong: 12-byte headers) is queued, never awaited: the read loop only
  ever waits for the socket it reads, so both TCP pipes keep draining and the writers always make progress;
* a pure window update (type WINDOW_UPDATE, flags 0) from any task is added to that stream's pending credit (summed,
  one frame per stream however many reads happened) instead of being written inline: ``read()`` returns at once;
* whoever takes ``_write_lock`` next (the sender task, or a writer about to send a frame) writes the queued control
  frames first, in one socket write with its own frame. Control frames thus jump the queue of data frames (credit
  reaches the peer sooner, fewer zero-window stalls) but never overtake a frame written after they were queued, so
  per-stream order holds (ACK before the handler's first data, credit before FIN).

Flow control is unchanged: ``recv_window`` is still credited synchronously under ``window_lock`` by upstream code at
read time; only the transmission of the credit is deferred, and additive credit for one stream sums exactly. The
queue is bounded: pongs beyond ``MAX_QUEUED_CONTROL_FRAMES`` are dropped (as go-yamux does), and a peer that makes us
queue more than that many ACK/RST frames without reading our replies gets its connection closed (the read loop
treats the raised RawConnError as a dead connection). Pending credit is at most one entry per live stream.

A related stall is bounded too: ``Yamux.close`` (l. 786) writes GO_AWAY while holding ``streams_lock``, which the read
loop needs for every DATA frame; two peers closing at once under load would each wait for a pipe the other no longer
drains. GO_AWAY is a courtesy (the peer handles EOF the same way), so its write is bounded to ``GO_AWAY_SEND_TIMEOUT``.

Not changed: ``YamuxStream.write`` (l. 280-289) still raises MuxedStreamError when a stream's send window stays at
zero for 5 s, polling every 10 ms. With credit now sent promptly that only fires on a reader that really stops
reading for 5 s (hashing, disk, a busy event loop), which go-yamux would simply wait out (writes block until credit,
a deadline, reset or close). Keep draining streams promptly (LIBP2P_NOTES trap 3) and put deadlines in the
application (node.rpc does). After that error NetStream only marks the stream reset locally: no RST goes out, and the
peer's reader waits for the rest forever unless the writer calls ``stream.reset()`` (node.rpc does).

1b. a cancelled write breaks the connection silently (issue 29, the N = 128 install wave)
--------------------------------------------------------------------------------------
``NoiseTransportReadWriter.write_msg`` (security/noise/io.py l. 59) encrypts, spending the session's next nonce,
then awaits the socket. A caller's deadline or cancel (a request timing out, a push lane cancelled for a newer
version, a starved loop's many deadlines at once) landing in that await left the peer without that message, or with
part of it: its next decryption failed, ``Yamux.handle_incoming`` logged "Error reading header ...: Failed
authentication of message" at debug level and dropped the connection. At N = 128 on one box that was how the
trainer lost ~half its peers within 40 s of a version (both ends saw only a clean close or an accept loop ending).
``_write_whole`` finishes every frame write it starts, shielded from the caller's cancellation, within
``FRAME_WRITE_DEADLINE``; past that the socket is taken for dead and the connection closed, so a half-written frame
is never followed by another. The caller's cancellation is delivered once the frame is out.

1c. a cancelled close keeps its stream for good (issue 29, found tracing the N = 256 lookups)
--------------------------------------------------------------------------------------------
``YamuxStream.close`` (l. 584) and ``reset`` (l. 618) write their FIN/RST, then release the stream's slot of the
connection's 256-stream backlog (``Yamux.stream_backlog_semaphore``, taken by every outbound ``open_stream``,
l. 880); ``NetStream.close``/``reset`` (network/stream/net_stream.py l. 311/357) then drop the stream from its
connection and the swarm's stream count. py-libp2p closes streams in ``finally`` blocks (the DHT's queries), so a
query cancelled by its deadline closes in a cancelled scope: the first checkpoint raises, nothing is released, no FIN
is sent. The peer's handler answers and ends its side; ours is then half-open forever (the stale-stream sweeper
reclaims only streams closed both ways). Each cancelled query costs a backlog slot for the connection's life, and
256 of them on one connection leave it unable to open a stream. At N = 256 on one box it was rare (one such close
a minute among 256 hosts, in the window measured): not what made those lookups slow (docs/capacity.md), but a
long-lived connection to a busy peer adds them up.

The fix (``YamuxStream.close``/``reset`` and ``NetStream.close``/``reset`` replaced):

* the stream's state and its backlog slot are settled at once, whatever the caller's cancellation;
* the FIN/RST is handed to a task of the connection's own (started beside the read loop, see 1), which waits its turn
  for ``_write_lock`` as upstream's inline write did: trio's lock is FIFO, so a frame of this stream already waiting
  is still written before the FIN, and the caller never waits for the wire;
* ``NetStream``'s bookkeeping runs shielded (its steps are lock waits only, now that nothing in it waits for the
  wire), bounded by ``FRAME_WRITE_DEADLINE``. The caller's cancellation is delivered at its next checkpoint.

2. inbound connection slots held until the swarm stops (issue 17, item 1)
--------------------------------------------------------------------------
``Swarm._handle_inbound_connection`` (network/swarm.py l. 1981-1999) takes a slot from ``_inbound_limiter``
(max_connections - min_connections = 300 - 50 = 250 by default) and releases it when
``_do_handle_inbound_connection`` returns. That method ends the upgrade with ``await self.manager.wait_finished()``
(l. 2060, and l. 2044 for pre-multiplexed QUIC connections): it returns only when the whole swarm stops. The wait is
there for a reason: the TCP listener runs each connection in a ``trio.serve_listeners`` handler that closes the socket
when the handler returns, so the handler must outlive the connection. But it outlives it forever, so the slot, the
handler task and its socket object are kept after the peer has gone: after 250 inbound connections over the node's
life (any identities, even one peer reconnecting) every further inbound connection is closed unanswered.

The fix (``Swarm._do_handle_inbound_connection`` replaced; the rest of the method is upstream's, unchanged) waits for
the connection instead of the swarm: until the muxed connection's ``event_closed`` is set (yamux sets it on local
close, on EOF or error, and it is what ``SwarmConn`` observes), or the swarm stops, whichever comes first. The slot
then bounds *live* inbound connections, which is what the limiter's comment says it is for (keep room for outbound
connections), and a closed connection's slot is free again immediately.

3. yamux frames that Noise must split (issue 14, CPU per byte)
--------------------------------------------------------------
A yamux data frame is up to ``MAX_MESSAGE_SIZE`` = 65,536 bytes (header included), but one Noise transport message
carries at most 65,519 bytes of plaintext (``security/noise/io.py`` ``MAX_PLAINTEXT_LENGTH``), so every full data
frame went out as two Noise messages, the second of 17 bytes: twice the encryptions, MACs, length prefixes and
reads per frame. ``MAX_MESSAGE_SIZE`` (read at call time in ``YamuxStream.write``, l. 248) is set to 65,519 so a
frame is exactly one Noise message. Measured while writing this: receiver CPU ~4.2 s -> ~3.5 s per 512 MiB.

4. one bad frame to a built-in handler takes the whole node down (LIBP2P_NOTES trap 1)
--------------------------------------------------------------------------------------
An exception escaping a stream handler propagates through the connection's nursery and the host's services and
stops the node. Our own handlers catch everything (node.rpc), but py-libp2p's do not: ``Pubsub.stream_handler``
(pubsub/pubsub.py l. 769) catches StreamError, ParseError and IncompleteReadError, not protobuf's DecodeError, so
any peer sending one malformed gossipsub RPC killed every node it was connected to (seen in the WAN scenario: a
sampler died of ``DecodeError: Error parsing message with type 'pubsub.pb.RPC'``). ``BasicHost._swarm_stream_handler``
(host/basic_host.py l. 1480, the one entry for every inbound stream) is wrapped: an Exception from negotiation or
from any handler is logged and the stream reset; the node goes on. Cancellation (a BaseException) passes through.

5. TCP claims circuit addresses (issue 15)
------------------------------------------
``TCP.can_dial`` (transport/tcp/tcp.py) accepts any address with a "tcp" component, so
``/ip4/../tcp/../p2p/R/p2p-circuit/p2p/B`` too: the swarm then dials the relay R expecting B, fails with a peer id
mismatch and clears all of B's addresses. ``TCP.can_dial`` is wrapped to refuse circuit addresses; circuits are
dialed by ``node.reachability.Reachability.dial_relayed`` through a ``nat.RelayClient`` only.

6. inbound connections admitted with no say (issue 26, item 1a)
---------------------------------------------------------------
``Swarm._handle_inbound_connection`` (network/swarm.py l. 1947-1999) takes a limiter slot or closes the newcomer
unanswered: idle connections of ~250 fresh identities lock every new peer out while they are held, and nothing caps
one address. Replaced by ``node/libp2p/conns.py`` ``_handle_inbound_connection``: the same method asking the
``Admission`` attached to the swarm (node/connmgr.py ``ConnManager``: per-address caps, pruning the idlest
connection when the slots run out) before taking a slot; upstream's behaviour when none is attached.

7. twenty providers per key, the first twenty (issue 29)
--------------------------------------------------------
``ProviderStore.add_provider`` (kad_dht/provider_store.py l. 563-600) refuses a key's 21st provider for as long as
the first 20 records live (48 h), and ``get_providers`` answers every lookup with all of them: every node learned
the same 20 samplers of a role every sampler provides. Replaced by node/libp2p/providers.py (its docstring says
how): many records per key, the oldest idle one replaced when full, each lookup answered with a sample.

8. a window update for every data frame (issue 27, CPU per byte)
-----------------------------------------------------------------
``YamuxStream._auto_tune_and_send_window_update`` (stream_muxer/yamux/yamux.py l. 410-458), run after every read,
credits the sender whenever any window is owed, not once half the window is (go-yamux): a reader taking a frame at a
time answers each data frame with a window update, a Noise message each way. Replaced by node/libp2p/credit.py
(its docstring says how; the auto-tuning of the window is upstream's).

9. a routing-table refresh that walks on when nobody answers (issue 29)
-----------------------------------------------------------------------
``PeerRouting.refresh_routing_table`` (kad_dht/peer_routing.py l. 477-524), at the DHT's start and every 600 s,
walks for the node's own id and then for a random key in every non-empty bucket, each walk asking up to 20 peers
under 10 s deadlines, whatever the walk before it met. Replaced by node/libp2p/routing.py (its docstring says how,
and what it measured): the same walks, the round ending at the first walk no peer answered;
``PeerRouting._query_peer_for_closest`` is wrapped to count the answers.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import trio
from libp2p.abc import IMuxedConn
from libp2p.host.autonat.autonat import AutoNATService
from libp2p.host.basic_host import BasicHost
from libp2p.kad_dht.peer_routing import PeerRouting
from libp2p.kad_dht.provider_store import ProviderStore
from libp2p.network.connection.exceptions import RawConnError
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.network.stream.net_stream import NetStream
from libp2p.network.swarm import Swarm
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.security.noise.io import MAX_PLAINTEXT_LENGTH
from libp2p.stream_muxer.yamux import yamux as _yamux
from libp2p.transport.tcp.tcp import TCP

from node.libp2p.conns import LAST_READ, _handle_inbound_connection
from node.libp2p.credit import credit_at_half_window
from node.libp2p.nat import is_relayed_addr
from node.libp2p.providers import add_provider, get_providers
from node.libp2p.routing import count_answers, refresh_routing_table
from node.libp2p.version import check_version

log = logging.getLogger(__name__)

# queued ACK/RST/pong headers per connection (12 B each) before pongs are dropped and a flooding peer is cut off
MAX_QUEUED_CONTROL_FRAMES = 4096
GO_AWAY_SEND_TIMEOUT = 1.0
FRAME_WRITE_DEADLINE = 10.0  # seconds a frame's write, once begun, may take before its connection is given up
NOISE_FIT_FRAME = MAX_PLAINTEXT_LENGTH  # a whole yamux frame (header + data) in one Noise message
_HEADER = struct.Struct(_yamux.YAMUX_HEADER_FORMAT)
_MAX_INCREMENT = 0xFFFFFFFF

_state: dict[str, Any] = {"applied": False, "suppressed": 0, "originals": {}}


# -- 1. yamux -------------------------------------------------------------------------------------------------------


class _ControlQueue:
    """Frames waiting for the wire that nobody may block on: read-loop replies and coalesced window credit."""

    __slots__ = ("closed", "credit", "frames", "nursery", "reader", "wakeup")

    def __init__(self, reader: trio.lowlevel.Task) -> None:
        self.reader = reader  # the task running handle_incoming
        self.frames: list[bytes] = []
        self.credit: dict[int, int] = {}
        self.wakeup = trio.Event()
        self.closed = False
        self.nursery: trio.Nursery | None = None  # the connection's own tasks (the sender; a closed stream's FIN)

    def push_frame(self, frame: bytes, droppable: bool) -> None:
        if self.closed:
            return
        if len(self.frames) >= MAX_QUEUED_CONTROL_FRAMES:
            if droppable:
                return
            raise RawConnError(f"yamux: peer left {len(self.frames)} control replies unread; closing the connection")
        self.frames.append(frame)
        self.wakeup.set()

    def add_credit(self, stream_id: int, increment: int) -> None:
        if self.closed or increment <= 0:
            return
        self.credit[stream_id] = self.credit.get(stream_id, 0) + increment
        self.wakeup.set()

    def take(self) -> bytes:
        """Everything queued, as one byte string (call with the connection's write lock held)."""
        if not self.frames and not self.credit:
            return b""
        out = self.frames
        self.frames = []
        for stream_id, total in self.credit.items():
            while total > 0:
                inc = min(total, _MAX_INCREMENT)
                out.append(_HEADER.pack(0, _yamux.TYPE_WINDOW_UPDATE, 0, stream_id, inc))
                total -= inc
        self.credit.clear()
        return b"".join(out)


async def _control_sender(conn: _yamux.Yamux, ctrl: _ControlQueue) -> None:
    while True:
        await ctrl.wakeup.wait()
        ctrl.wakeup = trio.Event()
        try:
            async with conn._write_lock:
                batch = ctrl.take()
                if batch:
                    await conn.secured_conn.write(batch)
        except Exception as exc:  # the connection is gone; the read loop sees it and cleans up
            log.debug("yamux control sender for %s stops: %s: %s", conn.peer_id, type(exc).__name__, exc)
            ctrl.closed = True
            ctrl.frames.clear()
            ctrl.credit.clear()
            return


async def _handle_incoming_with_ready_signal(
    self: _yamux.Yamux, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Upstream's read-loop task, with a control-frame sender running beside it for its whole life."""
    ctrl = _ControlQueue(trio.lowlevel.current_task())
    self._swarmrl_ctrl = ctrl  # type: ignore[attr-defined]
    _stamp_reads(self)
    original = _state["originals"]["Yamux._handle_incoming_with_ready_signal"]
    task_status.started()
    async with trio.open_nursery() as nursery:
        ctrl.nursery = nursery
        nursery.start_soon(_control_sender, self, ctrl)
        try:
            await original(self)  # runs handle_incoming in this task; its own started() is then a no-op
        finally:
            ctrl.closed = True
            nursery.cancel_scope.cancel()


def _stamp_reads(muxer: _yamux.Yamux) -> None:
    """Have the read loop note (trio time, ``LAST_READ`` on the muxer) whenever it reads from its secured connection:
    conns.last_read, for the keepalive's "nothing came since the ping" (node/connmgr.py ``pong_overdue``)."""
    secured = muxer.secured_conn
    read = secured.read

    async def stamped(n: int | None = None) -> bytes:
        data = await read(n)
        setattr(muxer, LAST_READ, trio.current_time())
        return data

    setattr(muxer, LAST_READ, trio.current_time())
    try:
        secured.read = stamped  # type: ignore[method-assign]
    except AttributeError:  # a secure session with __slots__: last_read stays at the start (the stock rule)
        pass


async def _write_frame(self: _yamux.Yamux, data: bytes) -> None:
    """Upstream ``_write_frame``, except that nothing the read loop sends, and no window credit, waits for the wire."""
    ctrl: _ControlQueue | None = getattr(self, "_swarmrl_ctrl", None)
    if ctrl is None or ctrl.closed:  # a connection started before apply(), or one that is shutting down
        await _state["originals"]["Yamux._write_frame"](self, data)
        return
    typ = flags = -1
    if len(data) >= _yamux.HEADER_SIZE:
        _, typ, flags, stream_id, length = _HEADER.unpack_from(data)
        if typ == _yamux.TYPE_WINDOW_UPDATE and flags == 0 and len(data) == _yamux.HEADER_SIZE:
            ctrl.add_credit(stream_id, length)
            return
    if trio.lowlevel.current_task() is ctrl.reader:
        if not self.event_shutting_down.is_set():
            ctrl.push_frame(data, droppable=typ == _yamux.TYPE_PING)
        return
    if typ == _yamux.TYPE_GO_AWAY:
        try:
            with trio.fail_after(GO_AWAY_SEND_TIMEOUT):  # the wait for the lock; the write has its own bound
                await _write_with_pending(self, ctrl, data, GO_AWAY_SEND_TIMEOUT)
        except (trio.TooSlowError, RawConnError):
            log.debug("yamux: GO_AWAY to %s not sent within %.0f s; closing anyway", self.peer_id, GO_AWAY_SEND_TIMEOUT)
        return
    await _write_with_pending(self, ctrl, data)
    await trio.lowlevel.checkpoint()


async def _write_with_pending(
    conn: _yamux.Yamux, ctrl: _ControlQueue, data: bytes, deadline: float = FRAME_WRITE_DEADLINE
) -> None:
    async with conn._write_lock:
        pending = ctrl.take()
        await _write_whole(conn, pending + data if pending else data, deadline)


async def _write_whole(conn: _yamux.Yamux, data: bytes, deadline: float = FRAME_WRITE_DEADLINE) -> None:
    """Write ``data`` to the secured connection whatever happens to the caller meanwhile (see 1b above): once Noise
    has encrypted a message its nonce is spent, and a write cancelled before the socket took all of it broke the
    connection for good. Past ``deadline`` the socket is taken for dead and the connection closed."""
    with trio.CancelScope(shield=True):
        with trio.move_on_after(deadline) as scope:
            await conn.secured_conn.write(data)
        if scope.cancelled_caught:  # part of a Noise message may be on the wire: nothing after it would decrypt
            with trio.move_on_after(1.0):
                await conn.secured_conn.close()
    if scope.cancelled_caught:
        raise RawConnError(f"yamux: a frame to {conn.peer_id} not written in {deadline:.0f} s; connection closed")


# -- 1c. a cancelled close ------------------------------------------------------------------------------------------


def _send_end(stream: _yamux.YamuxStream, ctrl: _ControlQueue, flag: int) -> None:
    """Have the connection's own task write ``stream``'s FIN or RST when its turn for the write lock comes."""
    frame = _HEADER.pack(0, _yamux.TYPE_WINDOW_UPDATE, flag, stream.stream_id, 0)

    async def send() -> None:
        try:
            await _write_with_pending(stream.conn, ctrl, frame)
        except Exception as exc:  # the connection is gone: the peer sees its end instead
            log.debug("yamux: end of stream %s to %s not sent: %s", stream.stream_id, stream.conn.peer_id, exc)

    if ctrl.closed or ctrl.nursery is None:
        return
    try:
        ctrl.nursery.start_soon(send)
    except RuntimeError:  # the connection's nursery has closed: so has the connection
        pass


async def _stream_close(self: _yamux.YamuxStream) -> None:
    """Upstream ``YamuxStream.close`` (our half of the stream ends: FIN), settled whatever the caller's cancellation:
    the backlog slot is released at once and the FIN goes out when its turn for the wire comes (see 1c above)."""
    ctrl: _ControlQueue | None = getattr(self.conn, "_swarmrl_ctrl", None)
    if ctrl is None:  # a connection started before apply()
        await _state["originals"]["YamuxStream.close"](self)
        return
    self._log_perf_yamux_summary()
    if not self.send_closed:
        self.send_closed = True
        _send_end(self, ctrl, _yamux.FLAG_FIN)
    self.closed = self.send_closed and self.recv_closed
    with trio.CancelScope(shield=True):
        await self.conn._finalize_stream(self, fully_closed=self.closed)


async def _stream_reset(self: _yamux.YamuxStream) -> None:
    """Upstream ``YamuxStream.reset`` (RST), settled whatever the caller's cancellation (see 1c above)."""
    ctrl: _ControlQueue | None = getattr(self.conn, "_swarmrl_ctrl", None)
    if ctrl is None:
        await _state["originals"]["YamuxStream.reset"](self)
        return
    if not self.closed:
        self.closed = self.send_closed = self.recv_closed = self.reset_received = True
        ctrl.credit.pop(self.stream_id, None)  # credit for a stream we reset would name a stream the peer dropped
        _send_end(self, ctrl, _yamux.FLAG_RST)
    with trio.CancelScope(shield=True):
        await self.conn._finalize_stream(self, fully_closed=True)


async def _net_stream_close(self: NetStream) -> None:
    """Upstream ``NetStream.close``, shielded so that a cancelled caller still leaves the stream closed and counted
    out (see 1c above)."""
    with trio.CancelScope(shield=True), trio.move_on_after(FRAME_WRITE_DEADLINE):
        await _state["originals"]["NetStream.close"](self)


async def _net_stream_reset(self: NetStream) -> None:
    """Upstream ``NetStream.reset``, shielded as ``_net_stream_close``."""
    with trio.CancelScope(shield=True), trio.move_on_after(FRAME_WRITE_DEADLINE):
        await _state["originals"]["NetStream.reset"](self)


# -- 2. swarm inbound slots -----------------------------------------------------------------------------------------


async def _wait_until_closed(swarm: Swarm, muxed_conn: IMuxedConn) -> None:
    """Return when ``muxed_conn`` has closed or the swarm has stopped, whichever is first."""
    async with trio.open_nursery() as nursery:

        async def first(wait: Callable[[], Awaitable[Any]]) -> None:
            await wait()
            nursery.cancel_scope.cancel()

        async def poll_closed() -> None:
            while not muxed_conn.is_closed:
                await trio.sleep(1.0)

        event = getattr(muxed_conn, "event_closed", None)
        nursery.start_soon(first, swarm.manager.wait_finished)
        nursery.start_soon(first, event.wait if isinstance(event, trio.Event) else poll_closed)


async def _do_handle_inbound_connection(self: Swarm, read_write_closer: Any, maddr: Any, failure_event: Any) -> None:
    """Upstream's method (swarm.py l. 2001-2073) with its two barriers waiting for the connection, not the swarm."""
    remote_maddr = self._build_remote_multiaddr(read_write_closer)
    if remote_maddr is not None:
        if not await self.connection_gate.is_allowed(remote_maddr):
            log.debug("Inbound connection from %s denied by connection gate", remote_maddr)
            try:
                await read_write_closer.close()
                failure_event.conn_incoming_error = True
                if self.metric_send_channel is not None:
                    await self.metric_send_channel.send(failure_event)
            except Exception:
                pass
            return

    if isinstance(read_write_closer, IMuxedConn):  # QUIC, WebTransport: already multiplexed
        try:
            muxed_conn = cast(IMuxedConn, read_write_closer)
            await self.add_conn(muxed_conn, direction="inbound")
            await _wait_until_closed(self, muxed_conn)  # upstream: await self.manager.wait_finished()
        except Exception:
            await read_write_closer.close()
            failure_event.conn_incoming_error = True
            if self.metric_send_channel is not None:
                await self.metric_send_channel.send(failure_event)
        return

    raw_conn = None
    try:
        raw_conn = RawConnection(read_write_closer, False)
        muxed_conn = await self.upgrade_inbound_raw_conn(raw_conn, maddr)
        # The listener closes the socket when this handler returns: stay until the connection is over.
        await _wait_until_closed(self, muxed_conn)  # upstream: await self.manager.wait_finished()
    except Exception as e:
        log.debug("Error handling incoming connection: %s", e)
        try:
            if raw_conn is not None:
                await raw_conn.close()
            else:
                await read_write_closer.close()
                failure_event.conn_incoming_error = True
                if self.metric_send_channel is not None:
                    await self.metric_send_channel.send(failure_event)
        except Exception:
            pass


# -- 4. handlers that raise ----------------------------------------------------------------------------------------


async def _swarm_stream_handler(self: BasicHost, net_stream: Any) -> None:
    original = _state["originals"]["BasicHost._swarm_stream_handler"]
    try:
        await original(self, net_stream)
    except Exception as exc:
        peer = getattr(getattr(net_stream, "muxed_conn", None), "peer_id", None)
        protocol = getattr(net_stream, "get_protocol", lambda: None)()
        log.info("a %s stream from %s failed in its handler (%s: %s); stream reset", protocol, peer,
                 type(exc).__name__, str(exc)[:200])  # fmt: skip
        try:
            await net_stream.reset()
        except Exception:
            pass


# -- 5. TCP and circuit addresses -----------------------------------------------------------------------------------


def _tcp_can_dial(self: TCP, maddr: Any) -> bool:
    """Upstream's check, and not a /p2p-circuit address (those go through a relay, not to the TCP endpoint)."""
    return not is_relayed_addr(maddr) and _state["originals"]["TCP.can_dial"](self, maddr)


# -- the table ------------------------------------------------------------------------------------------------------

REPORTS = Path(__file__).resolve().parents[2] / "docs" / "upstream"


@dataclass(frozen=True)
class Patch:
    """One fix of py-libp2p: what is wrong upstream, what we replace, where ours is, what shows the bug."""

    name: str  # docs/upstream/libp2p-<name>.md is the report to send upstream
    upstream: str  # the bug, in one line
    target: str  # the library's class.method (or module constant) that ours replaces or overrides
    ours: str  # where our replacement lives
    test: str  # tests/<file>.py::<test> reproducing the bug on stock py-libp2p (or, where noted, ours working)
    install: tuple[Any, str, Any] | None = None  # (owner, attribute, value) that apply() sets; None: a subclass

    @property
    def report(self) -> Path:
        return REPORTS / f"libp2p-{self.name}.md"


_T = "tests/test_libp2p_patches.py::"
PATCHES: tuple[Patch, ...] = (
    Patch(
        "yamux-read-loop-deadlock",
        "yamux's read loop awaits its own ACK/RST/pong and window-update writes: two peers pushing at once deadlock",
        "libp2p.stream_muxer.yamux.yamux.Yamux._handle_incoming_with_ready_signal, Yamux._write_frame",
        "node/libp2p/patches.py _handle_incoming_with_ready_signal, _write_frame, _ControlQueue",
        _T + "test_stock_yamux_deadlocks_when_both_peers_push",
        (_yamux.Yamux, "_handle_incoming_with_ready_signal", _handle_incoming_with_ready_signal),
    ),
    Patch(
        "yamux-read-loop-deadlock",
        "(the same bug: the write half of the fix)",
        "libp2p.stream_muxer.yamux.yamux.Yamux._write_frame",
        "node/libp2p/patches.py _write_frame",
        _T + "test_stock_yamux_deadlocks_when_both_peers_push",
        (_yamux.Yamux, "_write_frame", _write_frame),
    ),
    Patch(
        "yamux-cancelled-write",
        "a write cancelled once Noise encrypted it (its nonce spent) breaks the connection: the peer drops it silently",
        "libp2p.stream_muxer.yamux.yamux.Yamux._write_frame",
        "node/libp2p/patches.py _write_whole",
        _T + "test_stock_yamux_loses_the_connection_when_a_write_is_cancelled",
    ),
    Patch(
        "yamux-cancelled-close",
        "a stream closed in a cancelled scope (a DHT query past its deadline) keeps its backlog slot for good",
        "libp2p.stream_muxer.yamux.yamux.YamuxStream.close",
        "node/libp2p/patches.py _stream_close, _send_end",
        _T + "test_stock_yamux_keeps_the_slot_of_a_stream_closed_when_cancelled",
        (_yamux.YamuxStream, "close", _stream_close),
    ),
    Patch(
        "yamux-cancelled-close",
        "(the same bug: a reset)",
        "libp2p.stream_muxer.yamux.yamux.YamuxStream.reset",
        "node/libp2p/patches.py _stream_reset, _send_end",
        _T + "test_stock_yamux_keeps_the_slot_of_a_stream_closed_when_cancelled",
        (_yamux.YamuxStream, "reset", _stream_reset),
    ),
    Patch(
        "yamux-cancelled-close",
        "(the same bug: the stream's own bookkeeping and the swarm's stream count)",
        "libp2p.network.stream.net_stream.NetStream.close",
        "node/libp2p/patches.py _net_stream_close",
        _T + "test_stock_yamux_keeps_the_slot_of_a_stream_closed_when_cancelled",
        (NetStream, "close", _net_stream_close),
    ),
    Patch(
        "yamux-cancelled-close",
        "(the same bug: the stream's own bookkeeping, reset)",
        "libp2p.network.stream.net_stream.NetStream.reset",
        "node/libp2p/patches.py _net_stream_reset",
        _T + "test_stock_yamux_keeps_the_slot_of_a_stream_closed_when_cancelled",
        (NetStream, "reset", _net_stream_reset),
    ),
    Patch(
        "inbound-slots-held",
        "an inbound connection's limiter slot is released only when the whole swarm stops",
        "libp2p.network.swarm.Swarm._do_handle_inbound_connection",
        "node/libp2p/patches.py _do_handle_inbound_connection",
        _T + "test_stock_swarm_keeps_inbound_slots_of_closed_connections",
        (Swarm, "_do_handle_inbound_connection", _do_handle_inbound_connection),
    ),
    Patch(
        "handler-exception-kills-host",
        "an exception escaping any stream handler (gossipsub's DecodeError) stops the whole host",
        "libp2p.host.basic_host.BasicHost._swarm_stream_handler",
        "node/libp2p/patches.py _swarm_stream_handler",
        _T + "test_stock_node_dies_of_one_malformed_gossip_rpc",
        (BasicHost, "_swarm_stream_handler", _swarm_stream_handler),
    ),
    Patch(
        "tcp-dials-circuit-addrs",
        "TCP.can_dial claims /p2p-circuit addresses; the failed dial clears all the peer's addresses",
        "libp2p.transport.tcp.tcp.TCP.can_dial",
        "node/libp2p/patches.py _tcp_can_dial",
        _T + "test_stock_tcp_claims_circuit_addresses",
        (TCP, "can_dial", _tcp_can_dial),
    ),
    Patch(
        "yamux-frame-splits-noise",
        "a full yamux frame (65,536 B) is 17 B over Noise's largest plaintext: every frame is two Noise messages",
        "libp2p.stream_muxer.yamux.yamux.MAX_MESSAGE_SIZE",
        "node/libp2p/patches.py NOISE_FIT_FRAME",
        _T + "test_stock_yamux_frame_does_not_fit_one_noise_message",
        (_yamux, "MAX_MESSAGE_SIZE", NOISE_FIT_FRAME),
    ),
    Patch(
        "yamux-credit-every-read",
        "yamux credits the sender's window after every read, not at half the window: a window update per data frame",
        "libp2p.stream_muxer.yamux.yamux.YamuxStream._auto_tune_and_send_window_update",
        "node/libp2p/credit.py credit_at_half_window",
        _T + "test_stock_yamux_sends_a_window_update_per_read",
        (_yamux.YamuxStream, "_auto_tune_and_send_window_update", credit_at_half_window),
    ),
    Patch(
        "inbound-no-admission",
        "inbound connections get a slot or are closed: idle identities lock newcomers out, no per-address cap",
        "libp2p.network.swarm.Swarm._handle_inbound_connection",
        "node/libp2p/conns.py _handle_inbound_connection (node/connmgr.py ConnManager decides)",
        "tests/test_connmgr.py::test_stock_idle_identities_lock_out_a_newcomer",
        (Swarm, "_handle_inbound_connection", _handle_inbound_connection),
    ),
    Patch(
        "autonat-existing-connection",
        "the AutoNAT server dials back with host.connect, which reuses the connection the request came on",
        "libp2p.host.autonat.autonat.AutoNATService._try_dial",
        "node/libp2p/nat.py DialBack._try_dial",
        _T + "test_stock_autonat_dial_back_reuses_the_existing_connection",
    ),
    Patch(
        "autonat-observed-ip",
        "the AutoNAT server dials only advertised addresses whose IP is the observed one: NATed nodes never are",
        "libp2p.host.autonat.autonat.AutoNATService._filter_by_observed_ip",
        "node/libp2p/nat.py DialBack._filter_by_observed_ip",
        _T + "test_stock_autonat_never_dials_a_node_listening_on_a_private_address",
    ),
    Patch(
        "autonat-claimed-peer",
        "the AutoNAT server dials back whatever peer id a request names, not the requester, and limits nothing",
        "libp2p.host.autonat.autonat.AutoNATService.handle_stream, AutoNATService._handle_dial",
        "node/libp2p/nat.py DialBack.handle_stream, DialBack.answer (node/reachability.py DialBacks: the limits)",
        "tests/test_nat_limits.py::test_stock_autonat_dials_back_any_peer_id_a_request_names",
    ),
    Patch(
        "relay-reserve-claimed-peer",
        "circuit relay v2 books a RESERVE for the peer id the message names: one peer can take every slot",
        "libp2p.relay.circuit_v2.protocol.CircuitV2Protocol._handle_reserve",
        "node/libp2p/nat.py RelayHop._handle_reserve (node/reachability.py reservation_refusal decides)",
        "tests/test_nat_limits.py::test_stock_relay_books_reservations_for_claimed_peer_ids",
    ),
    Patch(
        "relay-yamux-eof",
        "circuit relay v2 treats a yamux stream's EOF as an unexpected error: logged, retried with sleeps, raised",
        "libp2p.relay.circuit_v2.protocol.CircuitV2Protocol._read_stream_with_retry",
        "node/libp2p/nat.py RelayHop._read_stream_with_retry",
        _T + "test_stock_relay_retries_a_yamux_eof",
    ),
    Patch(
        "dcutr-both-ends",
        "DCUtR's auto-drive starts a hole punch from both ends of a relayed pair at once; they race for one port",
        "libp2p.relay.circuit_v2.dcutr.DCUtRProtocol._auto_drive_loop",
        "node/libp2p/nat.py HolePuncher._auto_drive_loop (node/reachability.py HolePunch.should_drive decides)",
        "tests/test_nat.py::test_nat_swarm_converges_with_relays_and_hole_punching (ours working; root only)",
    ),
    Patch(
        "dcutr-stream-no-deadline",
        "DCUtR opens its stream to the peer with no deadline: over a relayed connection gone quiet it waits forever",
        "libp2p.relay.circuit_v2.dcutr.DCUtRProtocol._initiate_hole_punch_locked",
        "node/libp2p/nat.py HolePuncher._drive_one (each attempt within PUNCH_DEADLINE)",
        "tests/test_nat.py::test_a_hole_punch_whose_stream_never_opens_is_given_up_and_the_pair_freed",
    ),
    Patch(
        "dht-local-providers",
        "find_providers answers from the local provider store alone once it holds any record for the key",
        "libp2p.kad_dht.provider_store.ProviderStore.find_providers",
        "node/libp2p/access.py providers_from_peer (node/discovery.py asks the trusted peers too)",
        _T + "test_stock_find_providers_answers_from_the_local_store_alone",
    ),
    Patch(
        "dht-twenty-providers",
        "a provider store keeps the first 20 providers of a key for 48 h and answers every lookup with all of them",
        "libp2p.kad_dht.provider_store.ProviderStore.add_provider",
        "node/libp2p/providers.py add_provider (make_room decides)",
        _T + "test_stock_provider_store_keeps_the_first_twenty_providers_only",
        (ProviderStore, "add_provider", add_provider),
    ),
    Patch(
        "dht-twenty-providers",
        "(the same bug: the answering half of the fix)",
        "libp2p.kad_dht.provider_store.ProviderStore.get_providers",
        "node/libp2p/providers.py get_providers (answer_sample decides)",
        _T + "test_stock_provider_store_keeps_the_first_twenty_providers_only",
        (ProviderStore, "get_providers", get_providers),
    ),
    Patch(
        "dht-refresh-unanswered",
        "the routing-table refresh walks for a key in every non-empty bucket even when no peer answered a walk before",
        "libp2p.kad_dht.peer_routing.PeerRouting.refresh_routing_table",
        "node/libp2p/routing.py refresh_routing_table (go_on decides)",
        _T + "test_stock_refresh_walks_every_bucket_when_no_peer_answers",
        (PeerRouting, "refresh_routing_table", refresh_routing_table),
    ),
    Patch(
        "dht-refresh-unanswered",
        "(the same bug: the half of the fix that counts a walk's answers)",
        "libp2p.kad_dht.peer_routing.PeerRouting._query_peer_for_closest",
        "node/libp2p/routing.py count_answers",
        _T + "test_stock_refresh_walks_every_bucket_when_no_peer_answers",
        (PeerRouting, "_query_peer_for_closest", count_answers),
    ),
    Patch(
        "dial-one-address",
        "dial_peer tries one address per transport (the peerstore's first), then refuses the peer for 60 s",
        "libp2p.network.swarm.Swarm.dial_peer",
        "node/host.py Swarm._dial (each given address in turn, with the public Swarm.dial_addr)",
        "tests/test_swarm_discovery.py::test_a_peer_that_moved_is_dialled_at_its_new_addresses_at_once (ours working)",
    ),
)

# Private names read or set without fixing a bug (no public API for them in 0.8.1): an upgrade checks each still exists.
INTERNALS: tuple[tuple[str, str], ...] = (
    ("BasicHost._swarm_stream_handler", "access.inbound_stream_entry: the allow-list gate wraps it"),
    ("BasicHost._addrs_factory", "nat.advertise: reachability picks the advertised addresses after the host exists"),
    ("kad_dht._encode_key", "access.providers_from_peer, access.provide_to_peer"),
    ("KadDHT._inbound_limiter", "access.set_dht_handlers, access.dht_slots"),
    ("CircuitV2Transport._make_reservation, ._reservations", "nat.RelayClient.reserve_on"),
    ("RelayResourceManager._reservations", "nat.RelayHop.reservations"),
    ("DCUtRProtocol._hole_punch_attempts, ._in_progress, ._nursery", "nat.HolePuncher"),
    ("AutoNATService._observed_ip, autonat._is_relayed_stream", "nat.DialBack.handle_stream, nat.observed_ip"),
    ("RelayResourceManager._clean_expired, ._is_peer_connected", "nat.RelayHop.holders"),
    ("CircuitV2Protocol._send_status", "nat.RelayHop._handle_reserve: a refusal"),
    ("CircuitV2Protocol._handle_connect", "nat.RelayHop: counts circuits"),
    ("Swarm._inbound_limiter, .common_stream_handler", "conns.attach_admission, conns.cap_unnegotiated"),
    ("Yamux._ping_sent_time, ._ping_event", "conns.ping_state: node/connmgr.py closes connections gone silent"),
    ("Yamux.secured_conn.read", "_stamp_reads: conns.last_read, when the read loop last read from the connection"),
    (
        "SecureSession.conn, NoiseTransportReadWriter.read_writer, .read_write_closer, RawConnection.stream, "
        "TrioTCPStream.stream",
        "conns.kernel_min_rtt: the TCP socket under a connection, for its RTT",
    ),
    ("DCUtRProtocol._try_unilateral_upgrade, ._perform_hole_punch", "nat.HolePuncher: reports outcomes"),
)
# the classes those overrides and reads belong to (a rename upstream fails an import here, not at run time)
_OVERRIDDEN = (AutoNATService, CircuitV2Protocol, DCUtRProtocol, ProviderStore)


def _installed() -> tuple[Patch, ...]:
    return tuple(p for p in PATCHES if p.install is not None)


def _key(patch: Patch) -> str:
    owner, attr, _ = patch.install  # type: ignore[misc]
    return f"{owner.__name__.rsplit('.', 1)[-1]}.{attr}"


def apply() -> None:
    """Install the in-place fixes (idempotent; a no-op inside ``disabled()``)."""
    if _state["applied"] or _state["suppressed"]:
        return
    check_version()
    originals = _state["originals"]
    for patch in _installed():
        owner, attr, value = patch.install  # type: ignore[misc]
        current = vars(owner)[attr]
        if current is not value:  # never record a replacement as the original
            originals[_key(patch)] = current
        setattr(owner, attr, value)
    _state["applied"] = True


def unapply() -> None:
    """Restore py-libp2p's own methods. Connections started while patched keep running their read-loop wrapper."""
    if not _state["applied"]:
        return
    for patch in _installed():
        owner, attr, _ = patch.install  # type: ignore[misc]
        setattr(owner, attr, _state["originals"][_key(patch)])
    _state["applied"] = False


def is_applied() -> bool:
    return bool(_state["applied"])


@contextmanager
def disabled() -> Iterator[None]:
    """Stock py-libp2p inside the block (``apply()`` calls are ignored there); the previous state after it."""
    was = is_applied()
    unapply()
    _state["suppressed"] += 1
    try:
        yield
    finally:
        _state["suppressed"] -= 1
        if was:
            apply()
