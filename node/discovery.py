"""Discovery through the Kad-DHT: roles provide swarm-scoped keys; peers find each other with find_providers.

DHT keys. A role has a readable key, ``/swarmrl/<swarm>/<role>`` (``role_key``, used in logs), and a DHT key
derived from it (``role_cid``, ``dht_key``): the CIDv1 of the readable key's UTF-8 bytes, raw codec, sha256::

    multihash = 0x12 0x20 || sha256(utf8("/swarmrl/<swarm>/<role>"))     # sha2-256, 32-byte digest
    cid       = varint(1) || varint(0x55) || multihash                   # CIDv1, raw codec: 0x01 0x55 ...
    text      = "b" + base32(cid)                                        # RFC 4648 alphabet, lowercase, no padding

e.g. ``/swarmrl/test/trainer`` -> ``bafkreigc2gtfxkff24ufrfysbpkazzp2wev7d5fryk4flvi3tv3g2uloey``.

The text form is what goes to py-libp2p's ``dht.provide``/``dht.find_providers``: its ``_encode_key`` parses
the CID and puts only the multihash (``0x12 0x20`` + digest) on the wire, which is how provider records are
keyed in the libp2p Kad-DHT. Other implementations (js-libp2p, go-libp2p) decode that key as a CID and refuse
anything else, so a raw string key (what swarmrl used before) is stored only by Python peers. Peers running the
older scheme do not find records of this one, and the other way round.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import random
from collections.abc import Awaitable, Callable, Collection, Hashable, Mapping, Sequence
from pathlib import Path
from typing import Protocol, TypeVar

import trio
from libp2p.abc import IHost, INetConn, INetwork
from libp2p.kad_dht.kad_dht import KadDHT
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.peer.peerstore import PeerStoreError
from multiaddr import Multiaddr

from node.libp2p import provide_to_peer, providers_from_peer
from node.libp2p.conns import Notifee
from node.libp2p.nat import is_relayed_addr
from node.rpc import AnswerClock, timed_by

log = logging.getLogger(__name__)

CID_VERSION = 1
RAW_CODEC = 0x55
SHA2_256 = 0x12


class DhtNode(Protocol):
    """What discovery needs of a node (node/host.py's Swarm): a protocol, so that this module, which reachability
    uses, does not import the host module that uses reachability."""

    host: IHost
    dht: KadDHT

    @property
    def peer_id(self) -> ID: ...

    @property
    def trusted(self) -> frozenset[ID]: ...


def role_key(swarm_name: str, role: str) -> str:
    """The readable key of a role in a swarm (for logs); ``dht_key`` turns it into what the DHT stores."""
    return f"/swarmrl/{swarm_name}/{role}"


def _varint(n: int) -> bytes:
    """Unsigned LEB128, as multiformats uses it."""
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def cid_bytes(data: bytes) -> bytes:
    """Binary CIDv1 (raw codec, sha2-256 multihash) of ``data``."""
    digest = hashlib.sha256(data).digest()
    multihash = _varint(SHA2_256) + _varint(len(digest)) + digest
    return _varint(CID_VERSION) + _varint(RAW_CODEC) + multihash


def dht_key(key: str) -> str:
    """The DHT key for a readable key such as ``role_key(...)``: its CIDv1 as a base32 multibase string."""
    return "b" + base64.b32encode(cid_bytes(key.encode("utf-8"))).decode("ascii").lower().rstrip("=")


def role_cid(swarm_name: str, role: str) -> str:
    """The DHT key (CID string) under which ``role`` in ``swarm_name`` is provided."""
    return dht_key(role_key(swarm_name, role))


PROVIDE_CAP = 20  # x interval: the longest between re-provides of a settled record (10 min at the default 30 s)
PROVIDE_SPREAD = 2  # x interval: a node's first DHT provide comes at a point of [0, this) when a trusted peer took it
PROVIDE_JITTER = 0.5  # each wait between provides is stretched by a factor in [1 - this / 2, 1 + this / 2)


def next_provide(interval: float, provided: int, failed: int = 0, point: float = 0.5, held: bool = False) -> float:
    """Seconds until the next re-provide after ``provided`` provides in a row reached some peer, or ``failed`` in a
    row reached none. Each provide is a DHT walk plus ADD_PROVIDER streams to the k = 20 closest peers: every
    host doing that every 30 s was, with the lookups, a large part of a sampler's upkeep at N = 32-64
    (bench/swarm_scale). Records live 48 h in py-libp2p (go-libp2p re-provides every 22 h); re-providing often
    matters while the swarm is young and its closest peers to a key still change, so the interval doubles from
    ``interval`` up to ``PROVIDE_CAP`` x. A failed provide is retried after 2 s, doubling up to ``interval``: a
    provide fails when the swarm is too busy to answer, and retrying it every 2 s added to that load. While a trusted
    peer ``held`` the record (took it at the last try), newcomers find it there in one round trip, and the failed
    walk's retries back off on up to ``PROVIDE_CAP`` x ``interval``: at N = 256 on one box, failing provides retried
    every 30 s were 0.10 cancelled DHT stream opens a second per host (bench/swarm_scale --profile), each a
    negotiation its far end paid for.

    ``point`` (in [0, 1), drawn afresh for each wait) stretches the wait by up to ``PROVIDE_JITTER`` / 2 either
    way: nodes that joined together (a join wave, a lab) otherwise re-provide together for ever (in bench/wan's lab,
    15 DHT walks with their ADD_PROVIDER streams in one burst a minute, over the versions going out then)."""
    if provided <= 0:
        base = min(PROVIDE_CAP * interval if held else interval, 2.0 * 2 ** min(max(failed, 1) - 1, 16))
    else:
        base = min(PROVIDE_CAP * interval, interval * 2 ** min(provided - 1, 16))
    return base * (1.0 + PROVIDE_JITTER * (min(max(point, 0.0), 1.0) - 0.5))


def first_dht_provide(trusted_took: int, interval: float, point: float) -> float:
    """Seconds from a node's start to its first DHT provide of a role record. When a trusted peer took the record
    (``trusted_took`` > 0), newcomers find it there in one round trip, and the DHT's copy can wait: at ``point``
    (in [0, 1), fixed per node and key: ``spread_point``) of ``PROVIDE_SPREAD`` x ``interval``. A join wave
    otherwise walked the DHT all at once, each node sending ADD_PROVIDERs to the same 20 peers closest to the role
    key: at N = 64-128 on one box, lookups waited for those streams past their deadline (bench/swarm_scale). With
    no trusted peer holding it, the DHT is how the node is found: at once."""
    if trusted_took <= 0:
        return 0.0
    return PROVIDE_SPREAD * interval * min(max(point, 0.0), 1.0)


def spread_point(peer_id: ID, cid: str) -> float:
    """A point in [0, 1) fixed by the node and the key (the first 8 bytes of their sha256): nodes spread evenly,
    and a restarted node keeps its place."""
    digest = hashlib.sha256(peer_id.to_bytes() + cid.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


TRUSTED_ASKED = 2  # trusted peers (bootstrap nodes, the trainer) a node gives its records to and asks for others'
TRUSTED_TIMEOUT = 10.0  # seconds a trusted peer has to answer a lookup or take a record, at first and at least
TRUSTED_TIMEOUT_MOST = 80.0  # up to this
R = TypeVar("R")
# (our peer id, the trusted peer's, the kind of call) -> how long its answers take; a process packs many nodes (benches)
_clocks: dict[tuple[str, str, str], AnswerClock] = {}


def trusted_clock(key: tuple[str, str, str]) -> AnswerClock:
    """How long a trusted peer's answers to one kind of call take here (``AnswerClock``: SRTT + 4 RTTVAR, at least
    ``TRUSTED_TIMEOUT``, doubled after a call ran out, up to ``TRUSTED_TIMEOUT_MOST``). A fixed 10 s abandoned
    every answer of an overloaded bootstrap node, or of one reached from a loaded machine: at N = 256 on one box the
    samplers still searching timed out on 115 of 121 calls in a minute. A backoff that an answer reset to 10 s was
    no better once answers took 10-30 s: the next two calls ran out again (133 of 168 in 8 process-minutes)."""
    clock = _clocks.get(key)
    if clock is None:
        if len(_clocks) >= 4096:
            _clocks.clear()
        clock = _clocks[key] = AnswerClock(TRUSTED_TIMEOUT, TRUSTED_TIMEOUT_MOST)
    return clock


async def provide_forever(swarm: DhtNode, key: str, interval: float) -> None:
    """Provide the readable role key ``key`` (stored under ``dht_key(key)``) to the trusted peers connected
    (``_ask_trusted`` asks them first: one round trip for a newcomer, where a DHT lookup took 10 s and more at
    48-128 samplers), then to the key's closest peers, the DHT's way (``first_dht_provide``), and again on
    ``next_provide``'s schedule."""
    cid = dht_key(key)
    took = await _provide_to_trusted(swarm, cid)
    await trio.sleep(first_dht_provide(took, interval, spread_point(swarm.peer_id, cid)))
    provided = failed = 0
    while True:
        try:
            ok = await swarm.dht.provide(cid)
        except Exception as exc:
            log.debug("provide %s (%s) failed: %s", key, cid, exc)
            ok = False
        provided, failed = (provided + 1, 0) if ok else (0, failed + 1)
        await trio.sleep(next_provide(interval, provided, failed, random.random(), held=took > 0))
        took = await _provide_to_trusted(swarm, cid)


