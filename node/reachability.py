"""Reachability: is this node dialable from the internet, and how peers behind NATs reach each other.

Three pieces, all on py-libp2p 0.8.1's own protocols (so other libp2p implementations interoperate):

1. **Dial-backs (AutoNAT v1, ``/libp2p/autonat/1.0.0``).** Every node answers dial-back requests and asks the
   trusted peers it knows (bootstrap nodes, the trainer) plus a few connected peers to dial it back. A node is
   ``public`` once a peer reached it on a fresh connection, ``private`` once at least two (or every one it
   could ask) failed to. ``swarmrl status`` shows it (``reachability``), and every change is logged.
2. **Circuit relay v2 (``/libp2p/circuit/relay/0.2.0/hop|stop``).** The trainer and bootstrap nodes, and any
   public node started with ``--relay``, accept reservations, with limits: ``relay_slots`` reservations at once,
   ``relay_circuit_bytes`` and ``relay_circuit_seconds`` per circuit (the relay resets a circuit that exceeds
   either). Public relays provide ``/swarmrl/<swarm>/relay`` in the DHT. A private node keeps reservations at
   two relays and advertises ``<relay addr>/p2p/<relay>/p2p-circuit/p2p/<me>`` among its addresses (identify,
   and the provider records it puts in the DHT), so a peer whose direct dial fails reaches it through a relay.
3. **Hole punching (DCUtR, ``/libp2p/dcutr``).** A relayed connection is upgraded to a direct one: both sides
   dial each other's observed address from their listen port at once (TCP simultaneous open), which gets
   through endpoint-independent ("cone") NATs. Symmetric NATs give every connection a new outside port, so the
   punch fails there and the pair stays relayed (control traffic only: see ``Swarm.chunk_peers``).

What py-libp2p 0.8.1 gets wrong, and what we do about it (each a row of node/libp2p/patches.py ``PATCHES``, the
mechanics in node/libp2p/nat.py; measured in tests/test_nat.py and tests/test_libp2p_patches.py):

- autonat-existing-connection: the AutoNAT server dials back with ``host.connect``, which returns at once when a
  connection to the peer exists, and the request itself arrives on one: every node was told it is reachable.
  ``DialBack`` dials a fresh connection (``Swarm.dial_addr``), checks the peer id (the Noise handshake does), then
  closes it.
- autonat-claimed-peer: the AutoNAT server dials the peer id a request *names*, and limits nothing: one identity
  naming made-up ids had a trainer dial 44 ports of its choosing while an honest request waited > 50 s in an
  unbounded queue. ``DialBack`` serves only the stream's authenticated peer (a request naming another id is
  E_BAD_REQUEST); ``DialBacks`` admits a request by ``dial_back_refusal`` (one per peer per ``DIAL_BACK_EVERY``,
  ``DIAL_BACKS_PER_IP`` pending and ``DIAL_BACK_IP_RATE`` addresses a second per IP, ``DIAL_BACK_QUEUE`` pending
  in all) and refuses the rest at once, saying why; a request holds a dial slot for two dial timeouts at most.
- relay-reserve-claimed-peer: circuit relay v2 books a RESERVE for the peer id the message names: one identity held
  all 64 slots with made-up ids. ``RelayHop`` books the stream's peer; ``Relay`` admits by
  ``reservation_refusal`` (one per peer, ``relay_slots_per_ip`` per IP); a departed peer's reservation frees its
  slot.
- autonat-observed-ip: the AutoNAT server dials only addresses whose IP equals the requester's observed IP, so a
  node listening on a private or wildcard address (every node behind a NAT) is never dialed at all. ``DialBack``
  dials the observed IP at the advertised TCP ports instead (the same anti-amplification rule: it never dials
  anyone else's IP).
- tcp-dials-circuit-addrs: ``TCP.can_dial`` accepts ``/ip4/../tcp/../p2p/R/p2p-circuit/p2p/B`` (it only looks for
  "tcp"): the swarm then dials the relay expecting B, fails with a peer id mismatch and *clears all of B's
  addresses*. ``node.libp2p.install`` makes TCP refuse circuit addresses; circuits are dialed by
  ``Reachability.dial_relayed`` only.
- relay-yamux-eof: circuit relay v2's stream reader treats a yamux EOF as an unexpected error (it knows only
  mplex's) and retries it with sleeps; ``RelayHop`` reads once and counts the bytes it relays.
- dcutr-both-ends: DCUtR's auto-drive starts a hole punch from *both* ends of every relayed connection at once;
  two sessions then race for the same source port. ``HolePunch.should_drive`` lets one end drive (the lower peer
  id), like the spec's "the peer that accepted the relayed connection".
- dcutr-stream-no-deadline: DCUtR opens its stream with no deadline; over a relayed connection gone quiet it waited
  9 minutes in the NAT lab, the pair marked in progress and given no other attempt. ``HolePuncher`` bounds each
  attempt (``PUNCH_DEADLINE``) and counts one that runs out as failed.
- ``CircuitV2Transport.dial`` with the CLIENT role reserves a slot at the relay before every dial; dials here use
  a transport without that role, and reservations are made only by a private node for itself.
"""

