"""The rollout intake: everything between a sampler's request and a batch the learner can train on, with no
torch in it.

    work request  -> ban check -> rate limit -> lease (prompts by seed)
    rollout group -> rate limit -> schema -> ban / duplicate checks -> verification (lease, rewards, logprobs
                     at the rollout's version via ``score``) -> journal (before the ack) -> buffer -> ack
    next_batch    <- woken whenever a group arrives; stale and no-signal groups are dropped and counted

The ledger accounts for every accepted group; the journal makes acknowledged groups survive a crash.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from node.errors import UserError
from node.intake.buffer import RolloutBuffer, fate, take_batch
from node.intake.journal import RolloutJournal
from node.intake.leases import LeaseBook
from node.intake.ledger import Ledger
from node.intake.verify import Forged, Rejected, RolloutVerifier, ScoreFn
from node.ratelimit import PeerRateLimiter, RateLimited, ip_key, shares, take_all
from node.rpc import Busy
from node.settings import TrainerSettings
from node.strikes import Strikes
from protocols.errors import ProtocolError
from protocols.rollouts import QUANT_MODES, RolloutAck, RolloutGroup
from protocols.work import SamplingParams, WorkLease, WorkRequest
from trainer.groups import Group
from trainer.tasks import Task

log = logging.getLogger(__name__)

MAX_PEERS_TRACKED = 10_000
COMPACT_EVERY = 60.0  # seconds between looks at the journal's growth (``compact_forever``)
COMPACT_AFTER = 256  # groups journaled since the last compaction or checkpoint before the journal is compacted
NEWCOMERS = "(newcomers)"  # the one bucket every peer without a record draws from
# the most of the newcomer budgets one identity, and one IP (an IPv6 /64), may take: fresh identities are free, so
# one that drains the budget, or an attacker rotating through identities, leaves the others their share
NEWCOMER_PEER_SHARE = 0.5
NEWCOMER_IP_SHARE = 0.25
NEWCOMER_WORK_PER_IP = 2  # newcomers at one IP together may ask for as many leases as this many peers


def per_ip(limiter: PeerRateLimiter, ip: str | None) -> list[tuple[PeerRateLimiter, str]]:
    """The draw on ``limiter`` for this IP's share, if a per-IP limit applies to it (not loopback nor an unknown
    or relayed peer's: ``ip_key``)."""
    where = ip_key(ip)
    return [] if where is None else [(limiter, where)]


class Banned(ProtocolError):
    code = "banned"


