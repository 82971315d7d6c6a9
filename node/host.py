"""The libp2p host every role shares: TCP + Noise + yamux only, Kad-DHT in server mode, gossip, bootstrap join.

Plaintext and secio are in py-libp2p's default security list, so the transports are given explicitly.
The DHT does not add connected peers to its routing table by itself; ``feed_routing_table`` does that.
With ``reach`` options (every node the runtime starts), the swarm also learns whether it is reachable, relays
for others, reserves relay slots when it is behind a NAT, and hole-punches relayed connections
(node/reachability.py): ``connect`` then falls back to a relay when a direct dial fails.
Every swarm has a connection manager (node/connmgr.py): per-address caps and idle pruning on inbound connections,
slots reserved for the trusted peers and those a role values, keepalive, a cap on streams not yet negotiated.

Imports point one way: this module uses reachability, which uses discovery; neither imports this one (they see
a Swarm through the protocols ``Dialer`` and ``DhtNode``).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractContextManager, asynccontextmanager, nullcontext
from dataclasses import asdict, dataclass
from typing import Any

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import IHost, INetStream
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.kad_dht.common import PROTOCOL_ID as DHT_PROTOCOL
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux
from libp2p.tools.anyio_service import background_trio_service

from node.connmgr import ConnLimits, ConnManager, total_connections
from node.errors import UserError
from node.libp2p import dht_slots, set_dht_handlers
from node.libp2p import install as install_libp2p
from node.libp2p.conns import library_limits, stop_library_dialler
from node.private import PeerGate
from node.reachability import Reachability, ReachOptions, is_relayed_addr
from node.rpc import AnswerClock, timed_by
from node.weights.gossip import Gossip, open_gossip

log = logging.getLogger(__name__)
DIRECT_DIAL_TIMEOUT = 4.0  # seconds for a direct dial to a peer that also advertises a relay address


def build_host(key_pair: KeyPair, psk: str | None = None, limits: ConnLimits | None = None) -> IHost:
    install_libp2p()  # py-libp2p 0.8.1's fixes and its logs routed through ours: node/libp2p/patches.py PATCHES
    noise = NoiseTransport(key_pair, noise_privkey=create_x25519_key_pair().private_key)
    return new_host(
        key_pair=key_pair,
        sec_opt={NOISE_PROTOCOL_ID: noise},
        muxer_opt={YAMUX_PROTOCOL_ID: Yamux},
        psk=psk,
        connection_config=library_limits(total_connections(limits or ConnLimits())),
    )


DIAL_TIMEOUT = 10.0  # seconds a dial may take before any was timed, and at least (then: the dial clock)
DIAL_TIMEOUT_MOST = 60.0  # up to this


def direct_wait(timeout: float, trusted: bool, dials_take: float) -> float:
    """Seconds a direct dial may take before a relay is tried: all of ``timeout`` for a trusted peer (relays are
    for peers behind NATs, not for the bootstrap nodes and the trainer); else 2 x ``DIRECT_DIAL_TIMEOUT``, stretched
    as this node's own dials are (``dials_take``, the dial clock's deadline, against an idle node's
    ``DIAL_TIMEOUT``). At a fixed 8 s a loaded sampler's handshakes with other samplers all ran out, each relay
    attempt after them failed too, and 89 of 256 samplers (N = 256 on one box) knew no other sampler after 15
    minutes."""
    if trusted:
        return timeout
    return min(timeout, 2 * DIRECT_DIAL_TIMEOUT * max(1.0, dials_take / DIAL_TIMEOUT))


class Swarm:
    """A running host with all a node talks through: its DHT, gossip, the allow-list gate and, given ``reach``
    options, its reachability (which dials through this swarm: hence built here). ``open_swarm`` makes one."""

    def __init__(
        self,
        host: IHost,
        dht: KadDHT,
        gossip: Gossip,
        gate: PeerGate,
        reach: ReachOptions | None = None,
        conns: ConnManager | None = None,
        dht_serving: DhtServing | None = None,
    ) -> None:
        self.host = host
        self.dht = dht
        self.gossip = gossip
        self.gate = gate
        self.reach = Reachability(self, reach) if reach is not None else None
        self.conns = conns or ConnManager(host)  # installed by open_swarm; a role may set_valued on it
        self.dht_serving = dht_serving or DhtServing()
        self.dial_clock = AnswerClock(DIAL_TIMEOUT, DIAL_TIMEOUT_MOST)  # how long this node's dials take

    @property
    def peer_id(self) -> ID:
        return self.host.get_id()

    @property
    def trusted(self) -> frozenset[ID]:
        """The bootstrap peers and the trainer: asked for dial-backs and provider records, used as relays."""
        return self.reach.options.trusted if self.reach is not None else frozenset()

    def addrs(self) -> list[multiaddr.Multiaddr]:
        """Dialable addresses including /p2p/<id>, 0.0.0.0 replaced by loopback for local use."""
        out = []
        for a in self.host.get_addrs():
            text = str(a).replace("/ip4/0.0.0.0/", "/ip4/127.0.0.1/")
            if "/p2p/" not in text:
                text += f"/p2p/{self.peer_id}"
            out.append(multiaddr.Multiaddr(text))
        return out

    async def connect(self, info: PeerInfo, timeout: float | None = None) -> None:
        """Dial ``info`` (directly, else through a relay when the node has reachability). Raises ConnectionError
        naming what each address said when none answered, trio.TooSlowError past ``timeout``. With no ``timeout``,
        as long as this node's dials take (``dial_clock``: SRTT + 4 RTTVAR of the dials timed, at least
        ``DIAL_TIMEOUT``, twice as long after one ran out): at a fixed 10 s on a loaded box (N = 256,
        bench/swarm_scale) the samplers' handshakes with the trainer ran out again and again ("found but
        unreachable"), and 63 of them were still searching for it after 11 minutes."""
        if info.peer_id == self.peer_id:
            return
        if not self.gate.allows(info.peer_id):
            raise UserError(f"{info.peer_id} is not on this swarm's allow-list")
        timing: AbstractContextManager[None] = nullcontext()
        if timeout is None:
            timeout = self.dial_clock.timeout()
            if info.peer_id not in self.host.get_connected_peers():  # no dial: nothing to learn
                timing = timed_by(self.dial_clock, timeout)
        with timing:
            if self.reach is None:
                await self._dial(info, timeout)
            elif not self.reach.has_direct(info.peer_id):
                await self._connect_direct_or_relayed(info, timeout)
        await self.dht.add_peer(info.peer_id)

    async def _dial(self, info: PeerInfo, timeout: float) -> None:
        """A direct dial to the addresses ``info`` gives, each in turn until one answers (the peerstore's when it
        gives none). py-libp2p's ``dial_peer`` tries one address per transport, the first its peerstore holds, and
        then refuses the peer for 60 s (its negative cache, keyed on the peer): a trainer that moved was dialled at
        its old address only, then not at all at the new ones the DHT gave. Our callers keep their own backoff."""
        direct = [a for a in info.addrs if not is_relayed_addr(a)]
        with trio.fail_after(timeout):
            if not direct or info.peer_id in self.host.get_connected_peers():
                await self.host.connect(info)
                return
            error = await self._dial_each(info.peer_id, direct)
        if error is not None:
            raise ConnectionError(f"{info.peer_id}: no address answered ({error})")

    async def _dial_each(self, peer: ID, addrs: list[multiaddr.Multiaddr]) -> str | None:
        """Dial ``addrs`` one after another until one answers (kept in the peerstore): None, else what each said."""
        self.host.get_peerstore().add_addrs(peer, addrs, 600)
        network, errors = self.host.get_network(), []
        for addr in addrs:
            try:
                await network.dial_addr(addr, peer)
                return None
            except Exception as exc:
                errors.append(f"{addr}: {exc}")
        return "; ".join(errors) or "no direct address"

    async def _connect_direct_or_relayed(self, info: PeerInfo, timeout: float) -> None:
        """A direct dial first (briefly when the peer advertises a relay address), then through a relay."""
        assert self.reach is not None
        relayed = any(is_relayed_addr(a) for a in info.addrs) or bool(self.reach.kinds(info.peer_id))
        direct = [a for a in info.addrs if not is_relayed_addr(a)]
        if not relayed:
            trusted = info.peer_id in self.reach.options.trusted
            try:
                await self._dial(info, direct_wait(timeout, trusted, self.dial_clock.timeout()))
                return
            except Exception as exc:
                if trusted:
                    raise  # relays are for peers behind NATs, not for the bootstrap nodes and the trainer
                direct_error = exc
            try:
                await self.reach.dial_relayed(info, timeout)
            except Exception as exc:
                why = f"direct dial failed ({direct_error}), relay too ({exc})"
                raise ConnectionError(f"{info.peer_id}: {why}") from None
            return
        error: str | None = "timed out"
        with trio.move_on_after(min(timeout, DIRECT_DIAL_TIMEOUT)):
            error = await self._dial_each(info.peer_id, direct)
        if error is None:
            return
        if self.reach.kinds(info.peer_id):
            return  # relayed already: hole punching will try to make it direct
        try:
            await self.reach.dial_relayed(info, timeout)
        except Exception as exc:
            raise ConnectionError(f"{info.peer_id}: direct dial failed ({error}), relay too ({exc})") from None

    def is_direct(self, peer: ID) -> bool:
        """Whether this node has a direct (not relayed) connection to ``peer`` (always, without reachability)."""
        return self.reach is None or self.reach.has_direct(peer)

    def chunk_peers(self) -> list[ID]:
        """Peers to ask for weight chunks: those with a direct connection. A peer reachable only through a relay
        is asked only when no other peer is (relays cap every circuit's bytes: a last resort, not a path)."""
        peers = [p for p in self.host.get_connected_peers() if p != self.peer_id]
        if self.reach is None:
            return peers
        direct = [p for p in peers if self.reach.has_direct(p)]
        return direct if len(direct) >= 2 else peers

    def status(self) -> dict[str, Any]:
        reach = self.reach.status() if self.reach is not None else {}
        return {**reach, "connmgr": self.conns.status(), "dht_streams": asdict(self.dht_serving)}

    async def feed_routing_table(self, interval: float) -> None:
        """Add every connected peer to the DHT routing table, forever (py-libp2p won't do it). Peers already in
        it are skipped: adding one again only refreshes it, and that, for every connection every second, was a
        sampler's largest periodic cost after gossip's (bench/swarm_scale --profile: 0.7 ms/s per host)."""
        table = self.dht.routing_table
        while True:
            for pid in list(self.host.get_connected_peers()):
                if table.peer_in_table(pid):
                    continue
                try:
                    await self.dht.add_peer(pid)
                except Exception as exc:
                    log.debug("add_peer %s failed: %s", pid, exc)
            await trio.sleep(interval)


