"""Downloads one version's missing chunks from several peers at once, rarest first, verifying each chunk.

- Peers' have-bitfields are polled on an interval; the origin (the trainer) holds everything.
- Each peer gets a few workers; a worker asks its peer for a small batch of the rarest chunks that the
  peer holds and nobody is fetching yet. The origin is asked only for chunks no other peer holds (or
  when nothing else is moving), which keeps the trainer's upload near one copy of the model.
- Every chunk's blake3 is checked before it is stored. A peer that serves a bad chunk gets a strike
  (node/strikes.py; banned peers are never asked again); the chunk goes back to the pool and is fetched elsewhere.
- A peer that vanishes mid-transfer just loses its workers; its chunks go back to the pool.
- Claiming is not serving. A peer that advertises chunks and then answers "missing" for them (withholding), or
  answers too slowly (a reply must arrive at ``min_rate`` bytes/s or better, so a request's timeout scales with its
  size), is dropped as a source for this download and struck; its claims stop counting towards rarity, and any
  chunk a request failed for becomes one the origin serves, so a liar cannot park chunks out of reach.
- A peer that says "busy" or "rate_limited" (its upload limit) is simply asked again later.
- Endgame (BitTorrent's): once every missing chunk a peer holds is already requested elsewhere, an idle worker asks
  its (non-origin) peer for chunks requested only once so far, a small batch at a time; when every chunk of a
  request has arrived by another route, that request is cancelled. The last chunks of a version no longer wait on
  the slowest peer that happened to be asked first.
- Bytes in flight follow this node's own downlink: at most ``IN_FLIGHT_SECONDS`` of the rate chunks have been
  arriving at (``min_in_flight`` before anything has), and a request's deadline allows for everything requested
  before it. Without that, a node on a slow link asked every peer for megabytes at once, its replies queued behind
  each other on its own downlink, and it timed out and struck honest peers for its own slowness.
- ``wanted`` restricts the download to one route's chunks (a version's patch, or its full files); the
  have-bitfields still index every chunk of the manifest, so peers on either route understand each other.
"""

from __future__ import annotations

import logging
import random
from collections import Counter, deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID

from node.rpc import request
from node.strikes import Strikes
from node.weights.manifest import chunk_sizes
from node.weights.store import BadChunk, ChunkStore
from protocols import weights as w
from protocols.errors import RemoteError

log = logging.getLogger(__name__)

STALL_GRACE = 1.0  # seconds without a chunk arriving after which the origin serves chunks others only claim
ORIGIN_DECLINE_WAIT = 1.0  # seconds before asking the origin again for a chunk it declined (super-seeding)
ENDGAME_BYTES = 1 << 20  # a duplicate (endgame) request asks for about this much
IN_FLIGHT_SECONDS = 4.0  # bytes in flight: this many seconds at the rate chunks have been arriving
RATE_WINDOW = 5.0  # seconds of arrivals the rate is measured over


@dataclass
class DownloadStats:
    bytes_by_peer: dict[str, int] = field(default_factory=dict)
    bad_chunks: int = 0
    failed_requests: int = 0
    withheld: dict[str, int] = field(default_factory=dict)  # advertised chunks a peer then said it lacked
    slow: dict[str, int] = field(default_factory=dict)  # replies that missed their size-scaled deadline
    dropped: list[str] = field(default_factory=list)  # peers no longer asked in this download
    endgame_requests: int = 0  # duplicate requests for chunks already asked of another peer
    cancelled_requests: int = 0  # requests whose every chunk arrived by another route first


