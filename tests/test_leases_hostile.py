"""Issue 26, leases: dropping a leased prompt is never free and never censors it (a missing or wrong draw rule is a
strike, refused and expired seeds go to another peer), a peer that leaves its seeds unreturned stops getting
leases, rotating identities share one newcomer lease pool; the ledger keeps the peers with a record under a Sybil
flood; the journal compacts on a timer when no step runs."""

from __future__ import annotations

import shutil
import time

import pytest
import trio

import node.intake as intake_module
from node.intake.journal import RolloutJournal
from node.intake.ledger import OTHERS, Ledger
from node.rpc import Busy, backpressure, request
from protocols import rollouts
from protocols.errors import RemoteError
from protocols.rollouts import RolloutAck, RolloutGroup, Sample
from protocols.work import WorkRequest
from tests.helpers import get_lease, group_for, make_intake, wait_until
from trainer.groups import Group


def later(monkeypatch, seconds: float) -> None:
    """Every clock the lease book reads jumps ``seconds`` ahead."""
    now = time.monotonic()
    monkeypatch.setattr(time, "monotonic", lambda: now + seconds)


async def with_record(intake, peer: str) -> None:
    """``peer`` leases one prompt and returns it: it has an accepted record (``trusted_after=1``)."""
    lease = intake.lease(WorkRequest(1), peer, 0)
    assert (await intake.submit(group_for(intake, peer, lease.tasks[0], lease, ["1", "22"]), peer, 0)).accepted
    assert not intake.is_newcomer(peer)


# -- the draw rule ---------------------------------------------------------------------------------------
async def test_a_lease_holder_omitting_the_draw_rule_is_struck_and_banned(trainer_and_client):
    """Issue 26, 2(d): groups without a ``draw`` field were refused without blame, so a forger omitting it was
    never banned (0 bans). The lease holder knew the rule (the protocol fixes it): now each one is a strike."""
    trainer, client = trainer_and_client
    intake = trainer.role.intake
    me = str(client.peer_id)
    refusals = []
    for _ in range(2):
        lease = await get_lease(client, trainer)
        for spec in lease.tasks:
            samples = [Sample(f"{spec.seed}/{k}", [5, 2], [-1.0, -1.0], "stop") for k in range(lease.group_size)]
            group = RolloutGroup(
                f"g{spec.seed}", lease.lease_id, spec.task_id, spec.seed, 0, me, spec.prompt_ids, 1.0, 1.0, "none",
                samples,
            )  # fmt: skip
            assert "draw" not in group.to_wire()
            while True:
                try:
                    reply = await request(
                        client.host,
                        trainer.swarm.peer_id,
                        rollouts.PROTOCOL_ID,
                        group.to_wire(),
                        max_request=rollouts.MAX_FRAME,
                        max_reply=rollouts.MAX_ACK_FRAME,
                    )
                    refusals.append(RolloutAck.from_wire(reply).rejected[0][1])
                except RemoteError as exc:
                    if (pause := backpressure(exc)) is not None:  # the newcomer budget: not the point here
                        await trio.sleep(pause)
                        continue
                    refusals.append(str(exc))
                break
    assert all("forged" in r for r in refusals[:3]), refusals
    assert me in intake.strikes.banned and "banned" in refusals[3]