DHT_HANDLERS = 64  # DHT requests a node handles at once (py-libp2p: 12; see access.set_dht_handlers)
DHT_STREAM_SECONDS = 10.0  # the longest an inbound DHT stream is served (go-libp2p resets idle ones after 60 s)
# after an answer, how long a stream may wait for its next request before it is closed: py-libp2p's handler keeps
# its slot until the asker closes, and a lagging asker (seconds on a loaded sampler) kept slots idle that way
DHT_IDLE_SECONDS = 1.0
DHT_FIRST_READ = 4096  # bytes of a stream's first request read before a slot is taken (the rest through the handler)


@dataclass
class DhtServing:
    """What this node's DHT server did with the inbound streams it was offered: ``served``; ``refused`` (a request
    came while all ``DHT_HANDLERS`` slots were taken: py-libp2p resets the stream, and the asker's lookup fails);
    ``idle`` (closed ``DHT_IDLE_SECONDS`` after an answer, no next request); ``cut`` (no request, or not done, in
    ``DHT_STREAM_SECONDS``: reset); ``empty`` (closed by the asker before any request). In the node's status, so a
    saturated bootstrap node shows."""

    served: int = 0
    refused: int = 0
    idle: int = 0
    cut: int = 0
    empty: int = 0


class _DhtStream:
    """An inbound DHT stream as py-libp2p's handler sees it. ``first_request`` waits for the first bytes of a
    request before the handler (and its slot) is called, and hands them to its first reads; reads after an answer
    wait ``DHT_IDLE_SECONDS`` at most and then read as the stream's end, so the handler closes it gracefully and
    frees its slot. Our lookups and provides send one request per stream; a peer that reuses a stream (go-libp2p's
    message sender) opens a new one when it finds this one closed."""

    def __init__(self, stream: INetStream, counts: DhtServing) -> None:
        self._stream = stream
        self._counts = counts
        self._answered = False
        self._first = b""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    async def first_request(self) -> bool:
        """Wait, holding no slot, for the first bytes of a request; False if the stream ended first."""
        try:
            self._first = await self._stream.read(DHT_FIRST_READ)
        except Exception:  # ended or reset by the asker
            return False
        return bool(self._first)

    async def write(self, data: bytes) -> None:
        self._answered = True
        await self._stream.write(data)

    async def read(self, n: int | None = None) -> bytes:
        if self._first:
            take = len(self._first) if n is None or n < 0 else n
            data, self._first = self._first[:take], self._first[take:]
            return data
        if not self._answered:
            return await self._stream.read(n)
        with trio.move_on_after(DHT_IDLE_SECONDS):
            data = await self._stream.read(n)
            self._answered = False
            return data
        self._counts.idle += 1
        return b""


