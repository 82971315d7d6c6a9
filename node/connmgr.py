"""Who keeps an inbound connection when slots run short: the connection manager (issue 26, items 1a and 4).

py-libp2p holds one of ``max_inbound`` slots per inbound connection until that connection ends, and closes any
newcomer unanswered once they are taken: ~250 fresh identities holding idle TCP connections locked every new
honest peer out for as long as they lived. The manager keeps the door open:

- **per-address caps**: at most ``per_ip`` inbound connections (live or in their handshake) from one IPv4
  address (IPv6: one /64), ``per_subnet`` from one /24 (/48), ``per_wide_subnet`` from one /16 (/32); addresses
  in ``exempt`` (loopback: every process of a local swarm shares it) are not capped;
- **idle pruning**: a newcomer that finds every slot taken closes the inbound connection idle the longest (no
  stream open first, then one whose streams have not changed for ``busy_idle`` seconds), never one younger than
  ``grace`` seconds, never a protected peer's, never an outbound one (we dialled it: we want it);
- **a pruned address cools down**: an address whose connection was closed to make room may not connect again for
  ``cooldown`` seconds (refused before its handshake): an attacker with more addresses than there are slots
  otherwise churned them, ~5 new connections a second each closing another (bench/hostile ``idle``), and now
  needs ``cooldown`` x that rate more addresses to keep it up;
- **reserved slots**: unprotected peers may hold at most ``max_inbound - reserved`` inbound connections; the
  bootstrap peers and the trainer (``protect``) and the peers a role values (``set_valued``: the trainer feeds
  "has an accepted record") may use them all;
- **keepalive**: yamux pings every connection every 30 s; one whose last ping went out ``keepalive_timeout``
  seconds ago unanswered, with nothing read from it since (a peer gone without a FIN), is dead and is closed (the
  timeout is over 30 s: the next ping is being written while the last one's time still shows);
- **un-negotiated streams**: a connection may have ``max_unnegotiated`` inbound streams waiting for protocol
  negotiation at once; the first one over is reset and the connection closed (2,000 such streams on one
  connection cost the honest swarm ~20% of its throughput; resetting only the excess let a peer open and have
  reset ~1,300 streams a second, which cost more than the waiting streams did). The process holds at most
  ``max_unnegotiated_total`` of them (many identities at many addresses, each under its own cap, held ~7,000):
  past that a connection gets a fair share of them, and a stream over its share is reset (its connection kept:
  an honest peer can get there).
- **oversized frames**: a peer that announces a frame over its message type's limit (node/rpc.py refuses it before
  any body byte) is hung up on and its address cools down as a pruned one does, unless it is protected: no honest
  peer does it (both sides size frames by protocols/), and refusing each such stream cost a negotiation and a reply.

The rules are pure functions over plain data (``Conn``, address counts), tested alone (tests/test_connmgr.py);
``ConnManager`` feeds them from the live host and acts through node/libp2p/conns.py. Every limit is keyed on the
connection's remote address and its authenticated peer id, never on anything a peer says.
"""

from __future__ import annotations

import ipaddress
import logging
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio
from libp2p.abc import IHost, INetConn, INetStream, INetwork, INotifee
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from node import rpc
from node.config import SwarmSettings
from node.libp2p import conns as mech

log = logging.getLogger(__name__)

ROOM_WAIT = 2.0  # seconds a newcomer waits for the slot of the connection closed for it
CLOSE_WAIT = 3.0  # seconds one close may take before we stop waiting for it
KEEPALIVE_CHECK = 5.0  # seconds between looks at every connection's pong
MAX_COOLING = 65_536  # pruned addresses (and peers hung up on) remembered for their cooldown


@dataclass(frozen=True)
class ConnLimits:
    """The manager's knobs (node/config.py's max_inbound, reserved_inbound and inbound_per_ip: ``conn_limits``)."""

    max_inbound: int = 250  # inbound connections held or in their handshake (py-libp2p's 300 - 50)
    reserved: int = 16  # of those, slots only protected and valued peers may take
    per_ip: int = 8  # one IPv4 address / IPv6 /64 (0: no cap)
    per_subnet: int = 32  # one IPv4 /24 / IPv6 /48
    per_wide_subnet: int = 64  # one IPv4 /16 / IPv6 /32
    exempt: tuple[str, ...] = ("127.0.0.0/8", "::1/128")  # networks with no address caps
    grace: float = 10.0  # seconds a new connection is never pruned (time to open its first streams)
    cooldown: float = 60.0  # seconds an address whose connection was pruned may not connect again
    busy_idle: float = 60.0  # seconds without a stream opening or closing before one with streams may go
    keepalive_timeout: float = 45.0  # seconds since the last unanswered ping (sent every 30 s) before it is dead
    max_unnegotiated: int = 32  # inbound streams of one connection waiting for protocol negotiation at once
    max_unnegotiated_total: int = 1024  # ... of every connection together, before each gets only a fair share
    outbound: int = 64  # connections this node dials itself, on top of max_inbound (DHT queries, peers it chose)