class Download:
    def __init__(
        self,
        host: IHost,
        store: ChunkStore,
        manifest: w.Manifest,
        manifest_id: bytes,
        origin: ID | None,
        peers: Callable[[], list[ID]],
        strikes: Strikes,
        *,
        workers_per_peer: int = 1,
        batch: int = w.MAX_CHUNKS_PER_REQUEST,
        have_interval: float = 0.5,
        request_timeout: float = 20.0,
        min_rate: float = 256 << 10,
        max_neighbours: int = 6,
        min_in_flight: int = 4 << 20,
        wanted: Collection[bytes] | None = None,
    ) -> None:
        self.host = host
        self.store = store
        self.manifest = manifest
        self.mid = manifest_id
        self.origin = origin
        self.peers = peers
        self.strikes = strikes
        self.workers_per_peer = workers_per_peer
        # Tensor-aligned chunks are often far below chunk_size, so size requests by a generous guess at a typical
        # chunk (4x the mean, at most chunk_size): on a long-RTT path each request then carries ~4 MiB. (Replies
        # were kept near 1 MiB while py-libp2p's yamux could deadlock; node/libp2p_patches.py removed that.)
        self.sizes = sizes = chunk_sizes(manifest)
        route = list(wanted) if wanted is not None else manifest.all_chunks()
        mean_chunk = max(1, sum(sizes.get(h, 0) for h in route) // max(1, len(route)))
        self.typical = min(manifest.chunk_size, 4 * mean_chunk)
        self.min_in_flight = min_in_flight
        self._arrivals: deque[tuple[float, int]] = deque()  # (when, bytes) of recent chunks, for the rate
        self._started = trio.current_time()
        self.batch = max(1, min(batch, w.MAX_CHUNKS_PER_REQUEST, (4 << 20) // self.typical))
        self.have_interval = have_interval
        self.request_timeout = request_timeout
        self.min_rate = min_rate
        self.max_neighbours = max_neighbours
        self._neighbours: list[ID] = []
        self.failed: set[int] = set()  # chunks a request to a non-origin peer failed for: the origin may serve them
        self.dropped: set[ID] = set()  # peers no longer asked in this download (withholding, too slow)
        self.resting: dict[ID, float] = {}  # peer -> when it may be asked again (it said busy / rate limited)
        self._last_arrival = trio.current_time()
        self.declined: dict[int, float] = {}  # chunk -> when the origin may be asked for it again
        self.chunks = manifest.all_chunks()
        self.index = {h: i for i, h in enumerate(self.chunks)}
        want = set(wanted) if wanted is not None else None
        self.missing: set[int] = {self.index[h] for h in store.missing(manifest) if want is None or h in want}
        self.wanted_count = len(want & set(self.chunks)) if want is not None else len(self.chunks)
        self.in_flight: Counter[int] = Counter()  # chunk -> requests out for it
        self._requests: list[tuple[ID, list[int], trio.CancelScope]] = []  # in flight: (peer, chunks, its scope)
        self.holders: dict[ID, set[int]] = {}
        self.heard: dict[ID, float] = {}  # when each peer's bitfield was last learned
        self.workers: dict[ID, int] = {}
        self.stats = DownloadStats()
        self._order = {i: random.random() for i in range(len(self.chunks))}  # spreads concurrent pulls apart
        self._progress = trio.Event()
        self._starved = trio.Event()

    def fraction_done(self) -> float:
        return 1.0 - len(self.missing) / max(1, self.wanted_count)

    def _poke(self) -> None:
        self._progress.set()
        self._progress = trio.Event()

    # -- choosing chunks ---------------------------------------------------------------------------------
    def rarity(self, i: int, exclude: ID | None = None) -> int:
        """How many credible peers other than the origin (and ``exclude``) claim chunk ``i``."""
        return sum(
            1
            for p, bits in self.holders.items()
            if i in bits and p != exclude and p != self.origin and p not in self.dropped
        )

    def pick(self, peer: ID) -> list[int]:
        bits = self.holders.get(peer, set())
        candidates = [i for i in self.missing if i in bits and not self.in_flight[i]]
        if peer == self.origin:
            # only what no credible peer can give us, unless nothing has arrived for a while (claims are not chunks);
            # never what it just declined to send again (it super-seeds: the first copies go to different peers)
            now = trio.current_time()
            candidates = [i for i in candidates if self.declined.get(i, 0.0) <= now]
            unique = [i for i in candidates if self.rarity(i) == 0 or i in self.failed]
            stalled = trio.current_time() - self._last_arrival > STALL_GRACE
            candidates = unique or (candidates if stalled or not any(self.in_flight.values()) else [])
        elif not candidates:
            return self._fit(self._endgame(peer, bits))
        candidates.sort(key=lambda i: (self.rarity(i, exclude=peer), self._order[i]))
        # the origin's uplink is shared by every downloader: ~1 MiB at a time from it, so a reply never waits behind
        # a long queue (and times out, wasting what the link already carried)
        limit = self.batch if peer != self.origin else max(1, min(self.batch, (1 << 20) // self.typical))
        return self._fit(candidates[:limit])

    # -- pacing by this node's own downlink ------------------------------------------------------------------
    def size_of(self, i: int) -> int:
        return self.sizes.get(self.chunks[i], self.typical)

    def rate(self) -> float:
        """Bytes/s chunks arrived at over the last ``RATE_WINDOW`` seconds (0 before any has)."""
        now = trio.current_time()
        while self._arrivals and now - self._arrivals[0][0] > RATE_WINDOW:
            self._arrivals.popleft()
        span = max(1.0, min(RATE_WINDOW, now - self._started))
        return sum(n for _, n in self._arrivals) / span

    def budget(self) -> int:
        """How many bytes may be requested and not yet arrived: a few seconds of this node's own download rate."""
        return max(self.min_in_flight, int(self.rate() * IN_FLIGHT_SECONDS))

    def bytes_in_flight(self) -> int:
        return sum(self.size_of(i) for _, chunks, _ in self._requests for i in chunks)

    def _fit(self, batch: list[int]) -> list[int]:
        """The head of ``batch`` that fits in the budget (always one chunk: a request must make progress)."""
        room, out = self.budget() - self.bytes_in_flight(), []
        for i in batch:
            room -= self.size_of(i)
            if out and room < 0:
                break
            out.append(i)
        return out

    def _endgame(self, peer: ID, bits: set[int]) -> list[int]:
        """Chunks this peer holds that are requested once, from someone else: the oldest requests first."""
        asked_here = {i for p, chunks, _ in self._requests if p == peer for i in chunks}
        out: list[int] = []
        for _p, chunks, _ in self._requests:
            for i in chunks:
                if i in self.missing and i in bits and self.in_flight[i] == 1 and i not in asked_here and i not in out:
                    out.append(i)
        return out[: max(1, min(self.batch, ENDGAME_BYTES // self.typical))]  # a request's chunk limit holds here too

    def _cancel_superseded(self, mine: list[int]) -> None:
        """Cancel every other request (not the one whose batch is ``mine``) whose chunks have all arrived."""
        for _peer, chunks, scope in self._requests:
            if chunks is not mine and not scope.cancel_called and not any(i in self.missing for i in chunks):
                scope.cancel()
                self.stats.cancelled_requests += 1

    # -- the download ------------------------------------------------------------------------------------
    async def run(self) -> None:
        if not self.missing:
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._poll_haves, nursery)
            while self.missing:
                await self._progress.wait()
            nursery.cancel_scope.cancel()

    def neighbours(self) -> list[ID]:
        """The peers this download works with: at most ``max_neighbours`` of the connected ones (BitTorrent's peer
        set: polling everyone costs the swarm N squared polls), kept while they are useful, plus the origin."""
        connected = [p for p in self.peers() if self._usable(p) and p != self.origin]
        keep = [p for p in self._neighbours if p in connected]
        spare = [p for p in connected if p not in keep]
        random.shuffle(spare)
        self._neighbours = keep + spare[: max(0, self.max_neighbours - len(keep))]
        out = list(self._neighbours)
        if self.origin is not None and not self.strikes.is_banned(self.origin):
            out.append(self.origin)
        return out

    async def _poll_haves(self, nursery: trio.Nursery) -> None:
        """Ask the neighbours what they hold, every ``have_interval`` (sooner when a worker has run out of chunks it
        knows where to get), but not those known to hold everything nor those a chunk reply told us about lately."""
        while True:
            now = trio.current_time()
            stale = [
                p
                for p in self.neighbours()
                if len(self.holders.get(p, ())) < len(self.chunks)
                and now - self.heard.get(p, -1e9) >= self.have_interval
            ]
            async with trio.open_nursery() as polls:
                for peer in stale:
                    polls.start_soon(self._poll_one, peer)
            for peer in list(self.holders):
                while self.workers.get(peer, 0) < self.workers_per_peer and self._usable(peer):
                    self.workers[peer] = self.workers.get(peer, 0) + 1
                    nursery.start_soon(self._worker, peer)
            self._poke()
            await trio.sleep(self.have_interval / 2)
            with trio.move_on_after(self.have_interval / 2):
                await self._starved.wait()
            self._starved = trio.Event()

    def _learn_bits(self, peer: ID, bits: bytes) -> None:
        self.holders[peer] = {i for i in range(len(self.chunks)) if bits[i // 8] & (0x80 >> (i % 8))}
        self.heard[peer] = trio.current_time()

    async def _poll_one(self, peer: ID) -> None:
        self.heard[peer] = trio.current_time()  # asked, answered or not: not again before the interval
        try:
            reply = await request(
                self.host,
                peer,
                w.PROTOCOL_ID,
                w.get_have(self.mid),
                max_request=w.MAX_REQUEST_FRAME,
                max_reply=w.MAX_REPLY_FRAME,
                timeout=5.0,
            )
            _mid, bits = w.parse_have(reply, len(self.chunks))
        except Exception:
            return  # not holding this version (yet), or gone
        self._learn_bits(peer, bits)

    def _usable(self, peer: ID) -> bool:
        return not self.strikes.is_banned(peer) and peer not in self.dropped

    def _drop(self, peer: ID, why: str) -> None:
        """Stop asking ``peer`` for this version; its claims no longer make chunks look available."""
        if peer == self.origin or peer in self.dropped:
            return
        self.dropped.add(peer)
        self.stats.dropped.append(str(peer))
        self.holders.pop(peer, None)
        self.strikes.strike(peer)
        log.warning("not asking %s for version %d any more: %s", peer, self.manifest.version, why)

    async def _worker(self, peer: ID) -> None:
        failures = 0
        try:
            while self.missing and self._usable(peer) and failures < 3:
                rest = self.resting.get(peer, 0.0) - trio.current_time()
                if rest > 0:
                    await trio.sleep(rest)
                if self._requests and self.bytes_in_flight() >= self.budget():
                    with trio.move_on_after(self.have_interval):  # this node's downlink is full: wait for it
                        await self._progress.wait()
                    continue
                batch = self.pick(peer)
                if not batch:
                    self._starved.set()  # nothing known to ask this peer for: learn more sooner
                    with trio.move_on_after(self.have_interval):
                        await self._progress.wait()
                    continue
                if any(self.in_flight[i] for i in batch):
                    self.stats.endgame_requests += 1
                self.in_flight.update(batch)
                entry = (peer, batch, trio.CancelScope())
                self._requests.append(entry)
                ok = True
                try:
                    with entry[2]:
                        ok = await self._fetch(peer, batch)
                finally:
                    self._requests.remove(entry)
                    self.in_flight.subtract(batch)
                failures = 0 if ok else failures + 1  # (a cancelled request: every chunk came another way)
                self._poke()
        finally:
            self.workers[peer] -= 1
            if failures >= 3:
                self.holders.pop(peer, None)  # gone or broken: stop counting its chunks

    async def _fetch(self, peer: ID, batch: list[int]) -> bool:
        hashes = [self.chunks[i] for i in batch]
        deadline = self.request_timeout
        if peer != self.origin:  # the origin is trusted and shared by everyone: only its request timeout applies
            # the peer must send at ``min_rate``, and this reply may queue on our own downlink behind everything
            # requested before it (at the rate chunks have been arriving)
            mine = sum(self.size_of(i) for i in batch)
            queued = self.bytes_in_flight() / (self.rate() or self.min_rate)
            deadline = min(deadline, 3.0 + max(mine / self.min_rate, queued))
        try:
            reply = await request(
                self.host,
                peer,
                w.PROTOCOL_ID,
                w.get_chunks(hashes, self.mid),
                max_request=w.MAX_REQUEST_FRAME,
                max_reply=w.MAX_REPLY_FRAME,
                timeout=deadline,
            )
            found, _missing = w.parse_chunks_reply(reply, hashes, self.manifest.chunk_size)
            bits = w.parse_reply_bits(reply, len(self.chunks))
        except RemoteError as exc:
            if exc.code in ("busy", "rate_limited"):  # its upload limit: ask again later, no blame
                self.resting[peer] = trio.current_time() + min(exc.retry_after or 1.0, 10.0)
                return True
            self._failed(peer, batch, f"{exc}")
            return False
        except trio.TooSlowError:
            key = str(peer)
            self.stats.slow[key] = self.stats.slow.get(key, 0) + 1
            self._failed(peer, batch, f"no reply within {deadline:.1f} s")
            if self.stats.slow[key] >= 2:
                self._drop(peer, f"{self.stats.slow[key]} chunk requests got no reply within their deadline")
            return False
        except Exception as exc:
            self._failed(peer, batch, f"{type(exc).__name__}: {exc}")
            return False
        for h, data in found.items():
            if self.index[h] not in self.missing:
                continue  # it arrived by another route meanwhile (endgame)
            try:
                await trio.to_thread.run_sync(self.store.write, h, data)  # checks blake3 before storing
            except BadChunk:
                self.stats.bad_chunks += 1
                self.strikes.strike(peer)
                log.warning("peer %s served a corrupt chunk %s; fetching it elsewhere", peer, h.hex()[:12])
                continue
            self.missing.discard(self.index[h])
            self.failed.discard(self.index[h])
            self._arrivals.append((trio.current_time(), len(data)))
            self._cancel_superseded(batch)
            self._last_arrival = trio.current_time()
            key = str(peer)
            self.stats.bytes_by_peer[key] = self.stats.bytes_by_peer.get(key, 0) + len(data)
        if bits is not None and peer not in self.dropped:
            self._learn_bits(peer, bits)  # what it holds now, for free: no need to poll it
        lacking = [self.index[h] for h in hashes if h not in found]
        if lacking and peer == self.origin:  # it throttles on purpose ("ask the others first"): not now, then
            until = trio.current_time() + ORIGIN_DECLINE_WAIT
            self.declined.update((i, until) for i in lacking)
        if lacking and peer != self.origin:
            key = str(peer)
            self.stats.withheld[key] = self.stats.withheld.get(key, 0) + len(lacking)
            self.failed.update(lacking)
            self.holders.get(peer, set()).difference_update(lacking)  # refreshed on the next have-poll
            served = self.stats.bytes_by_peer.get(key, 0) // max(1, self.typical)
            if self.stats.withheld[key] >= 4 and self.stats.withheld[key] > served:
                self._drop(peer, f"advertised {self.stats.withheld[key]} chunks it then did not serve")
        return True

    def _failed(self, peer: ID, batch: list[int], why: str) -> None:
        self.stats.failed_requests += 1
        if peer != self.origin:
            self.failed.update(batch)
        log.debug("chunk request to %s failed: %s", peer, why)
