"""Connection admission in py-libp2p 0.8.1: the hooks node/connmgr.py's ``ConnManager`` acts through.

- patch ``inbound-no-admission`` (``_handle_inbound_connection``): upstream's ``Swarm._handle_inbound_connection``
  (network/swarm.py l. 1947-1999) takes one of ``_inbound_limiter``'s slots for every accepted TCP connection and
  closes the socket unanswered when none is free. Nothing frees a slot but the end of the connection holding it
  (patch ``inbound-slots-held`` made that happen at all), and nothing caps how many come from one address: idle
  connections of any identities lock newcomers out for as long as they are held. Ours is upstream's method with
  an ``Admission`` asked first when one is attached to the swarm (``attach_admission``): it may refuse the
  address, and when every slot is taken it may close a connection it picks and let the newcomer wait briefly for
  that slot. With none attached it does what upstream does.
- ``cap_unnegotiated``: wraps the swarm's entry for inbound streams (after the allow-list gate, if any) so the
  streams still negotiating their protocol are counted, per connection and in all, and one the manager refuses
  is reset on arrival and reported (py-libp2p bounds concurrent negotiations only for QUIC; each waits up to
  10 s for a peer that never speaks).
- ``library_limits``, ``stop_library_dialler``: py-libp2p's own connection manager, replaced by ours. Its
  ``AutoConnector`` dials peerstore peers (every one the DHT ever named) until a node holds (low + high watermark)
  / 2 = 200 connections: every node of a swarm under ~200 became connected to every other (bench/swarm_scale); its
  ``ConnectionPruner`` closes connections above the high watermark (300) down to the low one (100), blind to the
  peers we protect. Whom to dial is discovery's choice (node/discovery.py); whom to drop the manager's.
- ``ping_state``: yamux's keepalive (a ping every 30 s, ``Yamux._measure_rtt_loop``) never acts on a missing
  pong; this reads when the last ping went out and whether it was answered. ``last_read``: when the connection's
  read loop last read from it (stamped by patches.py's read loop).
- ``is_inbound``, ``remote_ip``: a connection's direction and the IP of its transport's remote end.
- ``path_rtt``: the round trip to a peer: the kernel's smallest on the TCP connection under it (Linux's
  ``TCP_INFO`` on the socket under Noise's packet reader and the raw connection: ``kernel_min_rtt``), else
  what yamux's keepalive measured (its ping's pong, smoothed). ``kernel_last_data``: when the kernel last received
  data on it, read or not.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import struct
from collections.abc import Callable
from typing import Any, Protocol

import trio
from libp2p.abc import INetConn, INetStream, INetwork, INotifee
from libp2p.metrics.swarm import SwarmEvent
from libp2p.network.config import ConnectionConfig
from libp2p.network.swarm import Swarm
from libp2p.peer.id import ID
from libp2p.rcmgr import Direction
from multiaddr import Multiaddr

log = logging.getLogger(__name__)

_ATTR = "_swarmrl_admission"


class Admission(Protocol):
    """What the patched inbound handler asks (node/connmgr.py ``ConnManager``)."""

    room_wait: float  # seconds a newcomer waits for the slot of a connection closed for it

    def reserve(self, ip: str | None) -> bool: ...  # False: refuse this address; True: counted until release()

    def release(self, ip: str | None) -> None: ...

    async def make_room(self) -> bool: ...  # close a connection so a slot frees up; False: none may go


def library_limits(max_connections: int) -> ConnectionConfig:
    """py-libp2p's connection config: ``max_connections`` in all; its pruner's trigger (the high watermark) at that
    same cap, so it never acts (no connection is over it); its dialler's floor at zero."""
    return ConnectionConfig(
        max_connections=max_connections, high_watermark=max_connections, low_watermark=0, min_connections=0
    )


async def stop_library_dialler(network: INetwork) -> None:
    """Stop py-libp2p's ``AutoConnector`` (started with the swarm; once stopped, its periodic and on-disconnect
    triggers return at once)."""
    swarm: Any = network
    await swarm.auto_connector.stop()


def attach_admission(network: INetwork, admission: Admission, max_inbound: int) -> None:
    """Ask ``admission`` about every inbound connection of this swarm, and hold at most ``max_inbound``."""
    swarm: Any = network
    limiter: trio.CapacityLimiter = swarm._inbound_limiter
    limiter.total_tokens = max(1, max_inbound)
    setattr(swarm, _ATTR, admission)


