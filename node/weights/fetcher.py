"""Downloads one version's missing chunks from several peers at once, rarest first, verifying each chunk.

The rules below are node/weights/policy.py's pure functions; this module is their trio mechanics (workers,
requests, have-polls, timeouts, cancellation).

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
- Standing across versions (``Conduct``, one per node, shared by its downloads): every request to a peer that
  brings no chunk, including one still unanswered when its chunks came another way or its download ended, counts
  against the peer beyond this download; a streak of them, or a drop, benches it (not asked, nor polled) for a
  while growing with repeats, and repeats are strikes. Without that, a peer holding every request until the
  download moved on was never judged and was asked again every version (issue 26, 3b).
- Endgame (BitTorrent's): once every missing chunk a peer holds is already requested elsewhere, an idle worker asks
  its (non-origin) peer for chunks requested only once so far, a small batch at a time; when every chunk of a
  request has arrived by another route, that request is cancelled. The last chunks of a version no longer wait on
  the slowest peer that happened to be asked first.
- Bytes in flight follow this node's own downlink: at most ``IN_FLIGHT_SECONDS`` of the rate chunks have been
  arriving at (``min_in_flight`` before anything has), and a request's deadline allows for everything requested
  before it. Without that, a node on a slow link asked every peer for megabytes at once, its replies queued behind
  each other on its own downlink, and it timed out and struck honest peers for its own slowness.
- Pushed chunks (protocols/weights.py, push): ``expected`` names the chunks a push is bringing and until when; they
  are asked of no one before then (``arrived`` tells the download of each one that came).
- ``wanted`` restricts the download to one route's chunks (a version's patch, or its full files); the
  have-bitfields still index every chunk of the manifest, so peers on either route understand each other.
"""

from __future__ import annotations

import logging
import random
from collections import Counter, deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID

from node.rpc import backpressure, timed_by
from node.strikes import Strikes
from node.weights import policy
from node.weights.manifest import chunk_sizes
from node.weights.policy import FetchSettings, Layout, Record
from node.weights.server import WeightsClient
from node.weights.store import BadChunk, ChunkStore
from protocols import weights as w
from protocols.errors import RemoteError

log = logging.getLogger(__name__)


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

    def record(self, peer: ID) -> Record:
        key = str(peer)
        return Record(self.slow.get(key, 0), self.withheld.get(key, 0), self.bytes_by_peer.get(key, 0))


class Conduct:
    """Every peer's standing as a chunk source across downloads (rules: node/weights/policy.py, "Standing").
    Bounded: the least recently heard of peers are forgotten beyond ``max_peers``."""

    def __init__(self, strikes: Strikes, max_peers: int = 10_000) -> None:
        self.strikes = strikes
        self.max_peers = max_peers
        self.standing: dict[str, policy.Standing] = {}
        self.benches = 0  # benches handed out, all peers together
        self.unanswered: dict[str, int] = {}  # requests that brought nothing, per peer (bounded like ``standing``)
        self.own_delay = policy.OwnDelay()  # how long this node itself makes a chunk reply take

    def get(self, peer: ID) -> policy.Standing:
        return self.standing.get(str(peer), policy.Standing())

    def benched(self, peer: ID, now: float) -> bool:
        s = self.standing.get(str(peer))
        return s is not None and policy.benched(s, now)

    def ended(self, peer: ID, served: bool, now: float) -> None:
        """A request to ``peer`` ended, with a chunk or without."""
        if not served:
            key = str(peer)
            self.unanswered[key] = self.unanswered.pop(key, 0) + 1
        self._set(peer, policy.request_ended(self.get(peer), served, now), now)

    def dropped(self, peer: ID, now: float) -> None:
        """A download dropped ``peer`` (and struck it already): it stays off every download for a while."""
        self._set(peer, policy.bench(self.get(peer), now), now, struck=True)

    def _set(self, peer: ID, new: policy.Standing, now: float, struck: bool = False) -> None:
        key = str(peer)
        old = self.standing.pop(key, policy.Standing())
        self.standing[key] = new  # re-inserted: most recently heard of last
        if new.until > old.until:
            self.benches += 1
            log.warning("not asking %s for chunks for %.0f s (bench %d)", peer, new.until - now, new.benches)
            if not struck and policy.strike_on_bench(new.benches):
                self.strikes.strike(peer)
        for table in (self.standing, self.unanswered):
            while len(table) > self.max_peers:
                del table[next(iter(table))]