async def test_an_unknown_draw_rule_strikes_and_its_seed_goes_to_another_peer(tmp_path, monkeypatch):
    """Issue 26, 3(a): a sampler dropped prompts it disliked by sending them with an unknown draw rule: refused
    without blame, the seed released and never leased again (4 of 55 seeds censored, 0 strikes). Now a missing or
    wrong rule from the lease holder is a strike, and its seed goes to a peer that never held it: when the lease
    expires, or at once when the strikes ban the peer."""
    intake = make_intake(tmp_path, trusted_after=1, max_strikes=3)
    for peer in ("alice", "mallory", "trudy"):
        await with_record(intake, peer)
    lease = intake.lease(WorkRequest(4), "mallory", 0)
    unknown = group_for(intake, "mallory", lease.tasks[0], lease, ["1", "22"])
    unknown["draw"] = "my-own-rule/1"
    reason = (await intake.submit(unknown, "mallory", 0)).rejected[0][1]
    assert "forged" in reason and "splitmix-cdf/1" in reason and intake.strikes.counts == {"mallory": 1}
    later(monkeypatch, 2 * intake.leases.ttl + 1)  # mallory sits on the lease: it expires
    assert not {t.seed for t in lease.tasks} & {t.seed for t in intake.lease(WorkRequest(4), "mallory", 0).tasks}
    assert {t.seed for t in lease.tasks} == {t.seed for t in intake.lease(WorkRequest(4), "alice", 0).tasks}
    # now with a ban: the second and third strikes (a missing rule), and the banned peer's seeds go at once
    lease = intake.lease(WorkRequest(4), "mallory", 0)
    for spec in lease.tasks[:2]:
        missing = group_for(intake, "mallory", spec, lease, ["1", "22"])
        del missing["draw"]
        assert "forged" in (await intake.submit(missing, "mallory", 0)).rejected[0][1]
    assert intake.strikes.is_banned("mallory")
    got = {t.seed for _ in range(2) for t in intake.lease(WorkRequest(4), "trudy", 0).tasks}
    assert {t.seed for t in lease.tasks} <= got  # with the four of mallory's earlier lease, released too
    assert intake.status()["seeds_reissued"] == 12


async def test_an_expired_leases_seeds_go_to_another_peer(tmp_path, monkeypatch):
    """A lease that expires with seeds open (its holder never sent them) leased them to nobody again: a sampler
    could censor prompts by sitting on them. Now they go to another peer with a record, never back to the holder."""
    intake = make_intake(tmp_path, trusted_after=1)
    await with_record(intake, "alice")
    await with_record(intake, "bob")
    lease = intake.lease(WorkRequest(4), "bob", 0)
    kept = {t.seed for t in lease.tasks}
    later(monkeypatch, 2 * intake.leases.ttl + 1)
    assert not kept & {t.seed for t in intake.lease(WorkRequest(4), "bob", 0).tasks}
    assert intake.leases.get(lease.lease_id) is None  # expired (its late groups are refused from now on)
    assert kept == {t.seed for t in intake.lease(WorkRequest(4), "alice", 0).tasks}


async def test_reissued_seeds_survive_a_restart(tmp_path):
    """A checkpoint keeps the seeds leased or waiting to be leased again; a restart leases them again, except those
    whose groups the journal brings back."""
    intake = make_intake(tmp_path, trusted_after=1)
    await with_record(intake, "alice")
    lease = intake.lease(WorkRequest(2), "alice", 0)
    done, waiting = lease.tasks
    saved = intake.begin_checkpoint()
    intake.end_checkpoint(saved)
    assert {done.seed, waiting.seed} <= set(saved["reissue"])
    await intake.submit(group_for(intake, "alice", done, lease, ["1", "22"]), "alice", 0)  # after the checkpoint
    restarted = make_intake(tmp_path, saved, trusted_after=1)
    assert [s for s, _ in restarted.leases.requeued] == [waiting.seed]
    assert waiting.seed in {t.seed for t in restarted.lease(WorkRequest(4), "alice", 0).tasks}