class _Upstream:
    """Upstream behaviour when no admission is attached: a slot if one is free, else refused."""

    room_wait = 0.0

    def reserve(self, ip: str | None) -> bool:
        return True

    def release(self, ip: str | None) -> None:
        pass

    async def make_room(self) -> bool:
        return False


_UPSTREAM = _Upstream()


async def _handle_inbound_connection(self: Swarm, read_write_closer: Any, maddr: Any) -> None:
    """Upstream's method (swarm.py l. 1947-1999) with the attached admission asked before a slot is taken."""
    if self.metric_send_channel is not None:
        incoming = SwarmEvent()
        incoming.conn_incoming = True
        await self.metric_send_channel.send(incoming)
    admission: Admission = getattr(self, _ATTR, None) or _UPSTREAM
    ip = remote_ip(read_write_closer)
    if not admission.reserve(ip):
        await _close_quietly(read_write_closer)
        return
    try:
        if not await _take_slot(self._inbound_limiter, admission):
            log.debug("inbound connection cap (%d) reached; refusing %s", int(self._inbound_limiter.total_tokens), ip)
            await _close_quietly(read_write_closer)
            return
        try:
            await self._do_handle_inbound_connection(read_write_closer, maddr, SwarmEvent())
        finally:
            self._inbound_limiter.release()
    finally:
        admission.release(ip)


async def _take_slot(limiter: trio.CapacityLimiter, admission: Admission) -> bool:
    try:
        limiter.acquire_nowait()  # no checkpoint between the check and the take
        return True
    except trio.WouldBlock:
        pass
    if not await admission.make_room():
        return False
    with trio.move_on_after(admission.room_wait):
        await limiter.acquire()
        return True
    return False


async def _close_quietly(read_write_closer: Any) -> None:
    try:
        await read_write_closer.close()
    except Exception:
        pass


def cap_unnegotiated(
    network: INetwork,
    decide: Callable[[int, int, int], str | None],
    refused: Callable[[INetConn | None, ID, str], None],
) -> None:
    """Ask ``decide(here, total, connections)`` about every inbound stream on arrival (``here``: streams of its
    connection still negotiating a protocol; ``total``: of every connection; ``connections``: how many have any);
    a verdict other than None resets the stream and tells ``refused`` (its swarm connection, its peer, the
    verdict). Wraps whatever entry the swarm has now (install the allow-list gate first)."""
    swarm: Any = network
    inner = swarm.common_stream_handler
    waiting: dict[int, set[INetStream]] = {}  # id(muxed connection) -> its streams not yet known to be negotiated

    def prune(pending: set[INetStream]) -> None:
        pending.difference_update([s for s in pending if s.get_protocol() is not None])

    async def capped(stream: INetStream) -> None:
        key = id(stream.muxed_conn)
        pending = waiting.get(key)
        if pending is None:
            pending = waiting[key] = set()
        else:  # negotiated since the last arrival: no longer counted
            prune(pending)
        verdict = decide(len(pending), *_totals(waiting))
        if verdict is not None:  # other connections' counts may be stale (too high): count again, then decide
            for other in waiting.values():
                prune(other)
            verdict = decide(len(pending), *_totals(waiting))
        if verdict is not None:
            if not pending and waiting.get(key) is pending:
                del waiting[key]
            refused(getattr(stream, "swarm_conn", None), stream.muxed_conn.peer_id, verdict)
            try:
                await stream.reset()
            except Exception:
                pass
            return
        pending.add(stream)
        try:
            await inner(stream)
        finally:
            pending.discard(stream)
            if not pending and waiting.get(key) is pending:
                del waiting[key]

    network.set_stream_handler(capped)


def _totals(waiting: dict[int, set[INetStream]]) -> tuple[int, int]:
    """(streams counted in all, connections with any counted)."""
    return sum(len(p) for p in waiting.values()), max(1, sum(1 for p in waiting.values() if p))


def ping_state(conn: INetConn) -> tuple[float, bool]:
    """(trio time the last keepalive ping went out, 0 if none; whether its pong came) of a yamux connection;
    (0, True) for a muxer without one."""
    muxed: Any = conn.muxed_conn
    sent_at = getattr(muxed, "_ping_sent_time", 0.0)
    event = getattr(muxed, "_ping_event", None)
    if not isinstance(sent_at, float) or not isinstance(event, trio.Event):
        return 0.0, True
    return sent_at, event.is_set()