def conn_limits(settings: SwarmSettings) -> ConnLimits:
    """The limits a node's ``[swarm]`` knobs name (the /24 and /16 caps are 4x and 8x the per-IP one)."""
    per_ip = settings.inbound_per_ip
    return ConnLimits(
        max_inbound=settings.max_inbound,
        reserved=min(settings.reserved_inbound, settings.max_inbound),
        per_ip=per_ip,
        per_subnet=4 * per_ip,
        per_wide_subnet=8 * per_ip,
    )


# -- the rules -------------------------------------------------------------------------------------------------------


def total_connections(limits: ConnLimits) -> int:
    """py-libp2p's cap on all connections, inbound and outbound (its ``max_connections``, 300 by default, which its
    own pruner also trimmed to 100 above): ``max_inbound`` plus room to dial, so ``--max-inbound`` is what binds (a
    trainer feeding N samplers holds N inbound connections: bench/swarm_scale)."""
    return limits.max_inbound + limits.outbound


_V4_PREFIXES = (32, 24, 16)
_V6_PREFIXES = (64, 48, 32)


def address_groups(ip: str | None, limits: ConnLimits) -> tuple[tuple[str, int], ...]:
    """The (network, cap) pairs an inbound connection from ``ip`` counts against: its address, /24 and /16
    (IPv6: /64, /48, /32). None for an unknown or exempt address (a relayed circuit has no IP of its own)."""
    if ip is None:
        return ()
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return ()
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    if any(addr in ipaddress.ip_network(net) for net in limits.exempt):
        return ()
    prefixes = _V4_PREFIXES if addr.version == 4 else _V6_PREFIXES
    caps = (limits.per_ip, limits.per_subnet, limits.per_wide_subnet)
    return tuple(
        (str(ipaddress.ip_network(f"{addr}/{p}", strict=False)), cap)
        for p, cap in zip(prefixes, caps, strict=True)
        if cap > 0
    )


def address_key(ip: str | None, limits: ConnLimits) -> str | None:
    """What a cooldown is keyed on: the IPv4 address or IPv6 /64 (None: unknown or exempt)."""
    if ip is None:
        return None
    groups = address_groups(ip, ConnLimits(per_ip=1, per_subnet=0, per_wide_subnet=0, exempt=limits.exempt))
    return groups[0][0] if groups else None


def cooling(key: str | None, pruned_at: Mapping[str, float], now: float, cooldown: float) -> bool:
    """Whether an address (``address_key``) had a connection pruned less than ``cooldown`` seconds ago."""
    return key is not None and now - pruned_at.get(key, -1e18) < cooldown


def refuse_address(groups: Iterable[tuple[str, int]], held: Mapping[str, int]) -> str | None:
    """Why one more inbound connection from these groups is refused, or None when each is under its cap."""
    for net, cap in groups:
        if held.get(net, 0) >= cap:
            return f"{net} already holds {held[net]} inbound connections (cap {cap})"
    return None


@dataclass(frozen=True)
class Conn:
    """One live connection, as the rules see it."""

    key: int
    inbound: bool
    protected: bool  # a bootstrap peer, the trainer, or a peer the role values
    opened: float  # when it came up (trio clock)
    last_active: float  # when a stream last opened or closed on it
    streams: int  # streams open now


def prune_order(conns: Sequence[Conn], now: float, limits: ConnLimits) -> list[int]:
    """The inbound connections that may be closed to make room, the first to go first: those with no stream open,
    idle the longest first, then those whose streams have not changed for ``busy_idle`` seconds. Never a protected
    peer's, an outbound one, or one younger than ``grace``."""
    ranked = []
    for c in conns:
        if not c.inbound or c.protected or now - c.opened < limits.grace:
            continue
        if c.streams and now - c.last_active < limits.busy_idle:
            continue
        ranked.append((c.streams > 0, c.last_active, c.opened, c.key))
    return [key for *_, key in sorted(ranked)]