class Downlink:
    """When chunks arrived, and how many bytes: this node's own download rate (trio's clock)."""

    def __init__(self) -> None:
        self.started = self.last = trio.current_time()
        self.arrivals: deque[tuple[float, int]] = deque()

    def arrived(self, n: int) -> None:
        self.last = trio.current_time()
        self.arrivals.append((self.last, n))

    def rate(self) -> float:
        now = trio.current_time()
        while self.arrivals and now - self.arrivals[0][0] > policy.RATE_WINDOW:
            self.arrivals.popleft()
        return policy.arrival_rate(self.arrivals, now, self.started)


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
        settings: FetchSettings | None = None,
        wanted: Collection[bytes] | None = None,
        conduct: Conduct | None = None,
        expected: Mapping[bytes, float] | None = None,
    ) -> None:
        """``conduct``: peers' standing across downloads (WeightSync keeps one; default: this download's own);
        ``expected``: chunk hash -> until when (trio's clock) a push is bringing it (WeightSync's, kept current)."""
        self.client = WeightsClient(host)
        self.store = store
        self.manifest = manifest
        self.mid = manifest_id
        self.origin = origin
        self.peers = peers
        self.strikes = strikes
        self.conduct = conduct if conduct is not None else Conduct(strikes)
        self.settings = settings = settings or FetchSettings()
        chunks = manifest.all_chunks()
        route = list(wanted) if wanted is not None else chunks
        order = [random.random() for _ in chunks]  # spreads concurrent pulls apart
        self.layout = Layout.of(chunks, chunk_sizes(manifest), route, manifest.chunk_size, settings.batch, order)
        want = set(wanted) if wanted is not None else None
        index = self.layout.index
        self.missing: set[int] = {index[h] for h in store.missing(manifest) if want is None or h in want}
        self.wanted_count = len(want & set(chunks)) if want is not None else len(chunks)
        self.in_flight: Counter[int] = Counter()  # chunk -> requests out for it
        self._requests: list[tuple[ID, list[int], trio.CancelScope]] = []  # in flight: (peer, chunks, its scope)
        self.holders: dict[ID, set[int]] = {}
        self.heard: dict[ID, float] = {}  # when each peer's bitfield was last learned
        self.workers: dict[ID, int] = {}
        self._polling: set[ID] = set()  # peers with a have-poll in flight
        self._neighbours: list[ID] = []
        self.failed: set[int] = set()  # chunks a request to a non-origin peer failed for: the origin may serve them
        self.dropped: set[ID] = set()  # peers no longer asked in this download (withholding, too slow)
        self.resting: dict[ID, float] = {}  # peer -> when it may be asked again (it said busy / rate limited)
        self.declined: dict[int, float] = {}  # chunk -> when the origin may be asked for it again
        self.expected: Mapping[bytes, float] = expected if expected is not None else {}
        self.downlink = Downlink()
        self.stats = DownloadStats()
        self._progress = trio.Event()
        self._starved = trio.Event()

    def fraction_done(self) -> float:
        return 1.0 - len(self.missing) / max(1, self.wanted_count)

    def _poke(self) -> None:
        self._progress.set()
        self._progress = trio.Event()

    # -- choosing chunks (node/weights/policy.py decides) --------------------------------------------------
    def expected_indices(self) -> dict[int, float]:
        """The chunks of this download a planned push is bringing: index -> until when (trio's clock)."""
        index = self.layout.index
        return {index[h]: t for h, t in self.expected.items() if h in index}

    def board(self) -> policy.Board:
        return policy.Board(
            missing=self.missing,
            holders=self.holders,
            in_flight=self.in_flight,
            requests=[(p, chunks) for p, chunks, _ in self._requests],
            origin=self.origin,
            dropped=self.dropped,
            failed=self.failed,
            declined=self.declined,
            last_arrival=self.downlink.last,
            expected=self.expected_indices(),
        )

    def pick(self, peer: ID) -> list[int]:
        room = self.budget() - self.bytes_in_flight()
        return policy.pick(peer, self.board(), self.layout, trio.current_time(), room)

    def budget(self) -> int:
        """How many bytes may be requested and not yet arrived: a few seconds of this node's own download rate."""
        return policy.in_flight_budget(self.downlink.rate(), self.settings.min_in_flight)

    def bytes_in_flight(self) -> int:
        return sum(self.layout.bytes_of(chunks) for _, chunks, _ in self._requests)

    def _cancel_superseded(self, mine: list[int]) -> None:
        """Cancel every other request (not the one whose batch is ``mine``) whose chunks have all arrived."""
        for _peer, chunks, scope in self._requests:
            if chunks is not mine and not scope.cancel_called and policy.superseded(chunks, self.missing):
                scope.cancel()
                self.stats.cancelled_requests += 1

    def arrived(self, h: bytes, nbytes: int, peer: ID) -> None:
        """Chunk ``h`` (verified, stored) came by push from ``peer``: no longer missing here."""
        i = self.layout.index.get(h)
        if i is None or i not in self.missing:
            return
        self.missing.discard(i)
        self.failed.discard(i)
        self.downlink.arrived(nbytes)
        key = str(peer)
        self.stats.bytes_by_peer[key] = self.stats.bytes_by_peer.get(key, 0) + nbytes
        self._cancel_superseded([])
        self._poke()

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
        """The peers this download works with: at most ``max_neighbours`` of the connected ones, kept while they
        are useful, plus the origin."""
        connected = [p for p in self.peers() if self._usable(p) and p != self.origin]
        random.shuffle(connected)
        self._neighbours = policy.neighbours(self._neighbours, connected, self.settings.max_neighbours)
        out = list(self._neighbours)
        if self.origin is not None and not self.strikes.is_banned(self.origin):
            out.append(self.origin)
        return out

    async def _poll_haves(self, nursery: trio.Nursery) -> None:
        """Ask the neighbours what they hold, every ``have_interval`` at first and less often as the download ages
        (``policy.poll_interval``; the loop looks sooner when a worker has run out of chunks it knows where to get),
        but not those known to hold everything nor those a chunk reply told us about lately, and no one while a
        planned push brings every chunk still missing (``policy.push_pending``)."""
        interval = self.settings.have_interval
        total = len(self.layout.chunks)
        started = trio.current_time()
        while True:
            now = trio.current_time()
            every = policy.poll_interval(interval, now - started)
            pending = policy.push_pending(self.missing, self.expected_indices(), now)
            if pending is not None:  # a push brings all that is missing: no polls (here and at the peers) till due
                with trio.move_on_after(min(pending, interval)):
                    await self._progress.wait()
                continue
            for peer in self.neighbours():
                held = len(self.holders.get(peer, ()))
                if peer not in self._polling and policy.due_for_poll(held, total, self.heard.get(peer), now, every):
                    self._polling.add(peer)
                    nursery.start_soon(self._poll_one, peer, nursery)
            for peer in list(self.holders):
                self._staff(peer, nursery)
            self._poke()
            await trio.sleep(interval / 2)
            with trio.move_on_after(interval / 2):
                await self._starved.wait()
            self._starved = trio.Event()

    def _learn_bits(self, peer: ID, bits: bytes) -> None:
        self.holders[peer] = {i for i in range(len(self.layout.chunks)) if bits[i // 8] & (0x80 >> (i % 8))}
        self.heard[peer] = trio.current_time()

    def _staff(self, peer: ID, nursery: trio.Nursery) -> None:
        """Workers for a peer known to hold chunks, up to ``workers_per_peer``."""
        while self.workers.get(peer, 0) < self.settings.workers_per_peer and self._usable(peer):
            self.workers[peer] = self.workers.get(peer, 0) + 1
            nursery.start_soon(self._worker, peer)

    async def _poll_one(self, peer: ID, nursery: trio.Nursery) -> None:
        """One have-poll, on its own: a slow one holds up neither the other polls nor the workers. Its deadline is
        never below this node's own delay, which it teaches (``OwnDelay``): at a fixed 5 s, 62 of 256 newcomers on
        one box never learned what the trainer holds, asked it for nothing and held no version after 10 minutes."""
        self.heard[peer] = trio.current_time()  # asked, answered or not: not again before the interval
        own = self.conduct.own_delay
        timeout = max(policy.HAVE_TIMEOUT, own.seconds())
        try:
            with timed_by(own, timeout):
                bits = await self.client.have(peer, self.mid, len(self.layout.chunks), timeout)
        except Exception:
            return  # too slow, not holding this version (yet), or gone
        finally:
            self._polling.discard(peer)
        self._learn_bits(peer, bits)
        self._staff(peer, nursery)

    def _usable(self, peer: ID) -> bool:
        return (
            not self.strikes.is_banned(peer)
            and peer not in self.dropped
            and (peer == self.origin or not self.conduct.benched(peer, trio.current_time()))
        )

    def _judge(self, peer: ID) -> None:
        """Stop asking ``peer`` for this version if its conduct says so; its claims no longer make chunks look
        available."""
        why = policy.drop_reason(self.stats.record(peer), self.layout.typical)
        if why is None or peer == self.origin or peer in self.dropped:
            return
        self.dropped.add(peer)
        self.stats.dropped.append(str(peer))
        self.holders.pop(peer, None)
        self.strikes.strike(peer)
        self.conduct.dropped(peer, trio.current_time())
        log.warning("not asking %s for version %d any more: %s", peer, self.manifest.version, why)

    async def _worker(self, peer: ID) -> None:
        failures = 0
        try:
            while self.missing and self._usable(peer) and failures < policy.WORKER_FAILURES:
                rest = self.resting.get(peer, 0.0) - trio.current_time()
                if rest > 0:
                    await trio.sleep(rest)
                if self._requests and self.bytes_in_flight() >= self.budget():
                    with trio.move_on_after(self.settings.have_interval):  # this node's downlink is full: wait
                        await self._progress.wait()
                    continue
                batch = self.pick(peer)
                if not batch:
                    self._starved.set()  # nothing known to ask this peer for: learn more sooner
                    with trio.move_on_after(self.settings.have_interval):
                        await self._progress.wait()
                    continue
                if any(self.in_flight[i] for i in batch):
                    self.stats.endgame_requests += 1
                self.in_flight.update(batch)
                entry = (peer, batch, trio.CancelScope())
                self._requests.append(entry)
                ok, asked_at = True, trio.current_time()
                outcome: list[bool] = []  # _fetch's verdict: did the request bring a chunk (empty: no verdict)
                try:
                    with entry[2]:
                        ok = await self._fetch(peer, batch, outcome)
                finally:
                    self._requests.remove(entry)
                    self.in_flight.subtract(batch)
                    self._standing_after(peer, outcome, trio.current_time() - asked_at)
                failures = 0 if ok else failures + 1  # (a cancelled request: every chunk came another way)
                self._poke()
        finally:
            self.workers[peer] -= 1
            if failures >= policy.WORKER_FAILURES:
                self.holders.pop(peer, None)  # gone or broken: stop counting its chunks

    def _standing_after(self, peer: ID, outcome: list[bool], outstanding: float) -> None:
        """Tell the peer's standing how a request ended: with its verdict, or (cancelled: its chunks came another
        way, or the download ended) as unanswered if it had been waited on long enough. A peer this download
        dropped has been benched for it already."""
        if peer == self.origin or peer in self.dropped:
            return
        if outcome:
            self.conduct.ended(peer, outcome[0], trio.current_time())
        elif policy.counts_as_unanswered(outstanding):
            self.conduct.ended(peer, False, trio.current_time())

    async def _fetch(self, peer: ID, batch: list[int], outcome: list[bool]) -> bool:
        """One request; ``outcome`` gets whether it brought a chunk (nothing for backpressure or a cancel)."""
        hashes = [self.layout.chunks[i] for i in batch]
        size, queued = self.layout.bytes_of(batch), self.bytes_in_flight()
        own = self.conduct.own_delay
        deadline = policy.reply_deadline(
            peer == self.origin, size, queued, self.downlink.rate(), self.settings, own.seconds()
        )
        try:
            with timed_by(own, deadline):  # a node never answered in time must still learn its delay (a newcomer)
                found, bits = await self.client.chunks(
                    peer, hashes, self.mid, self.manifest.chunk_size, len(self.layout.chunks), deadline
                )
        except RemoteError as exc:
            pause = backpressure(exc)
            if pause is not None:  # its upload limit: ask again later, no blame
                self.resting[peer] = trio.current_time() + pause
                return True
            outcome.append(False)
            self._failed(peer, batch, f"{exc}")
            return False
        except trio.TooSlowError:
            outcome.append(False)
            key = str(peer)
            self.stats.slow[key] = self.stats.slow.get(key, 0) + 1
            self._failed(peer, batch, f"no reply within {deadline:.1f} s")
            self._judge(peer)
            return False
        except Exception as exc:
            outcome.append(False)
            self._failed(peer, batch, f"{type(exc).__name__}: {exc}")
            return False
        index = self.layout.index
        came_anyway = 0  # chunks it sent that had arrived by another route meanwhile (no verdict on those)
        for h, data in found.items():
            if index[h] not in self.missing:
                came_anyway += 1
                continue  # it arrived by another route meanwhile (endgame)
            try:
                await trio.to_thread.run_sync(self.store.write, h, data)  # checks blake3 before storing
            except BadChunk:
                self.stats.bad_chunks += 1
                self.strikes.strike(peer)  # whoever served it: every chunk is checked against its hash
                log.warning("peer %s served a corrupt chunk %s; fetching it elsewhere", peer, h.hex()[:12])
                continue
            if not outcome:
                outcome.append(True)  # it served: whatever else this reply holds
            self.missing.discard(index[h])
            self.failed.discard(index[h])
            self.downlink.arrived(len(data))
            self._cancel_superseded(batch)
            key = str(peer)
            self.stats.bytes_by_peer[key] = self.stats.bytes_by_peer.get(key, 0) + len(data)
        if not outcome and not (came_anyway and came_anyway == len(found) == len(hashes)):
            outcome.append(False)  # nothing usable: withheld, or only corrupt chunks
        if bits is not None and peer not in self.dropped:
            self._learn_bits(peer, bits)  # what it holds now, for free: no need to poll it
        lacking = [index[h] for h in hashes if h not in found]
        if lacking and peer == self.origin:  # it throttles on purpose ("ask the others first"): not now, then
            until = trio.current_time() + policy.ORIGIN_DECLINE_WAIT
            self.declined.update((i, until) for i in lacking)
        if lacking and peer != self.origin:
            key = str(peer)
            self.stats.withheld[key] = self.stats.withheld.get(key, 0) + len(lacking)
            self.failed.update(lacking)
            self.holders.get(peer, set()).difference_update(lacking)  # refreshed on the next have-poll
            self._judge(peer)
        return True

    def _failed(self, peer: ID, batch: list[int], why: str) -> None:
        self.stats.failed_requests += 1
        if peer != self.origin:
            self.failed.update(batch)
        log.debug("chunk request to %s failed: %s", peer, why)