# -- peers that do not return their seeds ----------------------------------------------------------------
def test_the_non_return_rule():
    """A peer is refused once its record weighs (16 seeds), above half unreturned and above twice the median."""
    from node.intake.leases import refuses_leases, swarm_median

    assert not refuses_leases(15, 15, 0.0)  # too little record
    assert refuses_leases(16, 16, 0.0) and refuses_leases(9, 16, 0.0)
    assert not refuses_leases(8, 16, 0.0)  # half: an unlucky honest peer
    assert not refuses_leases(12, 16, 0.4)  # everyone is losing seeds (0.75 < 0.8): the bar rises with the swarm
    assert refuses_leases(13, 16, 0.4)
    assert swarm_median([]) == 0.0
    assert swarm_median([(0, 8), (0, 8), (20, 20), (1, 3)]) == 0.0  # (1, 3): under one lease, not counted
    assert swarm_median([(0, 8), (4, 8), (20, 20)]) == 0.5


async def test_a_peer_that_leaves_its_seeds_unreturned_stops_getting_leases(tmp_path, monkeypatch):
    intake = make_intake(tmp_path, groups_per_lease=8)
    for peer in ("alice", "bob"):
        lease = intake.lease(WorkRequest(8), peer, 0)
        for spec in lease.tasks:
            assert (await intake.submit(group_for(intake, peer, spec, lease, ["1", "22"]), peer, 0)).accepted
    for _ in range(3):
        intake.lease(WorkRequest(8), "hoarder", 0)  # 24 seeds, never sent back
    later(monkeypatch, 2 * intake.leases.ttl + 1)
    with pytest.raises(Busy, match="unreturned") as refused:
        intake.lease(WorkRequest(8), "hoarder", 0)
    assert refused.value.retry_after > 0
    intake.lease(WorkRequest(8), "alice", 0)  # the peers that return their seeds still get work


# -- the newcomer lease pool -----------------------------------------------------------------------------
def test_the_pool_rule():
    from node.intake.leases import PoolDecision, pool_decision

    now = 100.0
    assert pool_decision(0, [("a", 99.0)], 2, 30.0, now) == PoolDecision()  # room left
    full = [("a", 60.0), ("b", 99.0)]
    assert pool_decision(0, full, 2, 30.0, now) == PoolDecision(revoke="a")  # "a" had its grace
    assert pool_decision(1, full, 2, 30.0, now).wait is not None  # holding one already: return it first
    young = [("a", 90.0), ("b", 99.0)]
    assert pool_decision(0, young, 2, 30.0, now) == PoolDecision(wait=pytest.approx(20.0))


async def test_rotating_identities_hold_no_more_than_the_newcomer_pool(tmp_path, monkeypatch):
    """Issue 26, 2(c): 246 identities held 819 leases. Peers without an accepted record now share one pool of open
    leases; a peer with a record is not touched by it, and once a hoarded lease had its grace a newcomer takes it."""
    intake = make_intake(tmp_path, trusted_after=1)
    await with_record(intake, "alice")
    issued = []
    for k in range(300):
        try:
            issued.append(intake.lease(WorkRequest(4), f"sybil{k}", 0))
        except Busy:
            pass
    assert len(issued) <= 64, f"{len(issued)} identities hold a lease"
    from node.intake.leases import NEWCOMER_POOL

    assert len(issued) == NEWCOMER_POOL
    with pytest.raises(Busy, match="without an accepted record"):
        intake.lease(WorkRequest(4), "carol", 0)
    intake.lease(WorkRequest(4), "alice", 0)  # not a newcomer: not from the pool
    later(monkeypatch, intake.leases.pool_grace() + 1)
    carol = intake.lease(WorkRequest(4), "carol", 0)  # the oldest hoarded lease is taken back for her
    assert intake.leases.get(issued[0].lease_id) is None and intake.leases.get(carol.lease_id) is not None
    open_sybil = sum(intake.leases.get(lease.lease_id) is not None for lease in issued)
    assert open_sybil == NEWCOMER_POOL - 1
    # the seeds taken back go to a peer with a record
    assert {t.seed for t in issued[0].tasks} <= {t.seed for t in intake.lease(WorkRequest(4), "alice", 0).tasks}


