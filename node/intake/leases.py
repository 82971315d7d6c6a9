"""Work leases: which (task, seed) prompts went to which sampler, so returned rollouts can be checked.

Leases are kept in issue order, so expiring them is cheap (the oldest are at the front) however many a flood of
identities asks for; each peer may hold only ``max_open_per_peer`` of them at once.

A seed that does not come back trained is not lost: a lease that expires with open seeds, a seed refused without
blame, and a banned peer's seeds all go back in a queue and are leased again to another peer with an accepted
record (never to one that held it before), so a sampler cannot censor prompts by dropping them. Each peer's seeds
never sent back (its leases expired) are counted, fading with time, and a peer leaving far more of its seeds
unreturned than the swarm's typical peer stops getting leases (``refuses_leases``). Peers without an accepted
record share one pool of open leases (``pool_decision``): fresh identities are free, so their total is bounded, not
each one's, to 64 or as many as the peers with a record hold (``pool_size``), whichever is more. When the pool is
full a newcomer may take back the oldest pool lease once it has had ``pool_grace`` seconds, twice what the swarm's
recent leases took to bring a first group back (as the trainer measured it).
"""

from __future__ import annotations

import secrets
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from protocols.work import SamplingParams, TaskSpec, WorkLease
from trainer.tasks import Task

MIN_SEEDS = 16.0  # a peer's non-return record counts only once this many of its leased seeds weigh in
MEDIAN_MIN_SEEDS = 4.0  # peers with at least this many (one lease) make up the swarm's median
HALF_LIFE = 600.0  # seconds: old non-returns fade, so a peer that mends its ways gets work again
MAX_REISSUES = 8  # a seed dropped by this many peers is given up (counted in ``seeds_given_up``)
MAX_REQUEUED = 10_000  # seeds waiting to be leased again; beyond this the oldest are given up
REQUEUE_SCAN = 256  # how far into the queue one lease looks for seeds its peer never held
MAX_PEERS = 10_000  # peers whose return record is kept (the least recently leased are forgotten)
NEWCOMER_POOL = 64  # open leases all peers without an accepted record may hold together
MEDIAN_EVERY = 1.0  # seconds between recomputations of the swarm's median non-return fraction


def refuses_leases(unreturned: float, leased: float, swarm_median: float, min_seeds: float = MIN_SEEDS) -> bool:
    """Whether a peer stops getting leases: once ``min_seeds`` of its seeds weigh in, when it left unreturned more
    than half of them and more than twice the swarm's median fraction (so when every sampler falls behind, the bar
    rises with them, and only the outlier is refused)."""
    if leased < min_seeds:
        return False
    return unreturned / leased > max(0.5, 2.0 * swarm_median)


def swarm_median(records: list[tuple[float, float]], min_seeds: float = MEDIAN_MIN_SEEDS) -> float:
    """The median unreturned fraction over peers with at least ``min_seeds`` leased seeds ((unreturned, leased)
    pairs); 0 when none has that many."""
    fractions = [u / n for u, n in records if n >= min_seeds]
    return statistics.median(fractions) if fractions else 0.0


RETURN_SAMPLES = 64  # recent leases whose first accepted group's return time sets the newcomers' pool grace


def pool_grace(first_returns: list[float], ttl: float) -> float:
    """Seconds a newcomer's pool lease is safe from being taken back for another newcomer: twice the median time
    the swarm's recent leases took to bring their first accepted group back (what the trainer measured), within
    [``ttl`` / 4, ``ttl``]; ``ttl`` / 4 before any came back. A fixed ``ttl`` / 4 (30 s) was shorter than an honest
    sampler's group at 64 s: at N = 256 newcomers took each other's leases back before any group could return,
    and the trainer accepted nothing (bench/swarm_scale). A peer cannot stretch it past ``ttl``, where a lease
    leaves the pool anyway, and one peer's slow returns move a median of 64 little."""
    if not first_returns:
        return ttl / 4
    return min(ttl, max(ttl / 4, 2.0 * statistics.median(first_returns)))