def bound_dht_streams(host: IHost, dht: KadDHT) -> DhtServing:
    """Serve each inbound DHT stream for ``DHT_STREAM_SECONDS`` at most, then reset it; hand it to py-libp2p's
    handler, which holds one of the node's ``DHT_HANDLERS`` slots while it runs, only once a request has arrived,
    and close it ``DHT_IDLE_SECONDS`` after an answer with no next request (``_DhtStream``). py-libp2p's handler
    takes its slot when the stream opens and waits for each request with no deadline. A client whose lookup was
    cancelled before it closed its stream left its slot held forever: at 128 samplers the bootstrap node's slots
    filled so, it reset every new DHT stream, and newcomers, whose first and only DHT peer it is, could not look
    anything up (docs/capacity.md, section 6). At 256, with the 10 s bound alone, streams whose lagging askers had
    not yet written their request, or not yet closed after the answer, held the slots: the bootstrap node refused
    475 of 3,308 streams."""

    counts = DhtServing()
    slots = dht_slots(dht)  # read only: the refusal is py-libp2p's

    async def bounded(stream: INetStream) -> None:
        wrapped = _DhtStream(stream, counts)
        with trio.move_on_after(DHT_STREAM_SECONDS) as scope:
            if not await wrapped.first_request():
                counts.empty += 1
                await _end_quietly(stream.close)
                return
            if slots.borrowed_tokens >= slots.total_tokens:
                counts.refused += 1
            else:
                counts.served += 1
            await dht.handle_stream(wrapped)  # type: ignore[arg-type]
        if scope.cancelled_caught:
            counts.cut += 1
            await _end_quietly(stream.reset)

    host.set_stream_handler(DHT_PROTOCOL, bounded)
    return counts