from __future__ import annotations

import ipaddress
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import multiaddr
import trio
from libp2p.abc import IHost, INetStream
from libp2p.host.autonat.autonat import AUTONAT_PROTOCOL_ID
from libp2p.host.autonat.pb.autonat_pb2 import Message
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL_ID
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.tools.anyio_service import background_trio_service

from node.config import SwarmSettings
from node.discovery import DhtNode, find_role, provide_forever, role_key
from node.libp2p import (
    MAX_HOLE_PUNCH_ATTEMPTS,
    DialBack,
    HolePuncher,
    RelayClient,
    RelayHop,
    advertise,
    conn_kind,
    is_relayed_addr,
)

log = logging.getLogger(__name__)

PUBLIC, PRIVATE, UNKNOWN = "public", "private", "unknown"
DIAL_BACK_TIMEOUT = 5.0  # seconds for one dial-back (a NAT drops the SYN: no answer ever comes)
DIAL_BACK_EVERY = 5.0  # a peer may ask us for a dial-back this often
QUERY_TIMEOUT = 15.0
RELAYS_WANTED = 2
CHECK_CAP = 16  # x the check interval: the longest between dial-back checks while the verdict holds (16 min at 60 s)
DIRECT_DIAL_TIMEOUT = 4.0  # before falling back to a relay
PUNCH_RETRY_AFTER = 60.0  # seconds between rounds of hole-punch attempts for a pair that stays relayed
RELAYED_GRACE = 5.0  # a relayed connection is closed this long after a direct one to the same peer is up
RELAY_SLOTS_PER_IP = 4  # relay reservations held at once for peers at one IP (an IPv6 /64)
DIAL_BACK_SLOTS = 4  # dial-backs dialing at once
DIAL_BACK_QUEUE = 8  # dial-back requests admitted at once (dialing, or waiting for a slot); more: refused, "busy"
DIAL_BACKS_PER_IP = 2  # of those, from one IP (an IPv6 /64)
DIAL_BACK_IP_BURST = 8.0  # addresses dialed back at one IP: this many at once,
DIAL_BACK_IP_RATE = 0.2  # then this many a second (12 a minute)


# -- limits: whom the relay and the dial-back server serve (pure rules; the mechanics are node/libp2p/nat.py's) ----


def next_check(state: str, interval: float, held: int) -> float:
    """Seconds until the next dial-back check of our reachability: 3 s while it is unknown; once known, ``interval``,
    doubled for each check in a row that kept the verdict (``held``), up to ``CHECK_CAP`` x. Each check has up to
    4 peers dial us back, a new connection each (TCP, Noise, identify) closed at once: every node checking every
    60 s forever was most of the connections a sampler host opened and closed once settled (bench/swarm_scale, 64
    samplers). go-libp2p's AutoNAT re-checks every 15 min once confident, after 90 s when unsure."""
    if state == UNKNOWN:
        return 3.0
    return min(CHECK_CAP * interval, interval * 2 ** min(held, 16))


def ip_group(ip: str) -> str:
    """What per-IP limits count by: the IPv4 address, or the /64 an IPv6 address is in (one host's usual share:
    a peer with a /64 has 2^64 addresses to rotate through)."""
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return ip
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return str(addr.ipv4_mapped)
        return str(ipaddress.IPv6Network(f"{addr}/64", strict=False))
    return str(addr)