def make_room(free: int, conns: Sequence[Conn], now: float, limits: ConnLimits) -> list[int]:
    """Before a newcomer's handshake: nothing when a slot is free, else the one connection to close for it (none
    when no connection may go: the newcomer is refused)."""
    return [] if free > 0 else prune_order(conns, now, limits)[:1]


@dataclass(frozen=True)
class Admission:
    admit: bool
    evict: tuple[int, ...] = ()


def admit_peer(newcomer: Conn, others: Sequence[Conn], now: float, limits: ConnLimits) -> Admission:
    """After the handshake, when the peer is known: an unprotected inbound newcomer may take one of the
    ``reserved`` slots only by pruning an unprotected connection; a protected one, or an outbound one, is in."""
    if newcomer.protected or not newcomer.inbound:
        return Admission(True)
    unprotected = 1 + sum(1 for c in others if c.inbound and not c.protected)
    excess = unprotected - max(0, limits.max_inbound - limits.reserved)
    if excess <= 0:
        return Admission(True)
    victims = prune_order(others, now, limits)[:excess]
    return Admission(True, tuple(victims)) if len(victims) == excess else Admission(False)


def pong_overdue(sent_at: float, answered: bool, now: float, timeout: float, last_read: float = 0.0) -> bool:
    """A keepalive ping sent at ``sent_at`` (0: none yet) with no pong for more than ``timeout`` seconds, and nothing
    read from the connection since it went out (``last_read``): a peer whose bytes keep coming is there, its pong
    late or lost (a busy loop at either end; a pong dropped from a full control queue). At N = 128 on one box the
    pong alone closed ~700 live connections in 7 minutes, the trainer's among them, and each came back as a new
    handshake, identify and lookup on loops already behind. ``last_read`` is the later of this process's last read
    and the kernel's last received byte (``conns.kernel_last_data``): a loop starved for 45 s has not read what
    came, and its keepalive check may run before its read loop does."""
    return sent_at > 0 and not answered and now - sent_at > timeout and last_read <= sent_at