def _trusted_connected(swarm: DhtNode) -> list[ID]:
    """The trusted peers (bootstrap nodes, the trainer) connected now, other than ourselves, at most TRUSTED_ASKED."""
    connected = set(swarm.host.get_connected_peers())
    return [p for p in swarm.trusted if p in connected and p != swarm.peer_id][:TRUSTED_ASKED]


async def _at_trusted(swarm: DhtNode, what: str, call: Callable[[ID], Awaitable[R]]) -> tuple[int, list[R]]:
    """``call`` each trusted peer connected (``_trusted_connected``), all at once, each within ``trusted_clock``'s:
    how many were called, and the results of those that answered in time."""
    called = _trusted_connected(swarm)
    results: list[R] = []

    async def one(peer: ID) -> None:
        # per kind of call: a record given (fire-and-forget, done at once) says nothing of how long an answer takes,
        # and at N = 256 on one box each one reset the lookups' backoff, so they ran out at 10 s for good
        clock = trusted_clock((str(swarm.peer_id), str(peer), what.split(" ", 1)[0]))
        wait = clock.timeout()
        try:
            with timed_by(clock, wait), trio.fail_after(wait):
                results.append(await call(peer))
        except trio.TooSlowError:
            log.debug("%s at %s: no answer within %.0f s", what, peer, wait)
        except Exception as exc:
            log.debug("%s at %s: %s", what, peer, exc)

    async with trio.open_nursery() as nursery:
        for peer in called:
            nursery.start_soon(one, peer)
    return len(called), results


