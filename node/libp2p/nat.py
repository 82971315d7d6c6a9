"""py-libp2p 0.8.1's AutoNAT, circuit relay v2 and DCUtR with our fixes: the subclasses that override its private
methods, and the reads of its private state that reachability needs. What to *do* with them (whom to ask, when to
reserve, which end drives a punch, how often) is node/reachability.py's; each fix is a row of ``patches.PATCHES``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import multiaddr
import trio
from libp2p.abc import IHost, INetStream
from libp2p.host.autonat.autonat import AutoNATService
from libp2p.host.autonat.pb.autonat_pb2 import Message
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.dcutr import MAX_HOLE_PUNCH_ATTEMPTS, DCUtRProtocol
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.transport import CircuitV2Transport

log = logging.getLogger(__name__)

MAX_READ = 1 << 16
DIAL_BACK_TARGETS = 4  # addresses one dial-back request may make us dial

__all__ = ["MAX_HOLE_PUNCH_ATTEMPTS", "DialBack", "HolePuncher", "RelayClient", "RelayHop", "conn_kind"]


def is_relayed_addr(addr: Any) -> bool:
    return "/p2p-circuit" in str(addr)


def conn_kind(conn: Any) -> str:
    """``relayed`` for a connection whose every transport address is a circuit, ``direct`` otherwise."""
    try:
        addrs = conn.get_transport_addresses()
    except Exception:
        return "direct"
    return "relayed" if addrs and all(is_relayed_addr(a) for a in addrs) else "direct"


class DialBack(AutoNATService):
    """AutoNAT v1 server and client; the server dials a *fresh* connection to the requester's observed IP.

    Patches ``autonat-existing-connection`` (``_try_dial``) and ``autonat-observed-ip`` (``_filter_by_observed_ip``);
    ``_handle_dial`` answers one request per peer per ``every`` seconds (a dial costs us a TCP connect and a Noise
    handshake)."""

    def __init__(self, host: IHost, every: float, timeout: float) -> None:
        super().__init__(host, serve=False)  # handler registered by Reachability (wrapped)
        self.every = every
        self.timeout = timeout
        self._asked: dict[ID, float] = {}
        self._slots = trio.Semaphore(4)

    async def _handle_dial(self, message: Message, observed_ip: str | None, is_relayed: bool) -> Message:
        peer = ID(message.dial.peer.id)
        now = time.monotonic()
        if now - self._asked.get(peer, -1e9) < self.every:
            response = Message()
            response.type = Message.DIAL_RESPONSE
            response.dialResponse.status = Message.E_DIAL_REFUSED
            response.dialResponse.statusText = "asked too often"
            return response
        self._asked[peer] = now
        if len(self._asked) > 4096:
            self._asked = {p: t for p, t in self._asked.items() if now - t < self.every}
        return await super()._handle_dial(message, observed_ip, is_relayed)

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
            for raw in addrs:
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


class RelayHop(CircuitV2Protocol):
    """Circuit relay v2, counting what it carries; a yamux EOF ends a circuit direction quietly (patch
    ``relay-yamux-eof``)."""

    def __init__(self, host: IHost, limits: RelayLimits, allow_hop: bool) -> None:
        super().__init__(host, limits=limits, allow_hop=allow_hop)
        self.bytes_relayed = 0
        self.circuits = 0

    @property
    def reservations(self) -> int:
        """Reservations this relay holds for others now."""
        return len(self.resource_manager._reservations)

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
        try:
            await self.initiate_hole_punch(peer_id)
        except Exception as exc:
            log.debug("hole punch with %s failed: %s", peer_id, exc)

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