def refuse_stream(waiting: int, limits: ConnLimits, total: int = 0, connections: int = 1) -> str | None:
    """What to do with a new inbound stream on a connection with ``waiting`` streams still negotiating their
    protocol, ``total`` such streams on the ``connections`` connections that have any: None (let it negotiate),
    "close" (its connection is over ``max_unnegotiated``: reset it, close the connection) or "reset" (the process
    holds ``max_unnegotiated_total`` and this connection its fair share of them, at least 1: reset it alone)."""
    if waiting >= limits.max_unnegotiated:
        return "close"
    if total >= limits.max_unnegotiated_total and waiting >= max(1, limits.max_unnegotiated_total // connections):
        return "reset"
    return None


# -- the manager -----------------------------------------------------------------------------------------------------


class ConnManager(INotifee):
    """Applies the rules to one host: install() before it listens, ``running()`` around its life."""

    def __init__(self, host: IHost, limits: ConnLimits | None = None) -> None:
        self.host = host
        self.limits = limits or ConnLimits()
        self.room_wait = ROOM_WAIT
        self._network = host.get_network()
        self._protected: frozenset[ID] = frozenset()
        self._valued: Callable[[ID], bool] | None = None
        self._held: dict[str, int] = {}  # address group -> inbound connections held or in their handshake
        self._seen: dict[int, list[float]] = {}  # id(connection) -> [opened, last_active]
        self._closing: set[int] = set()
        self._pruned_at: dict[str, float] = {}  # address (first group) -> when a connection of it was pruned
        # peer -> when we hung up on it for an oversized frame: no connection of ours to it for the cooldown (the
        # DHT or a reachability check dialled it straight back, and the hang-up did not hold)
        self._hung_up: dict[str, float] = {}
        self.counts: Counter[str] = Counter()
        self._nursery: trio.Nursery | None = None  # while running(): closes started from synchronous callbacks

    def install(self) -> None:
        mech.attach_admission(self._network, self, self.limits.max_inbound)
        mech.cap_unnegotiated(
            self._network,
            lambda waiting, total, connections: refuse_stream(waiting, self.limits, total, connections),
            self._refused_stream,
        )
        self._network.register_notifee(self)
        rpc.on_oversized_frame(self._network, self._oversized)

    # -- who is protected

    def protect(self, peers: Iterable[ID]) -> None:
        """Peers whose inbound connections are never pruned and may use the reserved slots (bootstrap, trainer)."""
        self._protected = frozenset(peers)

    def set_valued(self, valued: Callable[[ID], bool] | None) -> None:
        """A role's say on who else is protected (the trainer: peers with an accepted record). Called often and
        on the event loop: keep it a set lookup."""
        self._valued = valued

    def is_protected(self, peer: ID) -> bool:
        if peer in self._protected:
            return True
        try:
            return bool(self._valued and self._valued(peer))
        except Exception as exc:  # a role's bug must not open or close the door
            log.debug("valued(%s) failed: %s", peer, exc)
            return False

    # -- the inbound hook (node/libp2p/conns.py calls these before and after taking a slot)

    def reserve(self, ip: str | None) -> bool:
        if cooling(address_key(ip, self.limits), self._pruned_at, trio.current_time(), self.limits.cooldown):
            self.counts["refused_cooling"] += 1
            return False
        groups = address_groups(ip, self.limits)
        why = refuse_address(groups, self._held)
        if why is not None:
            self.counts["refused_address"] += 1
            log.log(logging.INFO if self.counts["refused_address"] == 1 else logging.DEBUG, "refusing %s: %s", ip, why)
            return False
        for net, _ in groups:
            self._held[net] = self._held.get(net, 0) + 1
        return True

    def release(self, ip: str | None) -> None:
        for net, _ in address_groups(ip, self.limits):
            left = self._held.get(net, 0) - 1
            if left > 0:
                self._held[net] = left
            else:
                self._held.pop(net, None)

    async def make_room(self) -> bool:
        now = trio.current_time()
        victims = make_room(0, self._view(now), now, self.limits)
        if not victims:
            self.counts["refused_full"] += 1
            log.log(logging.WARNING if self.counts["refused_full"] == 1 else logging.DEBUG,
                    "every inbound slot is held by a connection that may not go; newcomer refused")  # fmt: skip
            return False
        await self._evict(victims, "to make room for a newcomer")
        return True

    # -- notifications

    async def connected(self, network: INetwork, conn: INetConn) -> None:
        now = trio.current_time()
        self._seen[id(conn)] = [now, now]
        if not mech.is_inbound(conn):
            if cooling(str(conn.muxed_conn.peer_id), self._hung_up, now, self.limits.cooldown):
                self.counts["closed_dial_to_hung_up"] += 1
                await _close(conn)
            return
        newcomer = self._conn(conn, now)
        others = [c for c in self._view(now) if c.key != newcomer.key]
        verdict = admit_peer(newcomer, others, now, self.limits)
        if verdict.evict:
            await self._evict(verdict.evict, "for a newcomer beyond the unreserved slots")
        if not verdict.admit:
            self.counts["refused_reserve"] += 1
            log.debug("closing %s: the unreserved inbound slots are held and none may go", conn.muxed_conn.peer_id)
            await _close(conn)

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        self._seen.pop(id(conn), None)

    async def opened_stream(self, network: INetwork, stream: INetStream) -> None:
        self._touch(stream)

    async def closed_stream(self, network: INetwork, stream: INetStream) -> None:
        self._touch(stream)

    async def listen(self, network: INetwork, multiaddr: Multiaddr) -> None:
        pass

    async def listen_close(self, network: INetwork, multiaddr: Multiaddr) -> None:
        pass

    # -- keepalive

    @asynccontextmanager
    async def running(self) -> AsyncIterator[ConnManager]:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._keepalive)
            try:
                yield self
            finally:
                self._nursery = None
                nursery.cancel_scope.cancel()

    async def _keepalive(self) -> None:
        while True:
            await trio.sleep(KEEPALIVE_CHECK)
            now = trio.current_time()
            live = list(self._network.get_connections())
            for key in self._seen.keys() - {id(c) for c in live}:  # bounded: only live connections are kept
                del self._seen[key]
            for conn in live:
                sent_at, answered = mech.ping_state(conn)
                if id(conn) in self._closing:
                    continue
                timeout, read = self.limits.keepalive_timeout, mech.last_read(conn)
                # the kernel is asked (a syscall) only when our own reads already say dead: read, or waiting to be
                if pong_overdue(sent_at, answered, now, timeout, read) and pong_overdue(
                    sent_at, answered, now, timeout, max(read, mech.kernel_last_data(conn, now))
                ):
                    self.counts["dead"] += 1
                    if self.is_protected(conn.muxed_conn.peer_id):  # the trainer, a bootstrap peer
                        self.counts["dead_protected"] += 1
                    log.info("closing %s: no pong for %.0f s", conn.muxed_conn.peer_id, now - sent_at)
                    self._closing.add(id(conn))
                    try:
                        await _close(conn)
                    finally:
                        self._closing.discard(id(conn))

    def status(self) -> dict[str, Any]:
        inbound = [c for c in self._network.get_connections() if mech.is_inbound(c)]
        return {"inbound": len(inbound), **{k: v for k, v in sorted(self.counts.items())}}

    # -- helpers

    def _touch(self, stream: INetStream) -> None:
        seen = self._seen.get(id(getattr(stream, "swarm_conn", None)))
        if seen is not None:
            seen[1] = trio.current_time()

    def _conn(self, conn: INetConn, now: float) -> Conn:
        opened, last = self._seen.setdefault(id(conn), [now, now])
        return Conn(
            key=id(conn),
            inbound=mech.is_inbound(conn),
            protected=self.is_protected(conn.muxed_conn.peer_id),
            opened=opened,
            last_active=last,
            streams=len(conn.get_streams()),
        )

    def _view(self, now: float) -> list[Conn]:
        return [self._conn(c, now) for c in self._network.get_connections() if id(c) not in self._closing]

    async def _evict(self, keys: Iterable[int], why: str) -> None:
        by_key = {id(c): c for c in self._network.get_connections()}
        victims = [by_key[k] for k in keys if k in by_key and k not in self._closing]
        self._closing.update(id(c) for c in victims)
        try:
            for conn in victims:
                self.counts["pruned"] += 1
                self._cool(mech.remote_ip(conn.muxed_conn))
                log.debug("closing the idle inbound connection of %s %s", conn.muxed_conn.peer_id, why)
                await _close(conn)
        finally:
            self._closing.difference_update(id(c) for c in victims)

    def _cool(self, ip: str | None) -> None:
        """Remember when an address had a connection pruned (bounded: expired entries go, then the oldest)."""
        key = address_key(ip, self.limits)
        if key is not None:
            self._remember(self._pruned_at, key)

    def _remember(self, table: dict[str, float], key: str) -> None:
        """Note ``key`` cooling from now in ``table`` (bounded: expired entries go, then the oldest)."""
        now = trio.current_time()
        if len(table) >= MAX_COOLING:
            for old in [k for k, t in table.items() if now - t >= self.limits.cooldown]:
                del table[old]
            while len(table) >= MAX_COOLING:
                del table[next(iter(table))]
        table.pop(key, None)
        table[key] = now

    def _refused_stream(self, conn: INetConn | None, peer: ID, verdict: str) -> None:
        """A stream over a cap: it is reset; over its connection's cap ("close"), its connection is closed too (no
        honest peer gets there)."""
        self.counts["streams_refused"] += 1
        if verdict != "close":
            self.counts["streams_refused_total"] += 1
            log.log(logging.INFO if self.counts["streams_refused_total"] == 1 else logging.DEBUG,
                    "resetting a stream of %s: %d streams wait for protocol negotiation in all",
                    peer, self.limits.max_unnegotiated_total)  # fmt: skip
            return
        if conn is None or id(conn) in self._closing or self._nursery is None:
            return
        self.counts["closed_for_streams"] += 1
        log.info("closing %s: more than %d streams at once without negotiating a protocol",
                 peer, self.limits.max_unnegotiated)  # fmt: skip
        self._closing.add(id(conn))
        self._nursery.start_soon(self._close_flooder, conn)

    def _oversized(self, stream: INetStream) -> None:
        """A peer announced an oversized frame (node/rpc.py): hang up on it and cool its address, unless protected."""
        conn = getattr(stream, "swarm_conn", None)
        if conn is None:
            return
        peer = conn.muxed_conn.peer_id
        if self.is_protected(peer):
            self.counts["oversized_frames_kept"] += 1
            return
        self.counts["hung_up_oversized"] += 1
        self._cool(mech.remote_ip(conn.muxed_conn))
        self._remember(self._hung_up, str(peer))
        if self._nursery is None:
            return
        log.log(logging.INFO if self.counts["hung_up_oversized"] == 1 else logging.DEBUG,
                "closing %s: it announced a frame over its protocol's limit", peer)  # fmt: skip
        for other in [conn, *(c for c in self._network.get_connections(peer) if c is not conn)]:
            if id(other) not in self._closing:
                self._closing.add(id(other))
                self._nursery.start_soon(self._close_flooder, other)

    async def _close_flooder(self, conn: INetConn) -> None:
        try:
            await _close(conn)
        finally:
            self._closing.discard(id(conn))


async def _close(conn: INetConn) -> None:
    with trio.move_on_after(CLOSE_WAIT):
        try:
            await conn.close()
        except Exception as exc:
            log.debug("closing %s failed: %s", conn.muxed_conn.peer_id, exc)