def pool_size(floor: int, trusted_open: int) -> int:
    """How many open leases the peers without an accepted record may hold together: ``floor`` (what a new swarm
    starts with), or as many as the peers with a record hold now (``trusted_open``, within their ttl), whichever is
    more. Onboarding then grows with the swarm, and fresh identities never hold more than half the open leases. A
    fixed 64 capped a growing swarm's intake: a sampler stays a newcomer until 4 groups were accepted, so at
    64 s a group the pool let newcomers return ~1 group/s in all, and at N = 128-256 (bench/swarm_scale) every
    sampler still earning its record waited for a place while the trainer idled."""
    return max(floor, trusted_open)


@dataclass(frozen=True)
class PoolDecision:
    """``revoke``: the pool lease to take back for this one (None: no need); ``wait``: refused, retry after."""

    revoke: str | None = None
    wait: float | None = None


def pool_decision(
    held_by_peer: int, open_pool: list[tuple[str, float]], size: int, grace: float, now: float
) -> PoolDecision:
    """May a newcomer take a lease from the shared pool? ``open_pool``: (lease id, issued at) of the pool's open
    leases, oldest first. Room left: yes. Full: a newcomer already holding a pool lease waits (it returns its groups
    first); one holding none takes back the oldest lease once that has had ``grace`` seconds to come back, so
    identities that hoard leases turn the pool over instead of holding it, and an honest newcomer gets its turn."""
    if len(open_pool) < size:
        return PoolDecision()
    oldest, issued_at = open_pool[0]
    if held_by_peer == 0 and now - issued_at >= grace:
        return PoolDecision(revoke=oldest)
    if held_by_peer:
        return PoolDecision(wait=max(1.0, grace / 4))
    return PoolDecision(wait=max(0.1, issued_at + grace - now))


@dataclass
class LeaseRecord:
    lease: WorkLease
    peer: str
    issued_at: float
    open_seeds: set[int] = field(default_factory=set)
    prior: dict[int, tuple[str, ...]] = field(default_factory=dict)  # re-issued seeds: the peers that held them
    newcomer: bool = False  # drawn from the newcomer pool
    returned: bool = False  # a group of it was accepted


@dataclass
class Returns:
    """A peer's leased and unreturned seeds, both fading with ``HALF_LIFE``."""

    leased: float = 0.0
    unreturned: float = 0.0
    at: float = 0.0

    def now(self, t: float) -> Returns:
        f = 0.5 ** (max(0.0, t - self.at) / HALF_LIFE)
        self.leased, self.unreturned, self.at = self.leased * f, self.unreturned * f, t
        return self