# Linux's struct tcp_info (linux/tcp.h): tcpi_last_data_recv (ms ago) at byte 52, tcpi_min_rtt (us) at 148 (4.6+)
TCPI_LAST_DATA_RECV = 52
TCPI_MIN_RTT = 148
TCP_INFO_LEN = 152


def _tcp_info(conn: INetConn) -> bytes:
    """The kernel's struct tcp_info of the TCP socket under ``conn`` (b"": another OS, a relayed circuit)."""
    try:
        noise = conn.muxed_conn.secured_conn.conn  # type: ignore[attr-defined]
        sock = noise.read_writer.read_write_closer.stream.stream.socket
        return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_LEN)
    except Exception:
        return b""


def kernel_min_rtt(conn: INetConn) -> float:
    """Seconds: the smallest round trip the kernel measured on the TCP connection under ``conn`` (every ACK
    since the handshake; 0 where it cannot say: another OS, a relayed circuit)."""
    info = _tcp_info(conn)
    if len(info) < TCPI_MIN_RTT + 4:
        return 0.0
    return struct.unpack_from("I", info, TCPI_MIN_RTT)[0] / 1e6


def kernel_last_data(conn: INetConn, now: float) -> float:
    """Trio time (``now`` being the current one) at which the kernel last received data on the TCP connection under
    ``conn``, whether or not this process has read it yet (0: it cannot say). A starved event loop reads late; the
    kernel's clock says whether the peer is there."""
    info = _tcp_info(conn)
    if len(info) < TCPI_LAST_DATA_RECV + 4:
        return 0.0
    return now - struct.unpack_from("I", info, TCPI_LAST_DATA_RECV)[0] / 1e3


def path_rtt(network: INetwork, peer: ID) -> float:
    """Seconds: the smallest round trip to ``peer`` over its connections (0: none measured yet). The kernel's
    (from the handshake on, every ACK, the path's own delay) where it says, else yamux keepalive's (the first
    ping goes out 0.5 s after a connection starts, then one every 30 s, each averaged into the last: one ping
    answered late on a busy box moved it for a minute, and with it the origin's copies, 3 to 5 from one version
    to the next in bench/wan's small case). Measured here, so a peer can only make it longer."""
    rtts = []
    for conn in network.get_connections(peer):
        value = kernel_min_rtt(conn)
        if value <= 0:
            rtt = getattr(conn.muxed_conn, "rtt", None)
            value = rtt() if callable(rtt) else 0.0
        if isinstance(value, float) and value > 0:
            rtts.append(value)
    return min(rtts, default=0.0)


LAST_READ = "_swarmrl_last_read"  # on a yamux muxer: trio time of its read loop's last read (patches._stamp_reads)


def last_read(conn: INetConn) -> float:
    """Trio time the connection's read loop last read bytes from it (0: not known, a muxer it does not stamp)."""
    value = getattr(conn.muxed_conn, LAST_READ, 0.0)
    return value if isinstance(value, float) else 0.0


def is_inbound(conn: INetConn) -> bool:
    return getattr(conn, "direction", None) == Direction.INBOUND


def remote_ip(obj: Any) -> str | None:
    """The IP of the remote end of a raw, secured or muxed connection, or None (a relayed circuit, a pipe)."""
    try:
        remote = obj.get_remote_address()
        ip = remote[0] if remote else None
        return str(ipaddress.ip_address(ip)) if ip else None
    except Exception:
        return None


def network_of(stream: Any) -> Any:
    """The network (py-libp2p ``Swarm``) a stream belongs to, or None (a stream not opened by a swarm)."""
    return getattr(getattr(stream, "swarm_conn", None), "swarm", None)


class Notifee(INotifee):
    """A network notifee that ignores every event: subclasses override the ones they need (the library's
    interface makes each implement all six)."""

    async def connected(self, network: INetwork, conn: INetConn) -> None:
        pass

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        pass

    async def opened_stream(self, network: INetwork, stream: INetStream) -> None:
        pass

    async def closed_stream(self, network: INetwork, stream: INetStream) -> None:
        pass

    async def listen(self, network: INetwork, multiaddr: Multiaddr) -> None:
        pass

    async def listen_close(self, network: INetwork, multiaddr: Multiaddr) -> None:
        pass