def test_the_pool_grace_is_twice_the_measured_first_return_within_a_quarter_and_all_of_the_lease():
    from node.intake.leases import pool_grace

    assert pool_grace([], 120.0) == 30.0  # nothing measured yet: a quarter of the lease
    assert pool_grace([5.0, 6.0, 7.0], 120.0) == 30.0  # fast samplers: never under a quarter
    assert pool_grace([40.0, 45.0, 50.0], 120.0) == 90.0
    assert pool_grace([64.0] * 10, 120.0) == 120.0  # never past the lease's life
    assert pool_grace([10.0] * 40 + [10_000.0] * 20, 120.0) == 30.0  # a third of slow returns move the median little


def test_the_newcomers_pool_grows_with_the_leases_peers_with_a_record_hold():
    from node.intake.leases import pool_size

    assert pool_size(64, 0) == 64  # a new swarm: the floor
    assert pool_size(64, 10) == 64
    assert pool_size(64, 200) == 200  # as many as the peers with a record hold: never more than half of all


def test_newcomers_may_hold_as_many_leases_as_the_peers_with_a_record_hold(tmp_path, monkeypatch):
    """At N = 128-256 with 64 s groups the fixed pool of 64 let newcomers return ~1 group/s in all while most of
    the swarm was still earning its record (bench/swarm_scale). The pool now follows the trusted peers' leases."""
    from node.intake.leases import NEWCOMER_POOL

    intake = make_intake(tmp_path)
    book = intake.leases
    trusted = NEWCOMER_POOL + 36
    for k in range(trusted):
        book.issue(f"trusted{k}", 1, 0)
    later(monkeypatch, 2.0)  # the count is refreshed each second
    for k in range(trusted):
        assert book.refusal(f"new{k}", newcomer=True) is None
        book.issue(f"new{k}", 1, 0, newcomer=True)
    refused = book.refusal("one_more", newcomer=True)
    assert refused is not None and f"the {trusted} leases" in refused[0]
    later(monkeypatch, book.ttl + 1)  # every trusted lease past its ttl: the pool is back at its floor
    assert book.trusted_open(time.monotonic()) == 0


async def test_slow_honest_newcomers_keep_their_leases_past_a_quarter_of_the_lease(tmp_path, monkeypatch):
    """At N = 256 with samplers taking 64 s a group, newcomers took back each other's leases after the fixed
    30 s grace, before any group could come back: nothing was accepted. The grace now follows what the trainer
    measured: twice the time leases took to bring a first accepted group back."""
    from node.intake.leases import NEWCOMER_POOL

    intake = make_intake(tmp_path, trusted_after=1)
    lease = intake.lease(WorkRequest(1), "alice", 0)
    later(monkeypatch, 64.0)  # alice's group took 64 s
    assert (await intake.submit(group_for(intake, "alice", lease.tasks[0], lease, ["1", "22"]), "alice", 0)).accepted
    assert intake.leases.pool_grace() == intake.leases.ttl  # 2 x 64 s, within the lease's life
    slow = [intake.lease(WorkRequest(1), f"slow{k}", 0) for k in range(NEWCOMER_POOL)]
    later(monkeypatch, 40.0)  # 40 s into their leases: past the old fixed grace of 30 s
    with pytest.raises(Busy, match="without an accepted record"):
        intake.lease(WorkRequest(1), "carol", 0)
    assert all(intake.leases.get(s.lease_id) is not None for s in slow)  # none taken back


# -- the ledger ------------------------------------------------------------------------------------------
def test_the_ledger_keeps_old_honest_peers_when_one_group_sybils_arrive():
    """Issue 26, 4: the ledger folded the least recently *added* peer past 10,000 entries: 10k Sybils with one
    group each would have turned the oldest honest samplers back into newcomers. Now the least valuable go."""
    ledger = Ledger()
    honest = [f"honest{i}" for i in range(10)]
    for _ in range(20):
        for peer in honest:
            ledger.accept(peer, 8, max_peers=100)
    for k in range(1000):
        ledger.accept(f"sybil{k}", 8, max_peers=100)
    assert all(ledger.accepted_by_peer.get(p) == 160 for p in honest)
    assert len(ledger.accepted_by_peer) <= 101
    assert sum(ledger.accepted_by_peer.values()) == ledger.rollouts_accepted
    assert ledger.accepted_by_peer[OTHERS] > 0