async def _provide_to_trusted(swarm: DhtNode, cid: str) -> int:
    """Give the record to the trusted peers connected; how many took it."""
    _, took = await _at_trusted(swarm, f"provide {cid}", lambda peer: provide_to_peer(swarm.dht, peer, cid))
    return sum(map(bool, took))


async def _ask_trusted(swarm: DhtNode, cid: str) -> tuple[list[PeerInfo], int, int]:
    """Providers as the connected bootstrap peers / trainer know them (every node gives them its records:
    ``provide_forever``); with how many were asked and how many answered in time. py-libp2p's find_providers
    answers from the local store alone once it holds any record, and a node behind a NAT receives records only
    from the peers it is connected to: without this, NATed peers never learn of each other (node/reachability.py)."""
    asked, answers = await _at_trusted(
        swarm, f"providers of {cid}", lambda peer: providers_from_peer(swarm.dht, peer, cid)
    )
    return [info for answer in answers for info in answer], asked, len(answers)


def walk_after_trusted(asked: int, answered: int, found: bool) -> bool:
    """Whether a lookup walks the DHT after asking the trusted peers: when they found nothing and either none was
    asked (none connected) or one answered (they do not hold the record: restarted, or the provider never reached
    them). Not when every one asked was too slow: they are busy, and so, most likely, is the swarm; a walk is tens
    of streams and dials more, and at N = 64-128 on one box the walks that followed such timeouts kept the next
    lookups waiting past their deadlines too. The caller looks again on its own schedule."""
    return not found and (asked == 0 or answered > 0)