async def _end_quietly(end: Callable[[], Awaitable[Any]]) -> None:
    """Close or reset a stream even while cancelled, for 1 s at most; a failure is the peer gone, and ignored."""
    with trio.CancelScope(shield=True), trio.move_on_after(1.0):
        try:
            await end()
        except Exception:
            pass


@asynccontextmanager
async def open_swarm(
    key_pair: KeyPair,
    listen: multiaddr.Multiaddr,
    psk: str | None = None,
    allow: frozenset[ID] | None = None,
    reach: ReachOptions | None = None,
    conns: ConnLimits | None = None,
) -> AsyncIterator[Swarm]:
    """A running host + DHT + gossip. ``psk`` makes the swarm private; ``allow`` admits only those peer ids;
    ``reach`` turns on reachability checks, relaying and hole punching (node/reachability.py); ``conns`` are the
    connection manager's limits (node/connmgr.py; its defaults when None)."""
    host = build_host(key_pair, psk=psk, limits=conns)
    gate = PeerGate(allow)
    gate.install(host)
    manager = ConnManager(host, conns)
    manager.install()  # after the gate: its stream cap wraps the gate's entry
    try:
        run = host.run(listen_addrs=[listen])
    except Exception as exc:
        raise UserError(f"cannot listen on {listen}: {exc}") from None
    async with run:
        await stop_library_dialler(host.get_network())  # discovery chooses whom to dial (node/libp2p/conns.py)
        dht = KadDHT(host, DHTMode.SERVER, max_peers_per_subnet=0)
        set_dht_handlers(dht, DHT_HANDLERS)
        serving = bound_dht_streams(host, dht)
        async with background_trio_service(dht), open_gossip(host) as gossip, manager.running():
            swarm = Swarm(host, dht, gossip, gate, reach, manager, serving)
            manager.protect(swarm.trusted)
            async with swarm.reach.running() if swarm.reach is not None else nullcontext():
                yield swarm


