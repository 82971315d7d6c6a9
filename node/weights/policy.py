"""The rules of weight distribution, as pure functions over plain data (node/weights/fetcher.py and
node/weights/sync.py keep the trio mechanics and ask these what to do).

Picking (``pick``). A peer is asked for the missing chunks it holds that nobody is fetching yet, rarest first
(rarity: how many credible peers other than the origin claim a chunk; dropped peers' claims do not count), ties
broken by a per-download random order that spreads concurrent downloaders over different chunks. A request
carries about 4 MiB (``Layout.batch`` chunks of the typical size), the origin's about 1 MiB.

The origin (the trainer) is asked only for chunks no credible peer holds, or that a request to a peer failed
for; for the others only when nothing has arrived for ``STALL_GRACE`` seconds or nothing is in flight (claims
are not chunks), and never for a chunk it declined less than ``ORIGIN_DECLINE_WAIT`` seconds ago.

Endgame (``endgame``). A non-origin peer with nothing new to give is asked for chunks it holds that are requested
exactly once, elsewhere, oldest request first, about ``ENDGAME_BYTES`` at a time.

Pacing (``arrival_rate``, ``in_flight_budget``, ``fit``, ``reply_deadline``). Bytes in flight stay within
``IN_FLIGHT_SECONDS`` of the rate chunks have been arriving at (``min_in_flight`` before any has); a request
always carries at least one chunk. A peer's reply must come at ``min_rate`` or better, allowing for everything
queued before it on this node's own downlink, and within ``request_timeout`` (the origin's: that alone).

Blame (``drop_reason``). A peer whose replies missed their deadline ``SLOW_LIMIT`` times, or that
failed to serve ``WITHHELD_LIMIT`` or more chunks it advertised, more than the typical chunks it did serve, is
dropped from the download (and struck). "busy"/"rate_limited" is no fault: the peer rests as long as
``node.rpc.backpressure`` says.
A worker gives up on its peer after ``WORKER_FAILURES`` failed requests in a row.

Standing (``Standing``, ``request_ended``, ``bench``). Blame above resets with every download, and a peer that
holds each request until a download ends (its chunks arrive from the origin or others meanwhile, its request is
cancelled) is never judged at all: it was asked again every version (issue 26, 3b). So each node also keeps one
``Standing`` per peer across downloads. A request that brings no chunk (an answer of "missing", an error, no answer
in time, or still unanswered ``LAPSE_AFTER`` seconds on when it stopped mattering) lengthens the peer's streak; one
that brings a chunk ends it and earns back one bench. ``UNANSWERED_LIMIT`` in a row (one, for a peer benched
before), or a drop, bench the peer: it is not asked, nor polled, for ``BENCH_SECONDS``, doubling with each bench up
to ``MAX_BENCH_SECONDS``; from its second bench on, each bench is also a strike (``strike_on_bench``). "busy" and
"rate_limited" count neither way.

The origin's strangers (``origin_serves_freely``). The trainer serves chunks from each peer's own upload share only
to peers with a lease or an accepted group; every other peer draws on one share for all of them together
(``STRANGER_SHARE`` of a peer's), unless no such peer is connected (a new swarm: everyone is still fetching its
first version). A new sampler has no lease before it holds weights (it asks for work once its engine runs), so it
fetches from the samplers that do, and the strangers' share is what still moves it when none of them can serve it.

Small versions (``piece_size``, ``keep_piece_size``, ``push_pieces``, ``push_targets``, ``push_copies``,
``lane_messages``, ``push_source_ok``, ``push_source``, ``push_wait``). A version is cut into pieces small enough
that every sampler the origin pushes to gets a different first piece: ``PIECES_PER_PEER`` per peer, at least
``MIN_PIECE``, at most the configured chunk size, and never so small that a full version has more than
``MAX_FULL_PIECES``; the size changes only when the rule's answer moves ``PIECE_HYSTERESIS`` times away (a new size
re-cuts the version's other files, which peers then fetch again). The origin pushes a version's new chunks of its
update route (at most ``protocols.weights.MAX_PUSH_VERSION`` bytes) to the samplers it serves, one share each, and,
when its uplink is known to be faster than theirs (``push_copies``), the next shares too, so each relayer sends its
share to fewer peers (every share, while its uplink sends them faster than its slowest lane leaves slow start); a
receiver takes a pushed chunk only from the origin or from the peer the origin's plan names for it, and does not ask
anyone for a chunk a push is bringing until ``push_wait`` has passed (a relayed piece whose first holder is not
directly connected is not coming: it is asked for at once).

Versions (``is_news``, ``take_announcement``, ``cancel_for_newer``, ``rebuild_now``). A version is worth chasing
when it is newer than the one running and the one being fetched. An announcer whose announcements give nothing
usable ``ANNOUNCE_FAILURES`` times is struck. A newer target cancels a download unless that one is at least
``finish_fraction`` done or the previous download was cancelled too. A build that failed is planned again at once
up to ``BUILD_RETRIES`` times, then only after the poll interval.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

from protocols import weights as w

STALL_GRACE = 1.0  # seconds without a chunk arriving after which the origin serves chunks others only claim
ORIGIN_DECLINE_WAIT = 1.0  # seconds before asking the origin again for a chunk it declined (super-seeding)
ENDGAME_BYTES = 1 << 20  # a duplicate (endgame) request asks for about this much
IN_FLIGHT_SECONDS = 4.0  # bytes in flight: this many seconds at the rate chunks have been arriving
RATE_WINDOW = 5.0  # seconds of arrivals the rate is measured over
REQUEST_BYTES = 4 << 20  # a request to a peer asks for about this much
ORIGIN_REQUEST_BYTES = 1 << 20  # ... and to the origin, whose uplink every downloader shares
SLOW_LIMIT = 2  # replies past their deadline before a peer is dropped
WITHHELD_LIMIT = 4  # advertised chunks not served before a peer may be dropped
WORKER_FAILURES = 3  # failed requests in a row before a worker stops asking its peer
ANNOUNCE_FAILURES = 3  # useless announcements before the announcer is struck
MAX_PENDING_ANNOUNCEMENTS = 64  # announced manifests being fetched at once
ANNOUNCE_REDUNDANCY = 4  # other holders heard announcing a version after which a node keeps its own to itself
BUILD_RETRIES = 3  # rebuild attempts of one target after bad links, before waiting for a newer one
LAPSE_AFTER = 0.5  # seconds a request stayed unanswered, when it stopped mattering, for it to count as unanswered
UNANSWERED_LIMIT = 3  # requests in a row, across downloads, that brought no chunk before a peer is benched
BENCH_SECONDS = 30.0  # a peer's first bench; each further one doubles
MAX_BENCH_SECONDS = 960.0
STRANGER_SHARE = 0.25  # of one peer's upload share: what every peer without a lease or record at the origin shares

PIECES_PER_PEER = 4  # pieces per receiving peer a small version is cut into, at least
MIN_PIECE = 16 << 10  # bytes: no piece smaller (per-piece costs: a hash, a file, a request slot)
MAX_FULL_PIECES = 32768  # pieces of a whole version, at most (~1 MiB of hashes in its manifest)
PIECE_HYSTERESIS = 4  # the piece size changes only when the rule's answer is this many times off
PUSH_GRACE = 1.0  # seconds a pushed piece may be late before it is asked for, besides its transfer time
REANNOUNCE_MOST = 60.0  # seconds: the trainer's re-announcements of one version slow down to one a minute
RELAY_UPLINK = 20e6 / 8  # bytes/s: the slow home uplink a relaying sampler is assumed to have (20 Mbit/s)
INITIAL_WINDOW = 10 * 1448  # bytes a TCP path that was idle may carry in its first round trip (RFC 6928)
MAX_PATH_RTT = 0.4  # seconds: the longest round trip push_copies believes (antipodes ~0.3 s; a peer can slow its pongs)
# of the slowest lane's ramp, the time the copies may take the origin's uplink: bench/wan --delta (origin 25 Mbit/s,
# 6 samplers, 0.66 MB, ramp ~0.94 s) with 2, 3, 5, 6 copies: 1.45, 1.33, 1.54, 1.71 s to the last sampler
RAMP_SHARE = 2 / 3
PUSH_BATCH_BYTES = 512 << 10  # pushed chunks a receiver does not relay, packed into one message up to this
PLAN_WAIT = 2.0  # seconds a relayed piece that came before this node's plan of its version waits for that plan

P = TypeVar("P", bound=Hashable)


@dataclass(frozen=True)
class FetchSettings:
    """The knobs of one download (node/settings.py's WeightSettings holds those a user sets)."""

    workers_per_peer: int = 1  # concurrent requests per peer
    batch: int = w.MAX_CHUNKS_PER_REQUEST  # most chunks per request
    have_interval: float = 0.5  # seconds between polls of a peer's have-bitfield
    request_timeout: float = 20.0  # most seconds for one request
    min_rate: float = 256 << 10  # bytes/s a peer's reply must come at
    max_neighbours: int = 6  # peers a download works with besides the origin
    min_in_flight: int = 4 << 20  # bytes in flight allowed before the arrival rate is known


@dataclass(frozen=True)
class Layout:
    """What a download fixes when it starts: the manifest's chunks by index, their sizes, how many make a request."""

    chunks: tuple[bytes, ...]
    sizes: tuple[int, ...]  # bytes of each chunk, by index
    typical: int  # the chunk size requests are planned with
    batch: int  # most chunks per request to a peer
    origin_batch: int  # ... to the origin
    endgame_batch: int  # ... in an endgame request
    order: tuple[float, ...]  # tie-break among equally rare chunks
    index: Mapping[bytes, int] = field(default_factory=dict)

    @classmethod
    def of(
        cls, chunks: Sequence[bytes], sizes: Mapping[bytes, int], route: Collection[bytes], chunk_size: int,
        batch: int, order: Sequence[float],
    ) -> Layout:  # fmt: skip
        """Tensor-aligned chunks are often far below ``chunk_size``, so requests are sized by a generous guess at a
        typical chunk of ``route`` (4x the mean, at most ``chunk_size``): on a long-RTT path each request then
        carries ~4 MiB."""
        mean = max(1, sum(sizes.get(h, 0) for h in route) // max(1, len(route)))
        typical = min(chunk_size, 4 * mean)
        per_request = max(1, min(batch, w.MAX_CHUNKS_PER_REQUEST, REQUEST_BYTES // typical))
        return cls(
            chunks=tuple(chunks),
            sizes=tuple(sizes.get(h, typical) for h in chunks),
            typical=typical,
            batch=per_request,
            origin_batch=max(1, min(per_request, ORIGIN_REQUEST_BYTES // typical)),
            endgame_batch=max(1, min(per_request, ENDGAME_BYTES // typical)),
            order=tuple(order),
            index={h: i for i, h in enumerate(chunks)},
        )

    def bytes_of(self, chunks: Iterable[int]) -> int:
        return sum(self.sizes[i] for i in chunks)


@dataclass(frozen=True)
class Board:
    """What a download knows when it picks (read-only views of its state; the functions never change them)."""

    missing: Collection[int]
    holders: Mapping[Hashable, Collection[int]]  # peer -> chunks it claims
    in_flight: Mapping[int, int]  # chunk -> requests out for it
    requests: Sequence[tuple[Hashable, Sequence[int]]]  # (peer, chunks) of the requests in flight, oldest first
    origin: Hashable | None
    dropped: Collection[Hashable] = frozenset()  # peers no longer asked: their claims do not count
    failed: Collection[int] = frozenset()  # chunks a request to a peer failed for: the origin may serve them
    declined: Mapping[int, float] = field(default_factory=dict)  # chunk -> when the origin may be asked again
    last_arrival: float = 0.0  # when the last chunk arrived
    expected: Mapping[int, float] = field(default_factory=dict)  # chunk -> until when a push is bringing it


# -- picking ---------------------------------------------------------------------------------------------------
def rarity(chunk: int, board: Board, exclude: Hashable | None = None) -> int:
    """How many credible peers other than the origin (and ``exclude``) claim ``chunk``."""
    return sum(
        1
        for p, bits in board.holders.items()
        if chunk in bits and p != exclude and p != board.origin and p not in board.dropped
    )


def pick(peer: Hashable, board: Board, layout: Layout, now: float, room: int) -> list[int]:
    """The chunks to ask ``peer`` for next (empty: nothing), within ``room`` bytes of the in-flight budget."""
    bits = board.holders.get(peer, frozenset())
    candidates = [
        i for i in board.missing if i in bits and not board.in_flight.get(i, 0) and board.expected.get(i, 0.0) <= now
    ]
    if peer == board.origin:
        candidates = [i for i in candidates if board.declined.get(i, 0.0) <= now]
        unique = [i for i in candidates if rarity(i, board) == 0 or i in board.failed]
        stalled = now - board.last_arrival > STALL_GRACE
        quiet = not any(board.in_flight.values())
        candidates = unique or (candidates if stalled or quiet else [])
        limit = layout.origin_batch
    elif not candidates:
        return fit(endgame(peer, board, layout.endgame_batch), layout.sizes, room)
    else:
        limit = layout.batch
    candidates.sort(key=lambda i: (rarity(i, board, exclude=peer), layout.order[i]))
    return fit(candidates[:limit], layout.sizes, room)


def endgame(peer: Hashable, board: Board, limit: int) -> list[int]:
    """Chunks ``peer`` holds that are requested exactly once, from someone else: the oldest requests first."""
    bits = board.holders.get(peer, frozenset())
    asked_here = {i for p, chunks in board.requests if p == peer for i in chunks}
    out: list[int] = []
    for _peer, chunks in board.requests:
        for i in chunks:
            if i in board.missing and i in bits and board.in_flight.get(i, 0) == 1 and i not in asked_here:
                if i not in out:
                    out.append(i)
    return out[:limit]


def superseded(chunks: Iterable[int], missing: Collection[int]) -> bool:
    """Every chunk of a request has arrived by another route: the request may be cancelled."""
    return not any(i in missing for i in chunks)


def neighbours(current: Sequence[P], connected: Sequence[P], limit: int) -> list[P]:
    """The peers a download works with (BitTorrent's peer set: polling everyone costs the swarm N squared polls):
    those of ``current`` still connected, topped up to ``limit`` from ``connected`` in its order (the caller
    shuffles it, so that downloaders spread over the swarm)."""
    keep = [p for p in current if p in connected]
    spare = [p for p in connected if p not in keep]
    return keep + spare[: max(0, limit - len(keep))]


def due_for_poll(held: int, total: int, heard: float | None, now: float, interval: float) -> bool:
    """Ask a peer for its have-bitfield: unless it holds everything or we learned it less than ``interval`` ago."""
    return held < total and (heard is None or now - heard >= interval)


POLLS_SLOW_AFTER = 2.0  # seconds into a download after which its have-polls space out
POLL_INTERVAL_CAP = 16  # x the base interval: the longest a download waits between polls of one peer


def poll_interval(base: float, elapsed: float) -> float:
    """Seconds between have-polls of one peer, ``elapsed`` seconds into a download: ``base`` for the first
    ``POLLS_SLOW_AFTER`` seconds, then growing with the download's age, up to ``POLL_INTERVAL_CAP`` x ``base``.

    A poll round trip costs the two hosts 0.65 ms of CPU (py-libp2p on loopback, this box), and a download polls up
    to ``max_neighbours`` peers: 12 round trips/s, ~8 ms CPU/s, for as long as the download lasts. So a version cost
    each host in proportion to its download's length, and on a loaded swarm downloads grew longer and cost more
    (bench/swarm_scale: hosts at 8.8 ms CPU/s at N = 64, 18.8 at N = 96 in a window where a version spread; at
    N = 256 146 of 256 samplers held no version after 7 minutes, with ~980 polls pending). A small patch (a second
    or two) is polled as before; a 60 s download asks each peer 20 times instead of 120. Chunk replies still carry
    the server's bitfield, so the peers a download fetches from stay known."""
    if elapsed <= POLLS_SLOW_AFTER:
        return base
    return base * min(POLL_INTERVAL_CAP, elapsed / POLLS_SLOW_AFTER)


def push_pending(missing: Collection[int], expected: Mapping[int, float], now: float) -> float | None:
    """While every chunk a download misses is one a planned push is bringing and not yet due: the seconds until the
    first of them falls due (nobody need be polled or asked before then); None otherwise."""
    due = [expected.get(i) for i in missing]
    if not due or any(t is None or t <= now for t in due):
        return None
    return min(t for t in due if t is not None) - now


# -- pacing ----------------------------------------------------------------------------------------------------
def arrival_rate(arrivals: Iterable[tuple[float, int]], now: float, started: float) -> float:
    """Bytes/s chunks arrived at (``(when, bytes)`` each) over the last ``RATE_WINDOW`` seconds; 0 before any."""
    span = max(1.0, min(RATE_WINDOW, now - started))
    return sum(n for t, n in arrivals if now - t <= RATE_WINDOW) / span


def in_flight_budget(rate: float, min_in_flight: int) -> int:
    """How many bytes may be requested and not yet arrived: a few seconds of this node's own download rate."""
    return max(min_in_flight, int(rate * IN_FLIGHT_SECONDS))


def fit(batch: Sequence[int], sizes: Sequence[int], room: int) -> list[int]:
    """The head of ``batch`` that fits in ``room`` bytes (always one chunk: a request must make progress)."""
    out: list[int] = []
    for i in batch:
        room -= sizes[i]
        if out and room < 0:
            break
        out.append(i)
    return out


HAVE_TIMEOUT = 5.0  # seconds a have-poll may take on an idle node (OwnDelay raises it on a loaded one)
ANSWERS_MOST = 60.0  # seconds: the most a reply's deadline stretches to how long answers take here (OwnDelay)
OWN_DELAY_KEEP = 16  # recent chunk replies whose quickest sets this node's own delay
OWN_DELAY_FACTOR = 4.0  # a reply may take this many times the quickest recent one, whoever sends it


class OwnDelay:
    """How long this node itself makes a weights reply (chunks, manifests) take: ``OWN_DELAY_FACTOR`` x the
    quickest of its last ``OWN_DELAY_KEEP`` replies, from any peer (every reply waits on this node's own loop; on a
    loaded machine that is seconds, and not the peer's fault), or, after requests that ran out at W seconds with no
    reply since, at least 2W (Karn's backoff: how a newcomer that has never been answered in time learns it), up to
    ``ANSWERS_MOST``. The quickest, not the mean: a slow peer cannot raise it while one other answers fast, so
    ``reply_deadline`` still catches it; only when every reply is slow is the node the cause."""

    def __init__(self) -> None:
        self.recent: deque[float] = deque(maxlen=OWN_DELAY_KEEP)
        self.backoff = 0.0

    def answered(self, seconds: float) -> None:
        self.recent.append(seconds)
        self.backoff = 0.0

    def late(self, waited: float) -> None:
        self.backoff = min(ANSWERS_MOST, 2 * max(self.backoff, waited))

    def seconds(self) -> float:
        quickest = OWN_DELAY_FACTOR * min(self.recent) if self.recent else 0.0
        return min(ANSWERS_MOST, max(quickest, self.backoff))


def reply_deadline(
    from_origin: bool, size: int, in_flight: int, rate: float, settings: FetchSettings, answers: float = 0.0
) -> float:  # fmt: skip
    """Seconds a reply of ``size`` bytes may take. The origin is trusted and shared by everyone: only the request
    timeout applies. A peer must send at ``min_rate``, and its reply may queue on our own downlink behind the
    ``in_flight`` bytes requested before it (at the rate chunks have been arriving). Never less than ``answers``
    (up to ``ANSWERS_MOST``): this node's own share of a reply's time (``OwnDelay``), which on a loaded machine is
    its own loop's lag: at 3 s for a 20 KB chunk, a loaded node (bench/swarm_scale, N = 128) gave up on every
    reply, benched the peers that sent them, and never finished a version."""
    if from_origin:
        own = settings.request_timeout
    else:
        queued = in_flight / (rate or settings.min_rate)
        own = min(settings.request_timeout, 3.0 + max(size / settings.min_rate, queued))
    return max(own, min(ANSWERS_MOST, answers))


# -- blame -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Record:
    """One peer's conduct in one download."""

    slow: int = 0  # replies that missed their deadline
    withheld: int = 0  # chunks it advertised and then did not serve
    served: int = 0  # bytes it served


def drop_reason(record: Record, typical: int) -> str | None:
    """Why a peer is no longer asked in this download (and struck), or None while it may be."""
    if record.slow >= SLOW_LIMIT:
        return f"{record.slow} chunk requests got no reply within their deadline"
    if record.withheld >= WITHHELD_LIMIT and record.withheld > record.served // max(1, typical):
        return f"advertised {record.withheld} chunks it then did not serve"
    return None


# -- standing across downloads ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Standing:
    """One peer's conduct as a chunk source across downloads (a ``Record`` covers one download only)."""

    unanswered: int = 0  # requests in a row that brought no chunk
    benches: int = 0  # times it was benched, less one per request since that brought a chunk
    until: float = 0.0  # not asked (nor polled) before then


def bench_seconds(benches: int) -> float:
    """How long the ``benches``-th bench lasts: ``BENCH_SECONDS``, doubling, at most ``MAX_BENCH_SECONDS``."""
    return min(MAX_BENCH_SECONDS, BENCH_SECONDS * 2.0 ** max(0, benches - 1))


def bench(s: Standing, now: float) -> Standing:
    """The peer is not asked again for a while, longer with each bench."""
    benches = s.benches + 1
    return Standing(0, benches, now + bench_seconds(benches))


def request_ended(s: Standing, served: bool, now: float) -> Standing:
    """A request to the peer ended: with a chunk (``served``), or with nothing. ``UNANSWERED_LIMIT`` of the latter in
    a row bench the peer; one is enough for a peer benched before."""
    if served:
        return replace(s, unanswered=0, benches=max(0, s.benches - 1))
    unanswered = s.unanswered + 1
    if unanswered >= (UNANSWERED_LIMIT if s.benches == 0 else 1):
        return bench(s, now)
    return replace(s, unanswered=unanswered)


def benched(s: Standing, now: float) -> bool:
    return now < s.until


def counts_as_unanswered(outstanding: float) -> bool:
    """A request cancelled before its reply (its chunks came another way, or its download ended) counts against
    the peer only if it had been waited on this long: no honest peer is blamed for losing a close race."""
    return outstanding >= LAPSE_AFTER


def strike_on_bench(benches: int) -> bool:
    """A peer benched again before it served anything is a repeat offender: each such bench is a strike."""
    return benches >= 2


def origin_serves_freely(trusted: bool, trusted_connected: bool) -> bool:
    """Whether the origin serves a peer from that peer's own upload share (it has a lease or an accepted group, or
    nobody connected has one yet) or from the one share all strangers draw on."""
    return trusted or not trusted_connected


# -- small versions: pieces and pushes ------------------------------------------------------------------------
def _pow2_floor(n: int) -> int:
    return 1 << max(0, n.bit_length() - 1)


def piece_size(update_bytes: int, peers: int, full_bytes: int, ceiling: int) -> int:
    """Bytes per piece (chunk) for versions whose update is ``update_bytes`` (a patch, or the whole version) pushed
    to ``peers`` samplers: ``PIECES_PER_PEER`` pieces per peer at least, a power of two, at least ``MIN_PIECE`` and
    ``full_bytes / MAX_FULL_PIECES`` (the whole version's pieces stay few enough), at most ``ceiling``."""
    floor = max(MIN_PIECE, 1 << (max(1, -(-full_bytes // MAX_FULL_PIECES)) - 1).bit_length())
    share = _pow2_floor(max(1, update_bytes // (PIECES_PER_PEER * max(1, peers))))
    return max(1024, min(ceiling, max(floor, share)))


def keep_piece_size(current: int, proposed: int) -> int:
    """The piece size to use: ``current`` unless ``proposed`` is ``PIECE_HYSTERESIS`` times off it either way."""
    if current <= 0 or max(current, proposed) >= PIECE_HYSTERESIS * min(current, proposed):
        return proposed
    return current


def push_pieces(route: Sequence[bytes], old: Collection[bytes], sizes: Mapping[bytes, int]) -> list[bytes]:
    """The chunks the origin pushes: those of the update ``route`` that no earlier version had (the others' files
    are held already), in order; none when the version is too big to push or a chunk too big for one message."""
    new = [h for h in dict.fromkeys(route) if h not in old]
    if sum(sizes.get(h, 0) for h in new) > w.MAX_PUSH_VERSION or any(sizes.get(h, 0) > w.MAX_PUSH_BYTES for h in new):
        return []
    return new


def lane_messages(
    own: Sequence[bytes], others: Sequence[bytes], sizes: Mapping[bytes, int], batch_bytes: int = PUSH_BATCH_BYTES
) -> list[list[bytes]]:
    """The chunks of one push lane's messages, in order: the receiver's own share (it relays each piece it holds
    first, so each goes alone, the first relay starting after one piece), then the other shares it gets from the
    origin directly (``copies`` > 1), packed up to ``batch_bytes`` a message (at most ``MAX_PUSH_CHUNKS``): each
    message costs a reply, a handler run and a read of that reply at the origin, not only its bytes."""
    out: list[list[bytes]] = [[h] for h in own]
    batch: list[bytes] = []
    size = 0
    for h in others:
        n = sizes.get(h, 0)
        if batch and (size + n > batch_bytes or len(batch) == w.MAX_PUSH_CHUNKS):
            out.append(batch)
            batch, size = [], 0
        batch.append(h)
        size += n
    if batch:
        out.append(batch)
    return out


def push_targets(capable: Sequence[P], trusted: Collection[P], limit: int = w.MAX_PUSH_PEERS) -> list[P]:
    """Whom the origin pushes to: the peers that speak the push protocol and that it serves from their own share
    (``origin_serves_freely``: a lease or a record, or everyone while none has), at most ``limit``."""
    mine = [p for p in capable if p in trusted] or list(capable)
    return mine[:limit]


def push_source_ok(sender: P, origin: P, first_holder: P | None) -> bool:
    """A pushed chunk is taken from the origin, or from the peer the origin's plan gave it to first; no one else."""
    return sender == origin or (first_holder is not None and sender == first_holder)


def ramp_time(nbytes: int, rtt: float) -> float:
    """Seconds a TCP path of round trip ``rtt`` in slow start (fresh, or one that carried little: from
    ``INITIAL_WINDOW``, doubling each round trip) needs to carry ``nbytes``, whatever its bandwidth:
    log2(nbytes / INITIAL_WINDOW + 1) round trips."""
    return rtt * math.log2(max(0, nbytes) / INITIAL_WINDOW + 1)


def push_copies(
    peers: int,
    origin_uplink: float,
    update_bytes: int = 0,
    slowest_rtt: float = 0.0,
    relay_uplink: float = RELAY_UPLINK,
) -> int:
    """How many samplers the origin sends each pushed piece to itself (``PushPlan.copies``), given its uplink and
    a relayer's (bytes/s; 0: the origin's is unknown, so one copy). With c copies the origin uploads c updates and
    the slowest relayer its share to the n - c others: c = n U / (U + n u) makes the two take equally long. But a
    relay is a second hop on a path between samplers, which carries little else and so is in slow start, each share
    ``ramp_time`` away on the slowest RTT the origin measured; the origin's lanes carried the last version and keep
    their window (raw TCP in bench/wan's lab: 3.2 MB to a peer 170 ms away in 0.21 s after 0.5-6 s idle, 1.4-1.6 s
    on a fresh connection). So the origin sends at least as many copies as its uplink sends (rounded) in
    ``RAMP_SHARE`` of ``ramp_time(update_bytes, slowest_rtt)``, the RTT being the kernel's smallest where it says
    (conns.path_rtt) (every copy, on long paths: the 1.5B replay at 14 samplers, 170 ms,
    1 Gbit/s took 1.5 s with 11 copies and relays, 1.0 s with 14). Not all of it: every lane shares the uplink (a
    25 Mbit/s origin: 3 copies, whose 0.63 s fit 2/3 of its 0.94 s ramp, beat 5, whose 1.05 s did not)."""
    if peers <= 1 or origin_uplink <= 0:
        return 1
    balanced = round(peers * origin_uplink / (origin_uplink + peers * relay_uplink))
    ramp = ramp_time(update_bytes, min(slowest_rtt, MAX_PATH_RTT))  # a peer delaying its pongs buys no more copies
    free = round(RAMP_SHARE * ramp * origin_uplink / update_bytes) if update_bytes > 0 else 0
    return max(1, min(peers, max(balanced, free)))


def push_wait(plan_bytes: int, peers: int, min_rate: float, copies: int = 1, relayed: bool = False) -> float:
    """Seconds to wait for a planned piece before asking anyone for it: a grace, and the shares that go before it at
    ``min_rate``: from the origin itself, its lane to this node (``copies`` shares); relayed, two hops of one share
    (the origin's lane to the piece's first holder, which carries that peer's own share first, then its relay)."""
    return PUSH_GRACE + (2 if relayed else max(1, copies)) * plan_bytes / max(1, peers) / min_rate


def push_source(me: P, first_holder: P, direct: Collection[P], reachable: Collection[P]) -> str | None:
    """Where a planned piece comes from to ``me``: "origin" (the origin sends it here itself), "relay" (its first
    holder relays it, over a direct connection), or None: its first holder is not directly connected here, relays
    go over direct connections only, so nothing is coming and it is asked for at once."""
    if me in direct:
        return "origin"
    return "relay" if first_holder in reachable else None


# -- versions --------------------------------------------------------------------------------------------------
def is_news(version: int, current: int, target: int | None) -> bool:
    """A version newer than the one running and the one being fetched."""
    return version > current and (target is None or version > target)


def take_announcement(
    version: int, mid: bytes, current: int, target: int | None, pending: Collection[bytes], sender_banned: bool
) -> bool:
    """Fetch an announced manifest: news, not already being fetched, from a peer not banned, and few at once."""
    return (
        is_news(version, current, target)
        and mid not in pending
        and not sender_banned
        and len(pending) < MAX_PENDING_ANNOUNCEMENTS
    )


def announce_installed(others_heard: int, redundancy: int = ANNOUNCE_REDUNDANCY) -> bool:
    """Gossip "I hold version V" on installing it only when fewer than ``redundancy`` other peers were heard
    announcing it first (Trickle's suppression, RFC 6206): the first holders tell the swarm, the rest keep quiet.
    Every sampler announcing every version made N announcements per version reach each of N nodes (O(N^2) over the
    swarm, several times over with gossipsub's duplicates); sources are found by polling connected peers anyway, and
    the trainer re-announces. Peers heard are distinct authenticated message origins (a Sybil can only make a few
    more honest nodes keep quiet: they still serve what they hold)."""
    return others_heard < redundancy


def reannounce_delay(interval: float, repeats: int, most: float = REANNOUNCE_MOST) -> float:
    """Seconds before the trainer announces its newest version again, after ``repeats`` re-announcements of it:
    ``interval``, twice that, four times ... up to ``most``; a new version starts over. The repeats are for the
    few nodes that missed the announcement (a late joiner asks the trainer itself), and each one is a message that
    every node in the mesh receives and forwards: at a fixed 2 s they were over half of an idle sampler's CPU
    (bench/swarm_scale, 32 hosts: 0.72 cores, 0.33 with one a minute) and a load that grows with the swarm."""
    return min(most, interval * 2.0 ** min(repeats, 64)) if interval > 0 else most


def strike_announcer(failures: int) -> bool:
    """An announcer whose announcements gave nothing usable this often announces what it cannot produce."""
    return failures >= ANNOUNCE_FAILURES


def manifest_sources(trainer: P, others: Sequence[P], limit: int = 3) -> list[P]:
    """Whom to ask for a manifest by id: the trainer first, then a few other (not banned) peers."""
    return [trainer, *[p for p in others if p != trainer][:limit]]


def cancel_for_newer(fraction_done: float, finish_fraction: float, cancelled_in_a_row: int) -> bool:
    """A newer target cancels a download, unless it is mostly done or the previous one was cancelled too: where the
    trainer publishes faster than a link moves a version, cancelling every time would leave nothing usable."""
    return fraction_done < finish_fraction and cancelled_in_a_row == 0


def rebuild_now(failures: int) -> bool:
    """After a failed build (its bad chunk dropped, its suspect parent unbuilt): plan again at once, a few times."""
    return failures < BUILD_RETRIES
