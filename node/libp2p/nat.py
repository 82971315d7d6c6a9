"""py-libp2p 0.8.1's AutoNAT, circuit relay v2 and DCUtR with our fixes: the subclasses that override its private
methods, and the reads of its private state that reachability needs. What to *do* with them (whom to ask, when to
reserve, which end drives a punch, how often) is node/reachability.py's; each fix is a row of ``patches.PATCHES``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import multiaddr
import trio
from libp2p.abc import IHost, INetStream
from libp2p.host.autonat.autonat import AutoNATService, _is_relayed_stream
from libp2p.host.autonat.pb.autonat_pb2 import Message
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.dcutr import MAX_HOLE_PUNCH_ATTEMPTS, DCUtRProtocol
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from libp2p.utils.varint import encode_varint_prefixed, read_varint_prefixed_bytes_limited

log = logging.getLogger(__name__)

MAX_READ = 1 << 16
DIAL_BACK_TARGETS = 4  # addresses one dial-back request may make us dial
MAX_AUTONAT_MESSAGE = 16 << 10  # a dial request: a peer id and its addresses (upstream reads up to 64 KiB)
AUTONAT_IO_TIMEOUT = 10.0  # to read a request, or write a reply
# one hole-punch attempt, start to end (patch dcutr-stream-no-deadline): a healthy one takes ~25 s at most (a 10 s
# direct dial, the CONNECT exchange, three 5 s rounds 2 s apart); upstream opens its stream with no deadline at all
PUNCH_DEADLINE = 60.0

__all__ = [
    "MAX_HOLE_PUNCH_ATTEMPTS",
    "DialBack",
    "HolePuncher",
    "RelayClient",
    "RelayHop",
    "conn_kind",
    "observed_ip",
]


def is_relayed_addr(addr: Any) -> bool:
    return "/p2p-circuit" in str(addr)


_KIND = "_swarmrl_kind"  # where conn_kind keeps a connection's kind


def conn_kind(conn: Any) -> str:
    """``relayed`` for a connection whose every transport address is a circuit, ``direct`` otherwise. Kept on the
    connection once read (its addresses do not change): printing a multiaddr costs ~10 us, and reachability asks
    for every connection every second (0.45 ms/s of a sampler host's loop at 30 connections)."""
    kind = getattr(conn, _KIND, None)
    if isinstance(kind, str):
        return kind
    try:
        addrs = conn.get_transport_addresses()
    except Exception:
        return "direct"
    kind = "relayed" if addrs and all(is_relayed_addr(a) for a in addrs) else "direct"
    try:
        setattr(conn, _KIND, kind)
    except AttributeError:  # a connection type with __slots__: read it each time
        pass
    return kind


class DialBack(AutoNATService):
    """AutoNAT v1 server and client. The server dials back the stream's authenticated peer only, at the IP its
    connection comes from, on a fresh connection, at most ``slots`` dials at once.

    Patches ``autonat-claimed-peer`` (``handle_stream``/``answer``: upstream dials whatever peer id the request
    names, and limits nothing), ``autonat-existing-connection`` (``_try_dial``) and ``autonat-observed-ip``
    (``_filter_by_observed_ip``). Whom to serve is the ``refusal``/``finished`` hooks' (node/reachability.py
    ``DialBacks``: per-peer, per-IP and queue limits); a refused request is answered E_DIAL_REFUSED, saying why, at
    once: nothing waits in an unbounded queue."""

    def __init__(self, host: IHost, every: float, timeout: float, slots: int = 4) -> None:
        super().__init__(host, serve=False)  # handler registered by Reachability (wrapped)
        self.every = every
        self.timeout = timeout  # one address
        self.deadline = 2 * timeout  # one request, all its addresses: how long it may hold a dial slot
        self.dials = 0  # addresses dialed back, all requests
        self._asked: dict[ID, float] = {}
        self._slots = trio.Semaphore(slots)

    def refusal(self, peer: ID, ip: str, cost: int) -> str | None:
        """Why ``peer`` (the stream's peer, seen at ``ip``) may not have ``cost`` addresses dialed back now, or None
        to admit the request (``finished`` is then called when it is over). Here: one per peer per ``every`` s."""
        now = time.monotonic()
        if now - self._asked.get(peer, -1e9) < self.every:
            return "asked too often"
        self._asked[peer] = now
        if len(self._asked) > 4096:
            self._asked = {p: t for p, t in self._asked.items() if now - t < self.every}
        return None

    def finished(self, peer: ID, ip: str) -> None:
        """An admitted request is over (answered, failed or cancelled)."""

    async def handle_stream(self, stream: INetStream) -> None:
        peer = stream.muxed_conn.peer_id
        try:
            with trio.fail_after(AUTONAT_IO_TIMEOUT):
                request = Message()
                request.ParseFromString(await read_varint_prefixed_bytes_limited(stream, MAX_AUTONAT_MESSAGE))
            response = await self.answer(request, peer, self._observed_ip(stream), _is_relayed_stream(stream))
            with trio.fail_after(AUTONAT_IO_TIMEOUT):
                await stream.write(encode_varint_prefixed(response.SerializeToString()))
        except Exception as exc:
            log.debug("autonat request from %s: %s: %s", peer, type(exc).__name__, exc)
        finally:
            try:
                await stream.close()
            except Exception:
                pass

    async def answer(self, request: Message, peer: ID, observed_ip: str | None, relayed: bool) -> Message:
        """The reply to ``request`` from ``peer``, the stream's authenticated peer (the only one ever dialed)."""
        if request.type != Message.DIAL:
            return _dial_response(Message.E_BAD_REQUEST, "unknown message type")
        if relayed:
            return _dial_response(Message.E_DIAL_REFUSED, "dial requests over relayed connections are refused")
        claimed = bytes(request.dial.peer.id)
        if claimed and claimed != peer.to_bytes():
            return _dial_response(Message.E_BAD_REQUEST, "peer id mismatch: only the requesting peer is dialed back")
        addrs = self._filter_by_observed_ip([bytes(a) for a in request.dial.peer.addrs], observed_ip)
        if observed_ip is None or not addrs:
            return _dial_response(Message.E_DIAL_REFUSED, "no TCP address to dial at the IP the request came from")
        why = self.refusal(peer, observed_ip, len(addrs))
        if why is not None:
            return _dial_response(Message.E_DIAL_REFUSED, why)
        try:
            dialed = await self._try_dial(peer, addrs)
        finally:
            self.finished(peer, observed_ip)
        if dialed is None:
            return _dial_response(Message.E_DIAL_ERROR, "all dials failed")
        response = _dial_response(Message.OK, "")
        response.dialResponse.addr = dialed
        return response

    @staticmethod
    def _filter_by_observed_ip(addrs: list[bytes], observed_ip: str | None) -> list[bytes]:
        """The requester's TCP ports, at the IP we see it at (never anyone else's IP); at most four."""
        if observed_ip is None:
            return []
        family = "ip6" if ":" in observed_ip else "ip4"
        out: list[bytes] = []
        for raw in addrs:
            try:
                port = multiaddr.Multiaddr(raw).value_for_protocol("tcp")
            except Exception:
                continue
            if not port:
                continue
            candidate = multiaddr.Multiaddr(f"/{family}/{observed_ip}/tcp/{port}").to_bytes()
            if candidate not in out:
                out.append(candidate)
        return out[:DIAL_BACK_TARGETS]

    async def _try_dial(self, peer_id: ID, addrs: list[bytes]) -> bytes | None:
        network = self.host.get_network()
        async with self._slots:
            with trio.move_on_after(self.deadline):
                for raw in addrs:
                    self.dials += 1
                    try:
                        with trio.fail_after(self.timeout):
                            conn = await network.dial_addr(multiaddr.Multiaddr(raw), peer_id)
                    except Exception as exc:
                        log.debug("dial-back to %s at %s failed: %s", peer_id, multiaddr.Multiaddr(raw), exc)
                        continue
                    try:
                        await conn.close()
                    except Exception:
                        pass
                    return raw
        return None


def _dial_response(status: Any, text: str) -> Message:
    response = Message()
    response.type = Message.DIAL_RESPONSE
    response.dialResponse.status = status
    if text:
        response.dialResponse.statusText = text
    return response


def observed_ip(stream: INetStream) -> str | None:
    """The IP ``stream``'s connection comes from (normalized), or None where there is none (a relayed one)."""
    return AutoNATService._observed_ip(stream)


class RelayHop(CircuitV2Protocol):
    """Circuit relay v2, counting what it carries; a yamux EOF ends a circuit direction quietly (patch
    ``relay-yamux-eof``). A reservation is booked for the stream's authenticated peer, whatever peer the RESERVE
    names (patch ``relay-reserve-claimed-peer``), if the ``refuse_reservation`` hook admits it (node/reachability.py
    ``Relay``: one per peer, a few per IP); a reservation whose peer has disconnected frees its slot (the spec: a
    reservation is valid only while its peer stays connected)."""

    def __init__(self, host: IHost, limits: RelayLimits, allow_hop: bool) -> None:
        super().__init__(host, limits=limits, allow_hop=allow_hop)
        self.bytes_relayed = 0
        self.circuits = 0
        self.refused = 0  # reservations refused by refuse_reservation
        self._ips: dict[ID, str | None] = {}  # the IP each reservation was made from

    @property
    def reservations(self) -> int:
        """Reservations this relay holds for others now."""
        return len(self.resource_manager._reservations)

    def refuse_reservation(self, peer: ID, ip: str | None, holders: Mapping[ID, str | None]) -> str | None:
        """Why ``peer`` (the stream's peer, seen at ``ip``) may not hold a reservation now, or None to book it (or
        renew its own). ``holders``: the peers holding a live reservation now, with the IP each reserved from."""
        return None

    def holders(self) -> dict[ID, str | None]:
        """The peers holding a live reservation, with their IPs; expired ones and those of departed peers go first."""
        manager = self.resource_manager
        manager._clean_expired()
        for peer in list(manager._reservations):
            if not manager._is_peer_connected(peer):
                del manager._reservations[peer]
        self._ips = {peer: self._ips.get(peer) for peer in manager._reservations}
        return dict(self._ips)

    async def _handle_reserve(self, stream: INetStream, msg: Any) -> None:
        peer = stream.muxed_conn.peer_id
        ip = observed_ip(stream)
        why = self.refuse_reservation(peer, ip, self.holders())
        if why is not None:
            self.refused += 1
            log.debug("relay reservation for %s at %s refused: %s", peer, ip, why)
            await self._send_status(stream, StatusCode.RESOURCE_LIMIT_EXCEEDED, why)
            return
        msg.ClearField("peer")  # upstream then books the stream's own peer (it booked any id the message named)
        self._ips[peer] = ip
        await super()._handle_reserve(stream, msg)
        if peer not in self.resource_manager._reservations:
            self._ips.pop(peer, None)

    async def _read_stream_with_retry(self, stream: INetStream, max_retries: int = 0) -> bytes | None:
        try:
            data = await stream.read(MAX_READ)
        except Exception:
            return None
        if not data:
            return None
        self.bytes_relayed += len(data)
        return data

    async def _handle_connect(self, stream: INetStream, msg: Any) -> None:
        self.circuits += 1
        await super()._handle_connect(stream, msg)


class RelayClient(CircuitV2Transport):
    """Dials circuits, and reserves a slot at a relay when asked to (py-libp2p has no public call for that)."""

    async def reserve_on(self, stream: INetStream, relay: ID) -> float | None:
        """Reserve a slot at ``relay`` over ``stream`` (a HOP stream to it): when the reservation expires (unix
        time), or None when the relay said no."""
        if not await self._make_reservation(stream, relay):
            return None
        return float(self._reservations.get(relay, time.time() + 600))


class HolePuncher(DCUtRProtocol):
    """DCUtR whose auto-drive starts a punch only where ``should_drive(peer)`` says so (patch ``dcutr-both-ends``:
    upstream drives every relayed pair from both ends at once), and which reports each outcome to hooks.

    Subclasses decide (``should_drive``) and count (``on_punch``, ``on_upgrade``); ``attempts`` and
    ``reset_attempts`` give them the library's per-peer attempt budget."""

    def should_drive(self, peer_id: ID) -> bool:
        """Whether this end starts a punch with ``peer_id`` now (asked for every connected peer but ourselves, in
        the auto-drive loop; a punch starts only if the peer is then reached through relays alone)."""
        return True

    def on_punch(self, peer_id: ID, ok: bool) -> None:
        pass

    def on_upgrade(self, peer_id: ID) -> None:
        pass

    def attempts(self, peer_id: ID) -> int:
        """Hole punches tried with ``peer_id`` in a row (the library stops at ``MAX_HOLE_PUNCH_ATTEMPTS``)."""
        return self._hole_punch_attempts.get(peer_id, 0)

    def reset_attempts(self, peer_id: ID) -> None:
        self._hole_punch_attempts[peer_id] = 0

    async def _auto_drive_loop(self) -> None:
        while True:
            await trio.sleep(2.0)
            network = self.host.get_network()
            for peer_id, conns in list((getattr(network, "connections", {}) or {}).items()):
                if peer_id == self.host.get_id() or peer_id in self._in_progress or not self.should_drive(peer_id):
                    continue
                conns = conns if isinstance(conns, list) else [conns]
                kinds = [conn_kind(c) for c in conns]
                if not kinds or any(k == "direct" for k in kinds):
                    continue
                assert self._nursery is not None
                self._nursery.start_soon(self._drive_one, peer_id)

    async def _drive_one(self, peer_id: ID) -> None:
        """One attempt, within ``PUNCH_DEADLINE`` (patch ``dcutr-stream-no-deadline``: upstream's stream open over a
        relayed connection that went quiet waited 9 minutes, and the pair, marked in progress, got no other try)."""
        try:
            with trio.move_on_after(PUNCH_DEADLINE) as bounded:
                await self.initiate_hole_punch(peer_id)
        except Exception as exc:
            log.debug("hole punch with %s failed: %s", peer_id, exc)
            return
        if bounded.cancelled_caught:
            log.info("hole punch with %s: no end within %.0f s, given up", peer_id, PUNCH_DEADLINE)
            self.on_punch(peer_id, False)

    async def _try_unilateral_upgrade(self, peer_id: ID) -> bool:
        ok = await super()._try_unilateral_upgrade(peer_id)
        if ok:
            self.on_upgrade(peer_id)
        return ok

    async def _perform_hole_punch(self, peer_id: ID, addrs: list[multiaddr.Multiaddr], as_responder: bool = False):
        ok = await super()._perform_hole_punch(peer_id, addrs, as_responder=as_responder)
        self.on_punch(peer_id, ok)
        return ok


def advertise(
    host: IHost,
    addrs_factory: Callable[[Sequence[multiaddr.Multiaddr]], list[multiaddr.Multiaddr]],
    extra: Callable[[], list[multiaddr.Multiaddr]],
) -> None:
    """Make ``host`` advertise what ``addrs_factory`` picks from its candidate addresses, plus ``extra()`` (circuit
    addresses: ``BasicHost.get_addrs`` strips everything from a factory's first /p2p/ on, so they are appended
    after it). Identify and the DHT's provider records read ``host.get_addrs``."""
    host._addrs_factory = addrs_factory  # type: ignore[attr-defined]  # new_host takes one, but before we exist
    stock = host.get_addrs

    def get_addrs() -> list[multiaddr.Multiaddr]:
        return list(stock()) + extra()

    host.get_addrs = get_addrs  # type: ignore[method-assign]