BOOTSTRAP_RETRY_FIRST = 1.0  # seconds before a bootstrap peer that did not answer is dialled again; doubles
BOOTSTRAP_RETRY_MOST = 60.0  # up to this


def bootstrap_peers(swarm: Swarm, addrs: tuple[multiaddr.Multiaddr, ...]) -> tuple[list[PeerInfo], bool]:
    """The listed bootstrap peers other than this node, and whether this node is listed itself (by its peer id,
    or by one of its own listen addresses): one bootstrap.toml lists every bootstrap node of a swarm."""
    mine = [a for a in [*swarm.host.get_addrs(), *swarm.addrs()] if not is_relayed_addr(a)]
    own = {str(a).split("/p2p/")[0] for a in mine}
    others, listed = [], False
    for addr in addrs:
        info = info_from_p2p_addr(addr)
        if info.peer_id == swarm.peer_id or str(addr).split("/p2p/")[0] in own:
            if info.peer_id != swarm.peer_id:
                log.warning("bootstrap entry %s is this node's address, but not its peer id %s", addr, swarm.peer_id)
            listed = True
        else:
            others.append(info)
    return others, listed


async def join_bootstrap(swarm: Swarm, infos: list[PeerInfo], timeout: float) -> int:
    """Connect to every bootstrap peer we can; retry until ``timeout``; raise if none answered.

    Returns how many were reached. A node with no bootstrap peers is a swarm's first node. A dial may take
    ``DIAL_TIMEOUT`` seconds, twice as long after one ran out (``AnswerClock``: Karn's backoff), up to what is left:
    at a fixed 10 s, on a loaded box (N = 256, bench/swarm_scale) every handshake with the bootstrap node took
    longer, each was abandoned and begun again, and 6 samplers gave up after 60 s.
    """
    if not infos:
        return 0
    errors: dict[str, str] = {}
    deadline = trio.current_time() + timeout
    clock = AnswerClock(DIAL_TIMEOUT, timeout)
    while True:
        reached = 0
        for info in infos:
            wait = max(1.0, min(clock.timeout(), deadline - trio.current_time()))
            try:
                with timed_by(clock, wait):
                    await swarm.connect(info, timeout=wait)
                reached += 1
            except Exception as exc:
                errors.setdefault(str(info.peer_id), f"{type(exc).__name__}: {exc}"[:200])
        if reached:
            return reached
        if trio.current_time() >= deadline:
            detail = "; ".join(f"{pid}: {err}" for pid, err in errors.items())
            raise UserError(f"could not reach any bootstrap peer within {timeout:.0f} s ({detail})")
        await trio.sleep(1.0)


BOOTSTRAP_WELL_CONNECTED = 8  # other peers a node holds past which it does not need a bootstrap peer back at once
BOOTSTRAP_RETRY_SETTLED = 900.0  # the longest such a node waits between tries (its records reach the trainer meanwhile)
BOOTSTRAP_STABLE = 60.0  # a bootstrap connection that lived this long was not refused: its loss starts backoff over