async def find_role(swarm: DhtNode, key: str, timeout: float = 10.0) -> list[PeerInfo]:
    """Providers of the readable role key ``key`` (looked up as ``dht_key(key)``) other than ourselves, one entry
    per peer (the DHT may repeat them). The trusted peers connected are asked first: every node gives them its
    records, so their answer is the list, in one round trip each. The DHT walks only as ``walk_after_trusted``
    says, bounded by ``timeout``: a walk of the key's closest peers that took 10 s and more at 48-128 samplers on
    one box."""
    cid = dht_key(key)
    found, asked, answered = await _ask_trusted(swarm, cid)
    if walk_after_trusted(asked, answered, any(i.peer_id != swarm.peer_id for i in found)):
        with trio.move_on_after(timeout):
            try:
                found += list(await swarm.dht.find_providers(cid))
            except Exception as exc:
                log.info("find_providers %s (%s) failed: %s", key, cid, exc)
    unique: dict[str, PeerInfo] = {}
    for info in found:
        if info.peer_id != swarm.peer_id:
            unique.setdefault(str(info.peer_id), info)
    return list(unique.values())


# -- a sampler's place in the swarm ------------------------------------------------------------------------------
REDIAL_TIMEOUT = 5.0  # seconds to try the trainer's last known addresses before asking the DHT
MAX_REMEMBERED = 16  # trainer addresses kept on disk (identify lists a handful)
REMEMBERED_BYTES = 16 << 10  # a larger file is not ours: ignored


def read_trainer_addrs(path: Path, trainer_id: ID) -> list[Multiaddr]:
    """Where this node last reached ``trainer_id``, as ``write_trainer_addrs`` left it: a restarted sampler dials
    the trainer there at once instead of waiting for a DHT lookup (20 s and more on a loaded swarm). A missing,
    unreadable or foreign file (another trainer, not multiaddrs) means nothing remembered."""
    try:
        if path.stat().st_size > REMEMBERED_BYTES:
            raise ValueError(f"larger than {REMEMBERED_BYTES} bytes")
        first, *lines = path.read_text().split()
        if first != str(trainer_id):
            return []
        return [Multiaddr(line) for line in lines[:MAX_REMEMBERED]]
    except FileNotFoundError:
        return []
    except Exception as exc:  # a damaged file costs a DHT lookup, never the start
        log.info("ignoring %s: %s", path, exc)
        return []