# -- the journal -----------------------------------------------------------------------------------------
async def test_the_journal_compacts_on_its_timer_without_training_steps(tmp_path, monkeypatch):
    """Issue 26, 4: the journal compacted only at checkpoints, which follow steps: groups without signal (no step
    ever runs) grew it forever. A timer compacts it now; a restart still balances its books."""
    monkeypatch.setattr(intake_module, "COMPACT_AFTER", 4)
    intake = make_intake(tmp_path, groups_per_lease=16)
    lease = intake.lease(WorkRequest(16), "alice", 0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(intake.next_batch, 2, 0)  # the training loop, waiting for a batch that never comes
        for spec in lease.tasks[:12]:  # equal rewards: accepted, dropped as carrying no signal
            assert (await intake.submit(group_for(intake, "alice", spec, lease, ["1", "1"]), "alice", 0)).accepted
        useful = lease.tasks[12]
        await intake.submit(group_for(intake, "alice", useful, lease, ["1", "22"]), "alice", 0)  # buffered
        size = sum(p.stat().st_size for p in (tmp_path / "journal").glob("journal-*.bin"))
        nursery.start_soon(intake.compact_forever, 0.05)
        await wait_until(lambda: intake.journal.compactions >= 1, 10, 0.01, what="a compaction")
        nursery.cancel_scope.cancel()
    assert intake.ledger.groups_trained == 0  # no step ran
    after = sum(p.stat().st_size for p in (tmp_path / "journal").glob("journal-*.bin"))
    assert after < size / 4, (size, after)
    restarted = make_intake(tmp_path)  # the process dies; no checkpoint was ever written
    ledger = restarted.ledger
    assert (ledger.groups_accepted, ledger.groups_no_signal, restarted.buffered) == (13, 12, 1)
    assert ledger.accepted_by_peer == {"alice": 26} and ledger.unaccounted(restarted.buffered) == 0
    assert [g.seed for g, _ in restarted.buffer.queue] == [useful.seed]


def _group(i: int, rewards: list[float]) -> Group:
    return Group(f"g{i}", "peer", 1, "reverse", i, [1, 2], [[3]] * 2, [[-0.5]] * 2, [[-0.5]] * 2, rewards, [0, 0], 1.0)


async def test_a_compaction_cut_short_by_a_crash_loses_nothing(tmp_path):
    """Crash after the restatement was renamed into place but before the segments it restates were deleted: replay
    uses the restatement, each group once and the tally once."""
    j = RolloutJournal(tmp_path / "j")
    j.start_segment(1, [(_group(0, [0.0, 0.0]), ["g0/0"])])  # checkpoint 1's snapshot
    for i in range(1, 6):
        j.append(_group(i, [0.0, 1.0] if i == 5 else [1.0, 1.0]), [f"g{i}/0"])
    shutil.copytree(tmp_path / "j", tmp_path / "before")
    dropped = await j.compact(1, {"g5"}, lambda g: "no_signal")
    assert dropped == 5
    for p in (tmp_path / "before").glob("journal-*.bin"):
        shutil.copy(p, tmp_path / "j" / p.name)  # the old segments are back, as if never deleted
    replayer = RolloutJournal(tmp_path / "j")
    snapshot, new = replayer.replay(1)
    assert snapshot == [] and [g.group_id for g, _ in new] == ["g5"]
    t = replayer.tally
    assert (t.groups, t.rollouts, t.no_signal, t.stale) == (4, 4, 5, 0)