def reservation_refusal(
    peer: ID, ip: str | None, holders: Mapping[ID, str | None], slots: int, per_ip: int
) -> str | None:
    """Why ``peer`` (a RESERVE stream's authenticated peer, seen at ``ip``) may not hold a relay reservation now, or
    None. ``holders``: the peers holding a live reservation, with the IP each reserved from. A peer renews its own
    reservation (one per peer, whatever peer id a RESERVE names); a new one needs a free slot and fewer than
    ``per_ip`` reservations held from its IP."""
    if peer in holders:
        return None
    if ip is None:
        return "no IP to count the reservation against"
    group = ip_group(ip)
    if sum(1 for h in holders.values() if h is not None and ip_group(h) == group) >= per_ip:
        return f"{per_ip} reservations already held from {group}"
    if len(holders) >= slots:
        return f"all {slots} reservation slots taken"
    return None


@dataclass(frozen=True)
class DialBackLimits:
    """How much dial-back work peers may ask of this node (``dial_back_refusal`` applies them)."""

    every: float = DIAL_BACK_EVERY  # one request per peer this often
    queue: int = DIAL_BACK_QUEUE
    per_ip: int = DIAL_BACKS_PER_IP
    ip_burst: float = DIAL_BACK_IP_BURST
    ip_rate: float = DIAL_BACK_IP_RATE


def dial_back_refusal(
    *,
    since_asked: float | None,
    peer_pending: bool,
    ip_pending: int,
    pending: int,
    ip_tokens: float,
    cost: int,
    limits: DialBackLimits,
) -> str | None:
    """Why a dial-back request is refused now, or None: ``since_asked`` seconds since this peer's last admitted
    request (None: never), whether one of its requests is still pending, how many are pending from its IP and from
    everyone, the addresses its IP may still have dialed (``ip_tokens``) and how many this request names."""
    if peer_pending or (since_asked is not None and since_asked < limits.every):
        return f"asked too often: one dial-back per peer every {limits.every:g} s"
    if ip_pending >= limits.per_ip:
        return f"busy: {ip_pending} dial-backs pending from your IP"
    if ip_tokens < cost:
        return f"too many dial-backs to your IP: {limits.ip_rate * 60:g} addresses a minute"
    if pending >= limits.queue:
        return f"busy: {pending} dial-backs pending, try again later"
    return None