def write_trainer_addrs(path: Path, trainer_id: ID, addrs: Sequence[Multiaddr]) -> None:
    """Remember where ``trainer_id`` was reached (its id, then one address per line), replacing the file whole."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join([str(trainer_id), *(str(a) for a in addrs[:MAX_REMEMBERED])]) + "\n")
    os.replace(tmp, path)


P = TypeVar("P", bound=Hashable)


class DialingNode(DhtNode, Protocol):
    """What a sampler's discovery needs of a node: the DHT, and dialing (node/host.py's Swarm)."""

    async def connect(self, info: PeerInfo, timeout: float | None = ...) -> None: ...


def trainer_step(found: bool, connected: bool) -> str:
    """What discovery does about the trainer: 'keep' a found and connected one; 'adopt' one already connected but
    not yet found (it dialled us, or we reached it as a DHT peer: the connection authenticated the trusted id, so no
    lookup is needed; at 64 samplers on one box the DHT lookup took 10 s and more, and samplers connected to the
    trainer waited minutes for it); 'find' it (redial, then the DHT) when its connection is gone."""
    if connected:
        return "keep" if found else "adopt"
    return "find"


QUIET_CAP = 30  # x interval: the longest a sampler with nothing to learn waits between looks (60 s at 2 s)


def next_look(interval: float, quiet: int = 0) -> float:
    """Seconds until discovery looks for samplers again (it wakes at once when a sampler connection is lost): 4x
    ``interval``, doubled for each look in a row that found the mesh settled and taught it nothing (``quiet``: see
    ``mesh_settled``), up to ``QUIET_CAP`` x. N samplers asking the DHT every 8 s forever was N/8 lookups/s of the
    swarm's upkeep (bench/swarm_scale) for a list that changes only when samplers join or leave, and a newcomer
    dials those it finds: the others need not look for it (go-libp2p's backoff discovery does the same). The
    trainer is looked for on its own, every ``interval`` until found (``SamplerDiscovery.keep_trainer``)."""
    return min(QUIET_CAP * interval, 4 * interval * 2 ** min(quiet, 8))


def trusted_providers(found: Sequence[PeerInfo], trainer_id: ID) -> tuple[list[PeerInfo], list[PeerInfo]]:
    """(the trusted trainer's provider records, the others): anyone can provide the trainer's key."""
    return [i for i in found if i.peer_id == trainer_id], [i for i in found if i.peer_id != trainer_id]


def dial_backoff(failures: int) -> float:
    """Seconds before a sampler that could not be dialled ``failures`` times in a row is dialled again."""
    return min(300.0, 10.0 * 2**failures)


SAMPLER_DEGREE = 24  # other samplers a sampler dials until it holds this many: a mesh whose size stays bounded
# dials of other samplers in flight at once: one after another, 24 dials of up to 8 s each held a newcomer's
# discovery loop for minutes at 128 samplers on one box, and with it the next look for the trainer
DIALS_AT_ONCE = 8


def _dial_rank(me: object, peer: object) -> bytes:
    """Each node's own stable order of the others: the dials of a swarm form a random graph, not a clique on the
    first providers every lookup returns, and a node keeps choosing the same peers from one lookup to the next."""
    return hashlib.blake2b(f"{me}|{peer}".encode(), digest_size=8).digest()


def sampler_dials(
    listed: Sequence[P],
    me: P,
    connected: Collection[P],
    not_before: Mapping[str, float],
    now: float,
    have: int = 0,
    degree: int = SAMPLER_DEGREE,
) -> tuple[list[P], list[P]]:
    """Of the samplers the DHT lists: (those already connected, those to dial). A peer whose dials failed lately is
    left alone until ``not_before`` (by ``str(peer)``) has passed; we never dial ourselves. We dial only until we
    hold ``degree`` sampler connections (``have``, those that dialled us included): dialling every listed sampler
    made a clique, N(N-1)/2 connections each with its keepalive, gossip and DHT upkeep (bench/swarm_scale)."""
    known = [p for p in listed if p != me and p in connected]
    free = [p for p in listed if p != me and p not in connected and not_before.get(str(p), 0.0) <= now]
    room = max(0, degree - max(have, len(known)))
    chosen = set(sorted(free, key=lambda p: _dial_rank(me, p))[:room])
    return known, [p for p in free if p in chosen]


GONE_AFTER = 3  # failed dials in a row after which a listed sampler counts as gone (records outlive peers: 48 h)


def mesh_settled(
    listed: Sequence[P],
    me: P,
    connected: Collection[P],
    failures: Mapping[str, int],
    have: int,
    degree: int = SAMPLER_DEGREE,
) -> bool:
    """Whether a sampler's mesh is as full as the DHT's list allows: it holds ``degree`` sampler connections, or
    every listed sampler is connected or has failed ``GONE_AFTER`` dials in a row (by ``str(peer)``). Only then may
    discovery back off (``next_look``): a partitioned or still-growing mesh keeps looking at the base rate."""
    if have >= degree:
        return True
    return all(p == me or p in connected or failures.get(str(p), 0) >= GONE_AFTER for p in listed)


class SamplerDiscovery:
    """A sampler's place in the swarm: the trusted trainer found (first where it was last reached, else through
    the DHT) and kept connected, and every sampler the DHT lists connected to, new ones and those whose connection
    died (a stalled process, a NAT mapping gone), so the swarm heals. Failed dials back off. With ``remember`` (a
    file in the data directory) the trainer's last addresses outlive the process."""

    def __init__(self, swarm_name: str, trainer_id: ID, interval: float, remember: Path | None = None) -> None:
        self.swarm_name = swarm_name
        self.trainer_id = trainer_id
        self.interval = interval
        self.trainer_found = trio.Event()
        # how each (re)connection to the trainer came about
        self.trainer_found_by = {"last_addresses": 0, "dht": 0, "connected": 0}
        self.remember = remember
        # where we last reached the trainer (the peerstore forgets; the file outlives a restart)
        self.trainer_addrs: list[Multiaddr] = read_trainer_addrs(remember, trainer_id) if remember else []
        self.samplers: set[str] = set()  # every sampler the DHT listed that we have been connected to
        self._redial_at: dict[str, tuple[float, int]] = {}  # sampler -> (not before, failures): dial backoff
        self._wake = trio.Event()  # set when a sampler connection is lost: the mesh looks at once
        self._trainer_wake = trio.Event()  # set when the trainer is lost: it is looked for at once
        self.quiet = 0  # looks in a row that taught us nothing (next_look backs off)

    def lost_trainer(self) -> None:
        """The trainer stopped answering (it may have restarted, or moved): find it again, now."""
        self.trainer_found = trio.Event()
        self._trainer_wake.set()

    def lost_connection(self, peer: ID, still_connected: bool) -> None:
        """A connection closed: when it was our last to the trainer or to a sampler we know, look (and redial) now."""
        if still_connected:
            return
        if peer == self.trainer_id:
            self._trainer_wake.set()
        elif str(peer) in self.samplers:
            self.quiet = 0
            self._wake.set()

    async def run(self, swarm: DialingNode) -> None:
        swarm.host.get_network().register_notifee(_Disconnects(self))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.keep_trainer, swarm)
            nursery.start_soon(self.keep_mesh, swarm)

    async def keep_trainer(self, swarm: DialingNode) -> None:
        """The trainer found (every ``interval`` until it is) and kept: looked for again when its connection is
        lost. A task of its own: while the mesh's dials ran first in one loop (up to 24 samplers, 8 at a time, 10 s
        each), a newcomer's next look for the trainer waited for them (bench/swarm_scale, N = 64)."""
        while True:
            self._trainer_wake = trio.Event()
            connected = self.trainer_id in swarm.host.get_connected_peers()
            step = trainer_step(self.trainer_found.is_set(), connected)
            if step == "adopt":
                self.adopt_trainer(swarm)
            elif step == "find":
                await self.find_trainer(swarm)
            elif not self.trainer_addrs:  # adopted before identify said where it listens: take them once it has
                self.remember_trainer(self._listed_trainer_addrs(swarm))
            found = self.trainer_found.is_set() and bool(self.trainer_addrs)
            with trio.move_on_after(QUIET_CAP * self.interval if found else self.interval):
                await self._trainer_wake.wait()

    async def keep_mesh(self, swarm: DialingNode) -> None:
        """Connected to up to our degree of the samplers the DHT lists, looked for on ``next_look``'s schedule."""
        while True:
            self._wake = trio.Event()
            unsettled = await self.connect_samplers(swarm)
            self.quiet = 0 if unsettled else self.quiet + 1
            with trio.move_on_after(next_look(self.interval, self.quiet)):
                await self._wake.wait()

    async def connect_samplers(self, swarm: DialingNode) -> bool:
        """Dial the samplers the DHT lists, up to our degree; whether looking again soon could help (see
        ``mesh_settled``)."""
        before = len(self.samplers)
        listed = {info.peer_id: info for info in await find_role(swarm, role_key(self.swarm_name, "sampler"))}
        now = trio.current_time()
        not_before = {k: at for k, (at, _) in self._redial_at.items()}
        connected = set(swarm.host.get_connected_peers())
        have = sum(1 for p in connected if str(p) in self.samplers)
        known, dial = sampler_dials(list(listed), swarm.peer_id, connected, not_before, now, have)
        self.samplers.update(str(p) for p in known)
        limiter = trio.CapacityLimiter(DIALS_AT_ONCE)

        async def dial_one(peer: ID) -> None:
            key = str(peer)
            async with limiter:
                try:
                    await swarm.connect(listed[peer])
                    self.samplers.add(key)
                    self._redial_at.pop(key, None)
                except Exception as exc:
                    failures = self._redial_at.get(key, (0.0, 0))[1] + 1
                    self._redial_at[key] = (now + dial_backoff(failures), failures)
                    log.debug("cannot reach sampler %s: %s", peer, exc)

        async with trio.open_nursery() as nursery:  # one slow peer must not hold up the others, nor the trainer
            for peer in dial:
                nursery.start_soon(dial_one, peer)
        if len(self._redial_at) > 10_000:
            self._redial_at.clear()
        connected = set(swarm.host.get_connected_peers())
        have = sum(1 for p in connected if str(p) in self.samplers)
        failures = {k: n for k, (_, n) in self._redial_at.items()}
        return len(self.samplers) > before or not mesh_settled(list(listed), swarm.peer_id, connected, failures, have)

    async def find_trainer(self, swarm: DialingNode) -> None:
        if await self.redial_trainer(swarm):
            return
        found = await find_role(swarm, role_key(self.swarm_name, "trainer"))
        log.debug("trainer providers: %s", [str(i.peer_id) for i in found])
        trusted, others = trusted_providers(found, self.trainer_id)
        for info in others:
            log.warning("ignoring trainer provider %s: not the trusted trainer %s", info.peer_id, self.trainer_id)
        for info in trusted:
            try:
                await swarm.connect(info)
            except Exception as exc:
                log.info("trainer %s found but unreachable: %s", info.peer_id, exc)
                continue
            if not self.trainer_found.is_set():
                log.info("found trainer %s through the DHT", info.peer_id)
            self.trainer_found_by["dht"] += 1
            self.remember_trainer(list(info.addrs))
            self.trainer_found.set()

    def adopt_trainer(self, swarm: DialingNode) -> None:
        """The trusted trainer is connected already: take it, and its addresses (as identify gave them) to redial."""
        addrs = self._listed_trainer_addrs(swarm)
        if addrs:  # none yet: identify has not told us where it listens; keep the old ones
            self.remember_trainer(addrs)
        log.info("trainer %s is connected already", self.trainer_id)
        self.trainer_found_by["connected"] += 1
        self.trainer_found.set()

    def _listed_trainer_addrs(self, swarm: DialingNode) -> list[Multiaddr]:
        """The trainer's direct addresses as the peerstore holds them (identify's), if any."""
        try:
            return [a for a in swarm.host.get_peerstore().addrs(self.trainer_id) if not is_relayed_addr(a)]
        except PeerStoreError:
            return []

    def remember_trainer(self, addrs: list[Multiaddr]) -> None:
        """Take ``addrs`` as where the trainer is, on disk too when they changed."""
        changed = addrs != self.trainer_addrs
        self.trainer_addrs = addrs
        if changed and self.remember is not None:
            try:
                write_trainer_addrs(self.remember, self.trainer_id, addrs)
            except OSError as exc:  # a full or read-only disk: the next start looks the trainer up
                log.warning("cannot remember the trainer's addresses in %s: %s", self.remember, exc)

    async def redial_trainer(self, swarm: DialingNode) -> bool:
        """Dial the trainer where we last reached it. A restarted trainer or a healed link is back at once; the
        DHT lookup, needed only when the trainer moved, can take its whole timeout while routes are still stale."""
        if not self.trainer_addrs:
            return False
        try:
            await swarm.connect(PeerInfo(self.trainer_id, self.trainer_addrs), timeout=REDIAL_TIMEOUT)
        except Exception as exc:
            log.debug("trainer not back at its last addresses: %s", exc)
            return False
        if not self.trainer_found.is_set():
            log.info("reconnected to trainer %s at its last addresses", self.trainer_id)
        self.trainer_found_by["last_addresses"] += 1
        self.trainer_found.set()
        return True


class _Disconnects(Notifee):
    """Tells discovery when a connection closes (the host's other events are not its business)."""

    def __init__(self, discovery: SamplerDiscovery) -> None:
        self.discovery = discovery

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        peer = conn.muxed_conn.peer_id
        self.discovery.lost_connection(peer, bool(network.get_connections(peer)))