def bootstrap_redial_wait(others: int, losses: int, first: float, most: float, settles: bool = True) -> float:
    """Seconds before dialling again a bootstrap peer this node is not connected to, after ``losses`` (>= 1)
    failed dials or short-lived connections in a row: ``first`` doubling up to ``most``; a node holding
    ``BOOTSTRAP_WELL_CONNECTED`` other peers (the trainer, its mesh) waits ``most``, doubling up to
    ``BOOTSTRAP_RETRY_SETTLED``. A bootstrap node full of connections hangs up on its idlest (node/connmgr.py),
    which are settled samplers: redialled after 1 s, each took another's slot, which redialled in turn (124 such
    closures at the bootstrap in 5 minutes at N = 256, 250 slots). A settled node asks the trainer for records
    meanwhile (discovery asks every trusted peer connected). A bootstrap node never ``settles``: it wants its
    sibling bootstrap nodes back as soon as they are up, however many peers it holds."""
    doubling = 2 ** min(max(losses, 1) - 1, 30)
    if settles and others >= BOOTSTRAP_WELL_CONNECTED:
        return min(most * doubling, BOOTSTRAP_RETRY_SETTLED)
    return min(first * doubling, most)


def says_outage(failures: int) -> bool:
    """Whether the keeper logs the ``failures``-th failed dial (>= 1) of one outage: the 1st, 2nd, 4th, 8th, ...
    A node cut off from its only peer for 16 minutes (bench/swarm_scale, N = 256) said so once; one line per
    failure would flood a long outage's log."""
    return failures >= 1 and failures & (failures - 1) == 0


async def keep_bootstrap_peers(
    swarm: Swarm,
    infos: list[PeerInfo],
    first: float = BOOTSTRAP_RETRY_FIRST,
    most: float = BOOTSTRAP_RETRY_MOST,
    settles: bool = True,
) -> None:
    """Keep a connection to every bootstrap peer: one that is down (a swarm's other bootstrap nodes while the
    first one starts, or one that restarts) or hung up is dialled again as ``bootstrap_redial_wait`` says."""
    bootstrap = frozenset(info.peer_id for info in infos)
    async with trio.open_nursery() as nursery:
        for info in infos:
            nursery.start_soon(_keep_bootstrap_peer, swarm, info, bootstrap, first, most, settles)


async def _keep_bootstrap_peer(
    swarm: Swarm, info: PeerInfo, bootstrap: frozenset[ID], first: float, most: float, settles: bool
) -> None:
    losses, failures, since, outage = 0, 0, None, 0.0  # failures: failed dials since the last success

    def wait() -> float:
        others = sum(1 for p in swarm.host.get_connected_peers() if p not in bootstrap)
        return bootstrap_redial_wait(others, losses, first, most, settles)

    while True:
        if info.peer_id in swarm.host.get_connected_peers():
            since = trio.current_time() if since is None else since
            await trio.sleep(first)
            continue
        if since is not None:  # the connection was lost (hung up on, or the peer went down)
            losses = 0 if trio.current_time() - since >= BOOTSTRAP_STABLE else losses
            losses, since = losses + 1, None
            await trio.sleep(wait())
        try:
            await swarm.connect(info)
            if failures:
                log.info("bootstrap peer %s reached after %d failed tries over %.0f s", info.peer_id, failures,
                         trio.current_time() - outage)  # fmt: skip
            else:
                log.info("bootstrap peer %s reached", info.peer_id)
            failures = 0
        except Exception as exc:
            # a private swarm with the wrong key would retry silently otherwise
            failures += 1
            if failures == 1:
                outage = trio.current_time()
                log.warning("bootstrap peer %s not reached, trying again in the background: %s", info.peer_id, exc)
            elif says_outage(failures):
                log.warning("bootstrap peer %s still not reached after %d tries over %.0f s: %s", info.peer_id,
                            failures, trio.current_time() - outage, exc)  # fmt: skip
            losses += 1
            await trio.sleep(wait())