class DialBackGate:
    """The state ``dial_back_refusal`` reads, keyed on the stream's peer and its IP group (never on a peer id a
    request names), bounded: idle entries go once there are 4096."""

    def __init__(self, limits: DialBackLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.clock = clock
        self.pending = 0
        self.refused = 0
        self._asked: dict[ID, float] = {}
        self._peer_pending: set[ID] = set()
        self._ip_pending: dict[str, int] = {}
        self._buckets: dict[str, tuple[float, float]] = {}  # ip group -> (tokens, when)

    def _tokens(self, group: str, now: float) -> float:
        tokens, when = self._buckets.get(group, (self.limits.ip_burst, now))
        return min(self.limits.ip_burst, tokens + (now - when) * self.limits.ip_rate)

    def admit(self, peer: ID, ip: str, cost: int) -> str | None:
        """None and the request counted as pending (``release`` it when done), or why it is refused."""
        now, group = self.clock(), ip_group(ip)
        asked = self._asked.get(peer)
        tokens = self._tokens(group, now)
        why = dial_back_refusal(
            since_asked=None if asked is None else now - asked,
            peer_pending=peer in self._peer_pending,
            ip_pending=self._ip_pending.get(group, 0),
            pending=self.pending,
            ip_tokens=tokens,
            cost=cost,
            limits=self.limits,
        )
        if why is not None:
            self.refused += 1
            return why
        self._asked[peer] = now
        self._buckets[group] = (tokens - cost, now)
        self._peer_pending.add(peer)
        self._ip_pending[group] = self._ip_pending.get(group, 0) + 1
        self.pending += 1
        self._forget_idle(now)
        return None

    def release(self, peer: ID, ip: str) -> None:
        group = ip_group(ip)
        self._peer_pending.discard(peer)
        left = self._ip_pending.get(group, 0) - 1
        if left > 0:
            self._ip_pending[group] = left
        else:
            self._ip_pending.pop(group, None)
        self.pending = max(0, self.pending - 1)

    def _forget_idle(self, now: float) -> None:
        if len(self._asked) > 4096:
            self._asked = {p: t for p, t in self._asked.items() if now - t < self.limits.every}
        if len(self._buckets) > 4096:  # a full bucket is as good as none
            refill = self.limits.ip_burst / self.limits.ip_rate if self.limits.ip_rate > 0 else float("inf")
            self._buckets = {g: b for g, b in self._buckets.items() if now - b[1] < refill}


class DialBacks(DialBack):
    """The dial-back server with ``DialBackGate``'s limits."""

    def __init__(self, host: IHost, limits: DialBackLimits, timeout: float) -> None:
        super().__init__(host, every=limits.every, timeout=timeout, slots=DIAL_BACK_SLOTS)
        self.gate = DialBackGate(limits)

    def refusal(self, peer: ID, ip: str, cost: int) -> str | None:
        return self.gate.admit(peer, ip, cost)

    def finished(self, peer: ID, ip: str) -> None:
        self.gate.release(peer, ip)


class Relay(RelayHop):
    """The relay with ``reservation_refusal``'s limits: ``limits.max_reservations`` slots, ``per_ip`` per IP."""

    def __init__(self, host: IHost, limits: RelayLimits, allow_hop: bool, per_ip: int) -> None:
        super().__init__(host, limits, allow_hop=allow_hop)
        self.per_ip = per_ip

    def refuse_reservation(self, peer: ID, ip: str | None, holders: Mapping[ID, str | None]) -> str | None:
        return reservation_refusal(peer, ip, holders, self.limits.max_reservations, self.per_ip)


class HolePunch(HolePuncher):
    """Hole punching with one driver per relayed pair (the lower peer id), fresh attempt budgets for pairs that stay
    relayed, and a record of what each attempt gave."""

    def __init__(self, host: IHost) -> None:
        super().__init__(host, dial_timeout=6)
        self.punched: set[ID] = set()  # peers a hole punch connected us to directly
        self.upgraded: set[ID] = set()  # relayed peers that turned out directly dialable
        self.tried = 0
        self.failed = 0
        self.retries = 0  # fresh attempt budgets given to pairs that stayed relayed
        self._gave_up: dict[ID, float] = {}

    def should_drive(self, peer_id: ID) -> bool:
        """The lower peer id drives a pair (the other end would race it for the same port), within budget."""
        return str(peer_id) < str(self.host.get_id()) and self._may_try(peer_id)

    def _may_try(self, peer_id: ID) -> bool:
        """Up to ``MAX_HOLE_PUNCH_ATTEMPTS`` attempts in a row (the library's budget), then a pause of
        ``PUNCH_RETRY_AFTER`` and a fresh budget: a punch that failed because an end was too busy to dial in time
        gets another chance while the pair stays relayed, at a few small relayed messages a minute."""
        if self.attempts(peer_id) < MAX_HOLE_PUNCH_ATTEMPTS:
            self._gave_up.pop(peer_id, None)
            return True
        now = trio.current_time()
        gave_up = self._gave_up.setdefault(peer_id, now)
        if now - gave_up < PUNCH_RETRY_AFTER:
            return False
        del self._gave_up[peer_id]
        self.reset_attempts(peer_id)
        self.retries += 1
        return True

    def on_upgrade(self, peer_id: ID) -> None:
        self.upgraded.add(peer_id)

    def on_punch(self, peer_id: ID, ok: bool) -> None:
        self.tried += 1
        if ok:
            self.punched.add(peer_id)
            log.info("hole punch with %s succeeded: direct connection", peer_id)
        else:
            self.failed += 1
            log.info("hole punch with %s failed: staying relayed", peer_id)


# -- the node's reachability -------------------------------------------------------------------------------------


class Dialer(DhtNode, Protocol):
    """What reachability needs of its node (node/host.py's Swarm, which owns the Reachability): discovery's view,
    and a dial that goes through the allow-list and, failing a direct dial, a relay."""

    async def connect(self, info: PeerInfo, timeout: float = 10.0) -> None: ...


@dataclass(frozen=True)
class ReachOptions:
    """What a node does about reachability (node/runtime.py ``reach_options``: from the ``[swarm]`` knobs, whose
    defaults these are)."""

    swarm_name: str = SwarmSettings.swarm
    trusted: frozenset[ID] = frozenset()  # bootstrap peers and the trainer: asked for dial-backs, used as relays
    relay: bool = False  # offer relay reservations (when public)
    relay_slots: int = SwarmSettings.relay_slots
    relay_circuit_bytes: int = SwarmSettings.relay_circuit_bytes
    relay_circuit_seconds: int = SwarmSettings.relay_circuit_seconds
    relay_circuits_per_peer: int = 16
    relay_slots_per_ip: int = RELAY_SLOTS_PER_IP  # no [swarm] knob: loopback tests and labs set it here
    check_interval: float = SwarmSettings.reachability_interval
    provide_interval: float = SwarmSettings.provide_interval
    assume_public: bool = False  # trainer/bootstrap: serve as relays before the first verdict


@dataclass
class Reservation:
    relay: ID
    expires: float
    addrs: list[multiaddr.Multiaddr] = field(default_factory=list)


class Reachability:
    """Built by the Swarm that owns it (it dials through the swarm); ``running`` serves and checks."""

    def __init__(self, swarm: Dialer, options: ReachOptions) -> None:
        self.swarm = swarm
        self.host = swarm.host
        self.options = options
        self.state = UNKNOWN
        self.verdicts: dict[ID, bool] = {}
        self.reservations: dict[ID, Reservation] = {}
        limits = RelayLimits(
            duration=options.relay_circuit_seconds,
            data=options.relay_circuit_bytes,
            max_circuit_conns=options.relay_circuits_per_peer,
            max_reservations=options.relay_slots,
            reservation_ttl=600,
        )
        self.hop = Relay(self.host, limits, allow_hop=options.relay, per_ip=options.relay_slots_per_ip)
        self.client = RelayClient(self.host, self.hop, RelayConfig(roles=RelayRole.STOP, limits=limits))
        self.dialback = DialBacks(self.host, DialBackLimits(), timeout=DIAL_BACK_TIMEOUT)
        self.punch = HolePunch(self.host)
        self.first_seen: dict[ID, str] = {}  # peer -> how the first connection to it was made
        self.relayed_since: dict[ID, float] = {}
        self.relay_dials = 0
        self._changed = trio.Event()

    # -- addresses ------------------------------------------------------------------------------------------
    def addrs_factory(self, candidates: Sequence[multiaddr.Multiaddr]) -> list[multiaddr.Multiaddr]:
        """The direct addresses this node advertises: its listen addresses (observed ones too once public)."""
        listen = {str(a) for a in self.host.get_transport_addrs()}
        return [a for a in candidates if str(a) in listen or self.state == PUBLIC]

    def circuit_addrs(self) -> list[multiaddr.Multiaddr]:
        """A circuit address through every relay that holds a reservation for this node (``advertise`` appends
        them to ``host.get_addrs``: identify, DHT provider records)."""
        out: list[multiaddr.Multiaddr] = []
        now = time.time()
        for res in self.reservations.values():
            if res.expires > now:
                out += [
                    multiaddr.Multiaddr(f"{a}/p2p/{res.relay}/p2p-circuit/p2p/{self.swarm.peer_id}") for a in res.addrs
                ]
        return out

    def relayed_addrs(self) -> list[str]:
        return [str(a) for a in self.host.get_addrs() if is_relayed_addr(a)]

    # -- connections ----------------------------------------------------------------------------------------
    def kinds(self, peer: ID) -> list[str]:
        conns = self.host.get_network().get_connections(peer)
        return [conn_kind(c) for c in conns if not getattr(c, "is_closed", False)]

    def has_direct(self, peer: ID) -> bool:
        return "direct" in self.kinds(peer)

    def path(self, peer: ID) -> str:
        """direct, hole_punched or relayed: how this node is connected to ``peer`` now."""
        kinds = self.kinds(peer)
        if "direct" in kinds:
            return "hole_punched" if peer in self.punch.punched else "direct"
        return "relayed" if kinds else "none"

    async def dial_relayed(self, info: PeerInfo, timeout: float) -> None:
        """Connect to ``info.peer_id`` through one of the relays in its circuit addresses."""
        circuits = [a for a in info.addrs if is_relayed_addr(a)]
        random.shuffle(circuits)
        # a provider record may predate the peer's reservations: the trusted relays are worth a try too
        known = {str(a) for a in circuits}
        for relay in self.options.trusted:
            if relay in (info.peer_id, self.swarm.peer_id) or relay not in self.host.get_connected_peers():
                continue
            for a in self.host.get_peerstore().addrs(relay)[:1]:
                text = str(a).split("/p2p/")[0]
                addr = multiaddr.Multiaddr(f"{text}/p2p/{relay}/p2p-circuit/p2p/{info.peer_id}")
                if str(addr) not in known and not is_relayed_addr(a):
                    circuits.append(addr)
        if not circuits:
            raise ConnectionError(f"{info.peer_id} is not directly reachable and no relay is known")
        errors = []
        for addr in circuits:
            text = str(addr)
            if not text.rstrip("/").endswith(str(info.peer_id)):
                addr = multiaddr.Multiaddr(f"{text}/p2p/{info.peer_id}")
            try:
                with trio.fail_after(timeout):
                    await self.client.dial(addr)
                self.relay_dials += 1
                return
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
        raise ConnectionError(f"no relay got us to {info.peer_id}: {'; '.join(errors)[:300]}")

    # -- running --------------------------------------------------------------------------------------------
    def register(self) -> None:
        async def autonat(stream: INetStream) -> None:
            try:
                await self.dialback.handle_stream(stream)
            except Exception as exc:  # a handler that raises takes the host down (LIBP2P_NOTES trap 1)
                log.debug("autonat stream from %s: %s", stream.muxed_conn.peer_id, exc)

        self.host.set_stream_handler(AUTONAT_PROTOCOL_ID, autonat)
        advertise(self.host, self.addrs_factory, self.circuit_addrs)

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Serve dial-backs and relaying, check reachability and keep reservations while the block runs."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.run)
            try:
                yield
            finally:
                nursery.cancel_scope.cancel()

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        self.register()
        async with background_trio_service(self.hop), background_trio_service(self.punch):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._check_loop)
                nursery.start_soon(self._reserve_loop)
                nursery.start_soon(self._tidy_loop)
                if self.options.relay:
                    nursery.start_soon(self._provide_relay)
                task_status.started()

    def _set_state(self, state: str, why: str) -> None:
        if state != self.state:
            log.info("reachability: %s (%s)", state, why)
            self.state = state
            self._changed.set()
            self._changed = trio.Event()

    def _servers(self) -> list[ID]:
        connected = [p for p in self.host.get_connected_peers() if p != self.swarm.peer_id]
        trusted = [p for p in connected if p in self.options.trusted and self.has_direct(p)]
        others = [p for p in connected if p not in self.options.trusted and self.has_direct(p)]
        random.shuffle(others)
        return (trusted + others)[:4]

    async def _check_loop(self) -> None:
        held = 0
        while True:
            servers, before = self._servers(), self.state
            if servers:
                await self.check(servers)
            held = held + 1 if servers and self.state == before else 0
            await trio.sleep(next_check(self.state, self.options.check_interval, held))

    async def check(self, servers: list[ID]) -> str:
        addrs = [a.to_bytes() for a in self.host.get_transport_addrs()]

        async def ask(server: ID) -> None:
            try:
                status, _addr = await self.dialback.query_server(server, addrs, timeout=QUERY_TIMEOUT)
            except Exception as exc:
                log.debug("dial-back request to %s failed: %s", server, exc)
                return
            if status == Message.OK:
                self.verdicts[server] = True
            elif status == Message.E_DIAL_ERROR:
                self.verdicts[server] = False

        async with trio.open_nursery() as nursery:
            for server in servers:
                nursery.start_soon(ask, server)
        ok = sum(self.verdicts.values())
        failed = len(self.verdicts) - ok
        if ok:
            self._set_state(PUBLIC, f"dialed back by {ok} of {len(self.verdicts)} peers")
        elif failed >= min(2, len(servers)) and failed:
            self._set_state(PRIVATE, f"{failed} peers could not dial back; reserving relay slots")
        return self.state

    async def _reserve_loop(self) -> None:
        """While private: hold reservations at ``RELAYS_WANTED`` relays, renewed before they expire."""
        while True:
            if self.state != PRIVATE:
                await self._changed.wait()
                continue
            now = time.time()
            for relay, res in list(self.reservations.items()):
                if res.expires <= now or relay not in self.host.get_connected_peers():
                    del self.reservations[relay]
            fresh = [r for r, res in self.reservations.items() if res.expires - now > 120]
            if len(fresh) < RELAYS_WANTED:
                candidates = [p for p in self.options.trusted if p in self.host.get_connected_peers()]
                found = await find_role(self.swarm, role_key(self.options.swarm_name, "relay"), timeout=5.0)
                for info in found:
                    self.host.get_peerstore().add_addrs(info.peer_id, info.addrs, 600)
                    if info.peer_id not in candidates:
                        candidates.append(info.peer_id)
                for relay in candidates:
                    if len([r for r in self.reservations if r in fresh]) >= RELAYS_WANTED:
                        break
                    if relay in fresh or relay == self.swarm.peer_id:
                        continue
                    if await self.reserve(relay):
                        fresh.append(relay)
            await trio.sleep(10.0)

    async def reserve(self, relay: ID) -> bool:
        try:
            with trio.fail_after(10.0):
                if relay not in self.host.get_connected_peers():
                    await self.swarm.connect(self.host.get_peerstore().peer_info(relay))
                stream = await self.host.new_stream(relay, [HOP_PROTOCOL_ID])
                try:
                    expires = await self.client.reserve_on(stream, relay)
                finally:
                    await stream.close()
        except Exception as exc:
            log.debug("no reservation at %s: %s", relay, exc)
            return False
        if expires is None:
            return False
        addrs: list[multiaddr.Multiaddr] = []
        for a in self.host.get_peerstore().addrs(relay):
            text = str(a).split("/p2p/")[0]
            if is_relayed_addr(a) or "/ip4/0.0.0.0/" in text or ("/ip4/127." in text and not self._on_loopback()):
                continue
            if text not in {str(x) for x in addrs}:
                addrs.append(multiaddr.Multiaddr(text))
        if not addrs:
            log.info("reserved a slot at %s but know no address of it to advertise", relay)
            return False
        new = relay not in self.reservations
        self.reservations[relay] = Reservation(relay, expires, addrs[:2])
        if new:
            log.info("relay slot reserved at %s: reachable at %s", relay, ", ".join(self.relayed_addrs()))
        return True

    def _on_loopback(self) -> bool:
        return all("/ip4/127." in str(a) for a in self.host.get_transport_addrs())

    async def _provide_relay(self) -> None:
        while self.state != PUBLIC and not (self.options.assume_public and self.state == UNKNOWN):
            await self._changed.wait()
        log.info("offering relay reservations (%d slots)", self.options.relay_slots)
        await provide_forever(self.swarm, role_key(self.options.swarm_name, "relay"), self.options.provide_interval)

    async def _tidy_loop(self) -> None:
        """Record how each peer was first reached; close relayed connections once a direct one is up."""
        while True:
            now = trio.current_time()
            for peer in list(self.host.get_connected_peers()):
                kinds = self.kinds(peer)
                if peer not in self.first_seen and kinds:
                    self.first_seen[peer] = "relayed" if "direct" not in kinds else "direct"
                if "direct" in kinds and "relayed" in kinds:
                    since = self.relayed_since.setdefault(peer, now)
                    if now - since >= RELAYED_GRACE:
                        for conn in self.host.get_network().get_connections(peer):
                            if conn_kind(conn) == "relayed":
                                try:
                                    await conn.close()
                                except Exception:
                                    pass
                        self.relayed_since.pop(peer, None)
                else:
                    self.relayed_since.pop(peer, None)
            if len(self.first_seen) > 10_000:
                self.first_seen.clear()
            await trio.sleep(1.0)

    # -- reporting ------------------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        paths: dict[str, int] = {"direct": 0, "hole_punched": 0, "relayed": 0}
        by_peer: dict[str, str] = {}
        for peer in self.host.get_connected_peers():
            p = self.path(peer)
            if p in paths:
                paths[p] += 1
                by_peer[str(peer)] = p
        out: dict[str, Any] = {
            "reachability": self.state,
            "connections": paths,
            "peer_paths": by_peer,
            "relayed_addrs": self.relayed_addrs(),
            "relay_reservations": len(self.reservations),
            "hole_punches": {
                "tried": self.punch.tried,
                "failed": self.punch.failed,
                "retries": self.punch.retries,
                "punched": len(self.punch.punched),
                "direct_upgrades": len(self.punch.upgraded),
                "peers": sorted(str(p) for p in self.punch.punched)[:64],  # every peer a punch ever connected us to
            },
            "relay_dials": self.relay_dials,
            "dial_backs": {"dials": self.dialback.dials, "refused": self.dialback.gate.refused},
        }
        if self.options.relay:
            out["relay_service"] = {
                "reservations": self.hop.reservations,
                "reservations_refused": self.hop.refused,
                "circuits": self.hop.circuits,
                "bytes_relayed": self.hop.bytes_relayed,
            }
        return out