class LeaseBook:
    """Hands out prompts by seed and remembers them until they come back or expire."""

    def __init__(
        self,
        task: Task,
        encode: Callable[[str], list[int]],
        group_size: int,
        sampling: SamplingParams,
        ttl: float = 120.0,
        seed_base: int = 0,
        max_staleness: int | None = None,
        pool_size: int = NEWCOMER_POOL,
    ) -> None:
        self.task = task
        self.encode = encode  # prompt text -> token ids (with BOS)
        self.group_size = group_size
        self.sampling = sampling
        self.ttl = ttl
        self.max_staleness = max_staleness
        self.pool_size = pool_size
        self.first_returns: deque[float] = deque(maxlen=RETURN_SAMPLES)  # issue -> first accepted group, seconds
        self.next_seed = seed_base  # the buffer cursor: saved in checkpoints
        self._leases: dict[str, LeaseRecord] = {}  # insertion order = issue order
        self._pool: dict[str, None] = {}  # newcomers' lease ids still counted against the pool, oldest first
        self.open_by_peer: dict[str, int] = {}
        self.requeued: deque[tuple[int, tuple[str, ...]]] = deque()  # (seed, peers that held it), oldest first
        self.returns: dict[str, Returns] = {}  # least recently leased first
        self._median = (0.0, -MEDIAN_EVERY)  # (value, when computed)
        self._trusted = (0, -MEDIAN_EVERY)  # (open leases of peers with a record, when counted)
        self.issued = 0
        self.seeds_reissued = 0
        self.seeds_given_up = 0
        self.revoked = 0  # newcomer leases taken back for another newcomer

    def open_leases(self, peer: str) -> int:
        """Leases ``peer`` holds that are still within their ttl. A lease past its ttl is one the sampler has
        given up on (its groups are still accepted until twice the ttl), so it no longer counts against the peer:
        an abandoned lease must not lock an honest sampler out of work."""
        self._expire()
        if not self.open_by_peer.get(peer):
            return 0
        return sum(rec.peer == peer for rec in self._within_ttl(time.monotonic()))

    def _within_ttl(self, now: float) -> Iterator[LeaseRecord]:
        """The leases still within their ttl, newest first (kept in issue order: it stops at the first past it)."""
        cutoff = now - self.ttl
        for rec in reversed(self._leases.values()):
            if rec.issued_at < cutoff:
                return
            yield rec

    def refusal(self, peer: str, newcomer: bool) -> tuple[str, float] | None:
        """Why ``peer`` gets no lease now, and when to ask again; None: it may have one (a hoarder's oldest pool
        lease may be taken back for it)."""
        self._expire()
        now = time.monotonic()
        r = self.returns.get(peer)
        if r is not None:
            r.now(now)
            if refuses_leases(r.unreturned, r.leased, self.median(now)):
                return (
                    f"this peer left {r.unreturned:.0f} of its last {r.leased:.0f} leased seeds unreturned: "
                    "no leases until that fades",
                    HALF_LIFE / 10,
                )
        if not newcomer:
            return None
        self._trim_pool(now)
        held = sum(self._leases[lid].peer == peer for lid in self._pool)
        pool = [(lid, self._leases[lid].issued_at) for lid in self._pool]
        size = pool_size(self.pool_size, self.trusted_open(now))
        decision = pool_decision(held, pool, size, self.pool_grace(), now)
        if decision.revoke is not None:
            self._revoke(decision.revoke)
        if decision.wait is not None:
            return f"the {size} leases for peers without an accepted record are all out", decision.wait
        return None

    def trusted_open(self, now: float) -> int:
        """Open leases (within their ttl) of peers with an accepted record, counted at most every
        ``MEDIAN_EVERY`` seconds: the newcomers' pool follows it (``pool_size``)."""
        count, at = self._trusted
        if now - at < MEDIAN_EVERY:
            return count
        count = sum(not rec.newcomer for rec in self._within_ttl(now))
        self._trusted = (count, now)
        return count

    def pool_grace(self) -> float:
        """How long a newcomer's lease is safe from being taken back (``pool_grace``)."""
        return pool_grace(list(self.first_returns), self.ttl)

    def median(self, now: float) -> float:
        """The swarm's median unreturned fraction, recomputed at most every ``MEDIAN_EVERY`` seconds."""
        value, at = self._median
        if now - at >= MEDIAN_EVERY:
            value = swarm_median([(r.now(now).unreturned, r.leased) for r in self.returns.values()])
            self._median = (value, now)
        return value

    def issue(self, peer: str, n_groups: int, version: int, newcomer: bool = False) -> WorkLease:
        """A lease of ``n_groups`` prompts: seeds waiting to be leased again first (to peers with a record only, and
        never to one that held them), then fresh ones."""
        self._expire()
        picked = [] if newcomer else self._take_requeued(peer, n_groups)
        prior = dict(picked)
        seeds = [s for s, _ in picked]
        while len(seeds) < n_groups:
            seeds.append(self.next_seed)
            self.next_seed += 1
        tasks = [TaskSpec(self.task.name, s, self.encode(self.task.prompt(s))) for s in seeds]
        lease = WorkLease(
            secrets.token_hex(8), version, self.group_size, self.sampling, tasks, self.ttl, self.max_staleness
        )
        now = time.monotonic()
        self._leases[lease.lease_id] = LeaseRecord(lease, peer, now, set(seeds), prior, newcomer)
        if newcomer:
            self._pool[lease.lease_id] = None
        self.open_by_peer[peer] = self.open_by_peer.get(peer, 0) + 1
        r = self.returns.pop(peer, None) or Returns(at=now)
        r.now(now).leased += len(seeds)
        self.returns[peer] = r  # re-inserted: most recently leased last
        while len(self.returns) > MAX_PEERS:
            del self.returns[next(iter(self.returns))]
        self.issued += 1
        return lease

    def _take_requeued(self, peer: str, n: int) -> list[tuple[int, tuple[str, ...]]]:
        picked: list[tuple[int, tuple[str, ...]]] = []
        skipped = []
        while self.requeued and len(picked) < n and len(skipped) < REQUEUE_SCAN:
            entry = self.requeued.popleft()
            (skipped if peer in entry[1] else picked).append(entry)
        self.requeued.extendleft(reversed(skipped))
        self.seeds_reissued += len(picked)
        return picked

    def requeue(self, seed: int, holders: tuple[str, ...] = ()) -> None:
        """Lease ``seed`` again later, to none of ``holders``; given up after ``MAX_REISSUES`` holders."""
        if len(holders) >= MAX_REISSUES:
            self.seeds_given_up += 1
            return
        self.requeued.append((seed, holders))
        while len(self.requeued) > MAX_REQUEUED:
            self.requeued.popleft()
            self.seeds_given_up += 1

    def pending_seeds(self) -> list[int]:
        """Seeds leased or waiting to be, not yet trained: a checkpoint keeps them, a restart leases them again."""
        return [s for s, _ in self.requeued] + [s for rec in self._leases.values() for s in sorted(rec.open_seeds)]

    def _forget(self, lease_id: str) -> None:
        rec = self._leases.pop(lease_id)
        self._pool.pop(lease_id, None)
        left = self.open_by_peer.get(rec.peer, 1) - 1
        if left > 0:
            self.open_by_peer[rec.peer] = left
        else:
            self.open_by_peer.pop(rec.peer, None)

    def get(self, lease_id: str) -> LeaseRecord | None:
        return self._leases.get(lease_id)

    def close_seed(self, lease_id: str, seed: int, accepted: bool = True) -> None:
        """The seed came back trained (accepted), or is done with for its holder (``release``)."""
        rec = self._leases.get(lease_id)
        if rec is not None:
            if accepted and not rec.returned:
                rec.returned = True
                self.first_returns.append(time.monotonic() - rec.issued_at)
            rec.open_seeds.discard(seed)
            if not rec.open_seeds:
                self._forget(lease_id)

    def release(self, lease_id: str, seed: int) -> None:
        """The lease's holder sent this seed back refused without blame (stale, say): the seed goes to another
        peer. Not counted as unreturned: an honest sampler that fell behind has groups refused as stale, and the
        non-return rule is for seeds never sent back at all. (A forged seed stays open, each resend a strike; its
        peer's seeds are released when it is banned, or when its lease expires.)"""
        rec = self._leases.get(lease_id)
        if rec is None or seed not in rec.open_seeds:
            return
        self._requeue_from(rec, [seed])
        self.close_seed(lease_id, seed, accepted=False)

    def release_peer(self, peer: str) -> None:
        """``peer`` was banned: every seed it holds goes to another peer now, not when its leases expire."""
        for lid in [lid for lid, rec in self._leases.items() if rec.peer == peer]:
            rec = self._leases[lid]
            self._requeue_from(rec, sorted(rec.open_seeds))
            self._forget(lid)

    def _unreturned(self, rec: LeaseRecord, seeds: list[int]) -> None:
        """Seeds ``rec``'s peer never sent back (its lease expired, or was taken back): counted against it."""
        r = self.returns.get(rec.peer)
        if r is not None:
            r.now(time.monotonic()).unreturned += len(seeds)
        self._requeue_from(rec, seeds)

    def _requeue_from(self, rec: LeaseRecord, seeds: list[int]) -> None:
        for s in seeds:
            self.requeue(s, (*rec.prior.get(s, ()), rec.peer))

    def _revoke(self, lease_id: str) -> None:
        rec = self._leases[lease_id]
        self._unreturned(rec, sorted(rec.open_seeds))
        self._forget(lease_id)
        self.revoked += 1

    def _trim_pool(self, now: float) -> None:
        """A newcomer lease past its ttl no longer holds a place in the pool (as it no longer counts against its
        peer); its seeds stay open until it expires."""
        while self._pool:
            lid = next(iter(self._pool))
            rec = self._leases.get(lid)
            if rec is not None and rec.issued_at >= now - self.ttl:
                break
            del self._pool[lid]

    def _expire(self) -> None:
        # A late group is still useful; keep leases twice their ttl before forgetting them. Oldest first: stop at
        # the first one still valid. Seeds still open then were never returned: they go to another peer.
        cutoff = time.monotonic() - 2 * self.ttl
        while self._leases:
            lid, rec = next(iter(self._leases.items()))
            if rec.issued_at >= cutoff:
                break
            self._unreturned(rec, sorted(rec.open_seeds))
            self._forget(lid)