class RolloutIntake:
    def __init__(
        self,
        task: Task,
        encode_prompt: Callable[[str], list[int]],
        completion_text: Callable[[list[int]], str],
        eos_ids: tuple[int, ...],
        score: ScoreFn,
        journal_dir: Path,
        settings: TrainerSettings,
        scorer_floor: str | None = None,
        transport: str | None = None,
    ) -> None:
        """``scorer_floor``: the noise class of the trainer's own scoring arithmetic when it is not fp32 (a bf16
        scorer: "none/bf16"), which every sampler's limits must then allow for too; ``transport``: "wire8" when
        versions travel int8 rowwise (samplers run the decoded, lossy weights)."""
        s = settings
        self.settings = settings
        sampling = SamplingParams(s.temperature, s.top_p, s.max_tokens)
        self.leases = LeaseBook(task, encode_prompt, s.group_size, sampling, s.lease_ttl, max_staleness=s.max_staleness)
        accept = tuple(q.strip() for q in s.accept_quant.split(",") if q.strip())
        unknown = [q for q in accept if q not in QUANT_MODES]
        if unknown or not accept:
            raise UserError(f"--accept-quant {s.accept_quant!r}: name one or more of {', '.join(QUANT_MODES)}")
        self.verifier = RolloutVerifier(
            task,
            self.leases,
            score,
            completion_text,
            eos_ids,
            s.max_staleness,
            accept,
            scorer_floor,
            MAX_PEERS_TRACKED,
            s.noise_scale_cap,
            transport,
        )
        self.strikes = Strikes(s.max_strikes)
        self.work_limit = PeerRateLimiter(s.work_rate, s.work_burst)
        self.rollout_limit = PeerRateLimiter(s.rollout_rate, s.rollout_burst)
        self.newcomer_limit = PeerRateLimiter(s.newcomer_rate, 4 * s.newcomer_rate)
        self.newcomer_peer_limit = shares(self.newcomer_limit, NEWCOMER_PEER_SHARE)
        self.newcomer_ip_limit = shares(self.newcomer_limit, NEWCOMER_IP_SHARE)
        self.newcomer_work_ip_limit = PeerRateLimiter(
            NEWCOMER_WORK_PER_IP * s.work_rate, NEWCOMER_WORK_PER_IP * s.work_burst
        )
        self.journal = RolloutJournal(journal_dir)
        self.buffer = RolloutBuffer(s.max_buffered)
        self.ledger = Ledger()
        self._flat_run = 0  # groups without reward variance since the last usable one
        self.pending = 0  # groups taken for the batch being assembled, not yet trained: still "buffered"
        self.rejected = 0
        self.forged = 0
        self.refused_by_peer: dict[str, int] = {}  # groups rejected or forged, per peer (for the dashboard)
        self.first_accepted_at: float | None = None  # monotonic time of the first group: the trainer's work starts
        self._checking: dict[tuple[str, str, int], trio.Event] = {}  # submissions being checked, by peer/lease/seed
        self._arrived = trio.Event()
        self._batch: list[Group] = []  # the groups taken for the batch being assembled or trained
        self._trained_ids: set[str] = set()  # groups trained since the last checkpoint cut (a restart retrains them)
        self._base_epoch = 0  # the journal segment the checkpoint on disk names
        self._cutting = False  # a checkpoint is being cut: no compaction meanwhile
        self._compacted_at = 0  # journal appends at the last compaction or checkpoint

    # -- work --------------------------------------------------------------------------------------------
    def known(self, peer: object) -> bool:
        """Leased work before, or had a group accepted: the trainer's own upload goes to these."""
        return str(peer) in self.leases.returns or self.has_record(peer)

    def has_record(self, peer: object) -> bool:
        """Had a group accepted here."""
        return str(peer) in self.ledger.accepted_by_peer

    def admit_work(self, peer: str, ip: str | None = None) -> None:
        """When a work stream opens, before anything is read: banned peers, floods and lease hoarders stop here.
        Peers without a record at one IP together ask for leases at most as fast as ``NEWCOMER_WORK_PER_IP``
        peers: identities rotated through from one place to hoard leases are bounded, and nobody elsewhere is."""
        if self.strikes.is_banned(peer):
            raise Banned("this peer is banned for forged rollouts")
        draws = [(self.work_limit, peer)]
        if self.is_newcomer(peer):
            draws += per_ip(self.newcomer_work_ip_limit, ip)
        take_all(draws)
        held = self.leases.open_leases(peer)
        if held >= self.settings.max_open_leases:
            raise Busy(f"this peer holds {held} open leases: send their groups first", retry_after=5.0)

    def is_newcomer(self, peer: str) -> bool:
        accepted_groups = self.ledger.accepted_by_peer.get(peer, 0) // max(1, self.settings.group_size)
        return accepted_groups < self.settings.trusted_after

    def admit_rollouts(self, peer: str, ip: str | None = None) -> None:
        """When a rollout frame's header has arrived, before its body is read or decoded: a flood costs only this.
        Peers without a record of accepted groups also share one newcomer budget: each verification costs a
        forward pass, and fresh identities are free, so their total is what is bounded, not each one's. One
        identity, and one IP, may take only a share of it (drawn here), so neither a greedy newcomer nor
        identities rotated through from one place can drain it: a new honest sampler elsewhere still gets its
        first groups checked. The shared budget itself is only looked at here (a newcomer is refused when it is
        out) and drawn once a group's body has arrived (``charge_newcomer``, from ``submit``): drawn here, 40
        identities at 40 addresses sending only frame headers drained it for everyone."""
        if self.strikes.is_banned(peer):
            raise Banned("this peer is banned for forged rollouts")
        draws = [(self.rollout_limit, peer)]
        if self.is_newcomer(peer):
            wait = self.newcomer_limit.wait(NEWCOMERS)
            if wait > 0:  # out for now: refused before anything else is spent
                self.newcomer_limit.refused[NEWCOMERS] = self.newcomer_limit.refused.get(NEWCOMERS, 0) + 1
                raise RateLimited(wait)
            draws += [(self.newcomer_peer_limit, peer)]
            draws += per_ip(self.newcomer_ip_limit, ip)
        take_all(draws)

    def charge_newcomer(self, peer: str) -> None:
        """A newcomer's group has arrived whole: it draws on the shared newcomer budget, or is refused
        (RateLimited) before it is checked. Peers with a record draw nothing."""
        if self.is_newcomer(peer):
            self.newcomer_limit.take(NEWCOMERS)

    def lease(self, req: WorkRequest, peer: str, version: int) -> WorkLease:
        """Prompts for ``peer`` (admitted by ``admit_work`` when its stream opened), unless it leaves far more of
        its seeds unreturned than the swarm does, or it is a newcomer and the newcomers' lease pool is out."""
        newcomer = self.is_newcomer(peer)
        refused = self.leases.refusal(peer, newcomer)
        if refused is not None:
            raise Busy(refused[0], retry_after=refused[1])
        return self.leases.issue(peer, min(req.max_groups, self.settings.groups_per_lease), version, newcomer)

    # -- rollouts ----------------------------------------------------------------------------------------
    async def submit(self, message: dict[str, Any], peer: str, version: int) -> RolloutAck:
        """Check one group and, if it is good, journal it durably and buffer it before acknowledging it.

        Submissions for one (peer, lease, seed) are checked one at a time: a resend, or a copy with fresh rollout
        ids, waits for the first one's verdict and then meets a closed seed or known ids, so one seed can never be
        accepted twice however many copies race in. The peer was admitted (ban, rate limit) by ``admit_rollouts``
        when its frame's header arrived; a newcomer's group draws on the newcomers' shared budget here, or is
        refused (RateLimited) unchecked."""
        g = RolloutGroup.from_wire(message)
        ids = [s.rollout_id for s in g.samples]
        if self.strikes.is_banned(peer):
            return RolloutAck(rejected=[(i, "peer is banned") for i in ids])
        key = (peer, g.lease_id, g.seed)
        while (first := self._checking.get(key)) is not None:
            await first.wait()
        if all(self.buffer.is_duplicate(i) for i in ids):
            return RolloutAck(duplicate=ids)
        self.charge_newcomer(peer)  # a newcomer's group is checked only within the newcomers' shared budget
        self._checking[key] = done = trio.Event()
        try:
            return await self._admit(g, ids, peer, version)
        finally:
            del self._checking[key]
            done.set()

    async def _admit(self, g: RolloutGroup, ids: list[str], peer: str, version: int) -> RolloutAck:
        try:
            group = await self.verifier.verify(g, peer, version)
        except Forged as exc:
            self.forged += 1
            self._count_refusal(peer)
            if self.strikes.strike(peer):
                self.leases.release_peer(peer)  # banned: the seeds it holds go to other peers now
            log.warning("forged rollouts from %s: %s", peer, exc)
            return RolloutAck(rejected=[(i, f"forged: {exc}") for i in ids])
        except Rejected as exc:
            self.rejected += 1
            self._count_refusal(peer)
            self._release(g, peer)
            return RolloutAck(rejected=[(i, str(exc)) for i in ids])
        self.leases.close_seed(g.lease_id, g.seed)
        seq = self.journal.append(group, ids)
        # counted and buffered in the same event-loop turn as the append: a checkpoint cut can never fall between
        # them (a group journaled before a cut but counted after it would be in neither the checkpoint nor the
        # journal segments a restart replays). Training on it before the fsync is harmless; the ack waits.
        self._buffer(group, ids, count=True)
        if self.settings.durable_acks:
            await self.journal.sync(seq)  # group commit: one fsync covers every append made before it
        return RolloutAck(accepted=ids)

    def _release(self, g: RolloutGroup, peer: str) -> None:
        """The lease holder's seed came back unusable: it is spent for that peer (a stale group stays stale, and a
        peer must not be left holding leases it can never return), and leased again to another peer, so refusing
        a prompt never removes it from training."""
        rec = self.leases.get(g.lease_id)
        if rec is not None and rec.peer == peer:
            self.leases.release(g.lease_id, g.seed)

    def _count_refusal(self, peer: str) -> None:
        self.refused_by_peer[peer] = self.refused_by_peer.get(peer, 0) + 1
        if len(self.refused_by_peer) > MAX_PEERS_TRACKED:  # forget the oldest entries: state stays bounded
            for old in list(self.refused_by_peer)[: MAX_PEERS_TRACKED // 10]:
                del self.refused_by_peer[old]

    def _buffer(self, group: Group, ids: list[str], count: bool) -> None:
        if count:
            self.ledger.accept(group.peer, len(ids))
        if self.first_accepted_at is None:
            self.first_accepted_at = time.monotonic()
        self.ledger.groups_stale += self.buffer.add(group, ids)
        self._arrived.set()
        self._arrived = trio.Event()

    # -- batches -----------------------------------------------------------------------------------------
    async def next_batch(self, n_groups: int, version: int) -> list[Group]:
        """Wait until ``n_groups`` usable groups (fresh enough, with reward variance) have arrived."""
        batch: list[Group] = []
        per_peer: Counter = Counter()
        self.buffer.seen_ids.forget_before(version - self.settings.max_staleness)
        while True:
            taken = take_batch(self.buffer.queue, n_groups - len(batch), version, self.settings.max_staleness, per_peer)
            batch += taken.batch
            self._batch = batch
            self.pending = len(batch)
            self.ledger.groups_stale += taken.stale
            self.ledger.groups_no_signal += taken.no_signal
            self._flat_run = 0 if taken.batch else self._flat_run + taken.no_signal
            if self._flat_run >= 256 and self._flat_run - taken.no_signal < 256:
                log.info("256 groups in a row had equal rewards: the task is solved (or hopeless) for this policy")
            if len(batch) == n_groups:
                return batch
            await self._arrived.wait()

    def trained(self, batch: list[Group]) -> None:
        self.ledger.groups_trained += len(batch)
        self._trained_ids.update(g.group_id for g in batch)
        self._batch = []
        self.pending = 0

    @property
    def buffered(self) -> int:
        return len(self.buffer) + self.pending

    # -- crash safety ------------------------------------------------------------------------------------
    def begin_checkpoint(self) -> dict[str, Any]:
        """Cut a journal segment holding the groups buffered now (in the event loop, so no accept slips between
        it and the ledger); returns what the checkpoint must record."""
        epoch = self.journal.epoch + 1
        self.journal.start_segment(epoch, self.buffer.snapshot())
        self._cutting = True
        self._trained_ids.clear()
        return {
            "journal_epoch": epoch,
            "ledger": self.ledger.to_dict(),
            "next_seed": self.leases.next_seed,
            "reissue": self.leases.pending_seeds(),  # leased or waiting, not yet trained: leased again on restart
        }

    def end_checkpoint(self, saved: dict[str, Any]) -> None:
        """The checkpoint is on disk: drop the journal segments it supersedes."""
        self.journal.drop_before(saved["journal_epoch"])
        self._base_epoch = saved["journal_epoch"]
        self._cutting = False
        self._compacted_at = self.journal.appended

    async def compact(self) -> int:
        """Compact the journal without a checkpoint (node/intake/journal.py ``compact``): a restart from the
        checkpoint on disk still finds every group buffered or trained since it; the rest are tallied. Returns
        how many records were dropped (0 while a checkpoint is being cut)."""
        if self._cutting:
            return 0
        keep = {g.group_id for g, _ in self.buffer.queue} | {g.group_id for g in self._batch} | self._trained_ids
        self._compacted_at = self.journal.appended
        return await self.journal.compact(self._base_epoch, keep, fate)

    async def compact_forever(self, every: float = COMPACT_EVERY) -> None:
        """Compact the journal every ``every`` seconds once ``COMPACT_AFTER`` groups were journaled since the last
        compaction or checkpoint: checkpoints follow steps, and when no step runs (every group without signal, or
        the run finished) the journal would otherwise grow as long as groups arrive. Start it beside the training
        loop."""
        while True:
            await trio.sleep(every)
            if self.journal.appended - self._compacted_at >= COMPACT_AFTER:
                dropped = await self.compact()
                log.info("journal compacted: %d groups no restart needs were dropped", dropped)

    def start(self, saved: dict[str, Any] | None) -> None:
        """Call once before accepting anything: puts back the ledger and lease cursor of a checkpoint (``saved``,
        or None for a fresh start), then what it had buffered and everything accepted after it (from the
        journal), then opens a fresh journal segment."""
        epoch = 0
        if saved is not None:
            self.ledger = Ledger.from_dict(saved.get("ledger", {}))
            self.leases.next_seed = saved["next_seed"]
            epoch = saved.get("journal_epoch", 0)
        self._base_epoch = epoch
        snapshot, new = self.journal.replay(epoch)
        for group, ids in snapshot:
            self._buffer(group, ids, count=False)
        for group, ids in new:
            self._buffer(group, ids, count=True)
        self.ledger.absorb(self.journal.tally)  # groups compactions dropped, their fate known
        if saved is not None:
            restored = {g.seed for g, _ in snapshot} | {g.seed for g, _ in new}
            for seed in saved.get("reissue", []):
                if seed not in restored:
                    self.leases.requeue(seed)
        if snapshot or new:
            log.info("journal: %d buffered and %d newer accepted groups restored", len(snapshot), len(new))
        # appends go to a fresh segment after every existing one: earlier segments stay as they are until a
        # checkpoint supersedes them (a later replay still needs their records)
        self.journal.start_segment(max(epoch, self.journal.last_epoch()) + 1, [])

    def status(self) -> dict[str, Any]:
        return {
            "leases_issued": self.leases.issued,
            "seeds_reissued": self.leases.seeds_reissued,  # unreturned or refused seeds leased to another peer
            "seeds_given_up": self.leases.seeds_given_up,
            "leases_revoked": self.leases.revoked,  # newcomer leases taken back for another newcomer
            **self.ledger.to_dict(),  # rollouts and groups accepted (per peer too), and every accepted group's fate
            "groups_buffered": self.buffered,
            "groups_rejected": self.rejected,
            "groups_forged": self.forged,
            "banned": len(self.strikes.banned),
            "peers_struck": len(self.strikes.counts),
            "rate_limited": sum(self.rollout_limit.refused.values()) + sum(self.work_limit.refused.values()),
        }
