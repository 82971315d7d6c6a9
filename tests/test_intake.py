"""The rollout intake without torch or a network: leases, verification against a scoring function, the ledger,
and a training loop that is woken (not polling) when a batch is ready."""

from __future__ import annotations

import subprocess
import sys

import trio
import trio.testing

from protocols.draw import TokenDraw
from protocols.work import WorkRequest
from tests.helpers import group_for, make_intake, wait_until
from trainer.tasks.reverse import ReverseDigitsTask


async def test_groups_are_verified_acked_once_and_wake_the_training_loop(tmp_path):
    intake = make_intake(tmp_path)
    task = ReverseDigitsTask()
    intake.admit_work("alice")
    lease = intake.lease(WorkRequest(4), "alice", version=0)
    right = [task.answer(spec.seed) for spec in lease.tasks]
    batches: list = []

    async def train_loop() -> None:
        batches.append(await intake.next_batch(2, version=0))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(train_loop)
        ack = await intake.submit(group_for(intake, "alice", lease.tasks[0], lease, [right[0], "00000"]), "alice", 0)
        assert len(ack.accepted) == 2
        again = await intake.submit(group_for(intake, "alice", lease.tasks[0], lease, [right[0], "00000"]), "alice", 0)
        assert len(again.duplicate) == 2 and not again.accepted
        # all rewards equal: accepted (the sampler did its job) but no signal to train on
        await intake.submit(group_for(intake, "alice", lease.tasks[1], lease, [right[1], right[1]]), "alice", 0)
        await trio.testing.wait_all_tasks_blocked()
        assert not batches  # one usable group so far: the loop sleeps until another arrives
        await intake.submit(group_for(intake, "alice", lease.tasks[2], lease, ["1", right[2]]), "alice", 0)
    assert [g.seed for g in batches[0]] == [lease.tasks[0].seed, lease.tasks[2].seed]
    assert batches[0][0].rewards == [1.0, task.reward(lease.tasks[0].seed, "00000")]
    intake.trained(batches[0])
    ledger = intake.ledger
    assert (ledger.groups_accepted, ledger.groups_trained, ledger.groups_no_signal) == (3, 2, 1)
    assert ledger.unaccounted(intake.buffered) == 0


async def test_forgeries_strike_and_ban_while_refusals_do_not(tmp_path):
    intake = make_intake(tmp_path, max_strikes=2)
    lease = intake.lease(WorkRequest(4), "mallory", version=3)
    stale = group_for(intake, "mallory", lease.tasks[0], lease, ["1", "2"], version=0)  # 3 behind, bound 2
    assert "versions old" in (await intake.submit(stale, "mallory", 3)).rejected[0][1]
    assert intake.strikes.counts == {}
    lying = group_for(intake, "mallory", lease.tasks[1], lease, ["1", "2"], version=3)
    lying["samples"][0]["logprobs"] = [-0.01] * len(lying["samples"][0]["logprobs"])
    assert "forged" in (await intake.submit(lying, "mallory", 3)).rejected[0][1]
    other = group_for(intake, "mallory", lease.tasks[2], lease, ["1", "2"], version=3)
    other["sampler"] = "alice"
    await intake.submit(other, "mallory", 3)
    assert intake.strikes.is_banned("mallory") and intake.forged == 2 and intake.rejected == 1
    assert intake.ledger.groups_accepted == 0


def test_the_sampler_and_the_intake_import_no_torch():
    code = "import node.roles.sampler, node.intake, sys; assert 'torch' not in sys.modules, 'torch was imported'"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


async def test_copies_of_one_group_racing_in_are_accepted_once(tmp_path):
    """Six copies of one group with fresh rollout ids, sent at once: the seed is trained on once (issue 17, 5)."""
    intake = make_intake(tmp_path)
    lease = intake.lease(WorkRequest(1), "mallory", version=0)
    spec = lease.tasks[0]
    copies = []
    for k in range(6):
        m = group_for(intake, "mallory", spec, lease, ["1", "22"])
        m["group_id"] = f"copy{k}"
        for j, sample in enumerate(m["samples"]):
            sample["rollout_id"] = f"copy{k}/{j}"
        copies.append(m)
    acks = []

    async def send(m: dict) -> None:
        acks.append(await intake.submit(m, "mallory", 0))

    async with trio.open_nursery() as nursery:
        for m in copies:
            nursery.start_soon(send, m)
    assert sum(bool(a.accepted) for a in acks) == 1
    refused = [a.rejected[0][1] for a in acks if not a.accepted]
    assert len(refused) == 5 and all("not open" in r or "expired lease" in r for r in refused), refused
    assert intake.ledger.groups_accepted == 1


async def test_acks_wait_for_a_shared_fsync(tmp_path):
    """Durable acks: every accepted group is fsynced before its ack, and concurrent ones share fsyncs."""
    intake = make_intake(tmp_path, groups_per_lease=16)
    lease = intake.lease(WorkRequest(16), "alice", version=0)
    synced_at_ack = []

    async def send(spec) -> None:
        ack = await intake.submit(group_for(intake, "alice", spec, lease, ["1", "22"]), "alice", 0)
        assert ack.accepted
        synced_at_ack.append(intake.journal.synced)

    async with trio.open_nursery() as nursery:
        for spec in lease.tasks:
            nursery.start_soon(send, spec)
    journal = intake.journal
    assert journal.appended == 16 and journal.synced == 16 and min(synced_at_ack) >= 1
    assert journal.fsyncs < 16  # group commit: waiting acks shared fsyncs


async def test_a_checkpoint_cut_while_an_ack_waits_for_its_fsync_loses_nothing(tmp_path, monkeypatch):
    """The journal record is written before the fsync, the checkpoint cut can fall before the ack: a restart from
    that checkpoint still has the group, counted once (it was lost before: journaled before the cut, counted after)."""
    intake = make_intake(tmp_path)
    lease = intake.lease(WorkRequest(1), "alice", version=0)
    release = trio.Event()
    sync = intake.journal.sync

    async def slow_sync(upto: int) -> None:
        await release.wait()
        await sync(upto)

    monkeypatch.setattr(intake.journal, "sync", slow_sync)
    acks = []

    async def send() -> None:
        acks.append(await intake.submit(group_for(intake, "alice", lease.tasks[0], lease, ["1", "22"]), "alice", 0))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send)
        # verified (scoring runs in a thread), then journaled
        await wait_until(lambda: intake.journal.appended >= 1, 10, 0.01, what="the group in the journal")
        await trio.testing.wait_all_tasks_blocked()  # now waiting for its fsync: no ack yet
        assert not acks
        saved = intake.begin_checkpoint()  # the trainer checkpoints now
        intake.end_checkpoint(saved)
        release.set()
    assert acks[0].accepted
    # the process dies; a new one starts from that checkpoint and the journal
    restarted = make_intake(tmp_path, saved)
    assert restarted.ledger.groups_accepted == 1 and restarted.buffered == 1


async def test_fresh_identities_share_one_newcomer_budget_and_cannot_hoard_leases(tmp_path):
    """Issue 17, 6: every limit used to be per peer, so 50 identities took 50 times the budget. Now identities
    without an accepted record share one newcomer budget, and no peer holds more than a few open leases."""
    from node.ratelimit import RateLimited
    from node.rpc import Busy

    intake = make_intake(tmp_path, newcomer_rate=2.0, trusted_after=1, max_open_leases=2, work_burst=100.0)
    # alice's first group, checked on the newcomer budget, gives her a record
    intake.admit_work("alice")
    lease = intake.lease(WorkRequest(4), "alice", version=0)
    await intake.submit(group_for(intake, "alice", lease.tasks[0], lease, ["1", "22"]), "alice", 0)
    assert not intake.is_newcomer("alice")
    admitted = refused = 0
    for k in range(50):
        try:
            intake.admit_rollouts(f"sybil{k}")
            intake.charge_newcomer(f"sybil{k}")  # what submit() draws once a group's body has arrived
            admitted += 1
        except RateLimited:
            refused += 1
    assert admitted == 7 and refused == 43  # the newcomer burst (4 x rate) less alice's group, shared by all fifty
    # a peer with an accepted record is not a newcomer: the Sybils' exhaustion does not touch it
    intake.admit_rollouts("alice")  # no RateLimited
    # leases: two open ones per peer, then "busy" until their groups come back
    for _ in range(2):
        intake.admit_work("hoarder")
        intake.lease(WorkRequest(4), "hoarder", version=0)
    try:
        intake.admit_work("hoarder")
        raise AssertionError("a third lease was admitted")
    except Busy as exc:
        assert exc.retry_after > 0


async def test_stale_groups_and_abandoned_leases_never_lock_an_honest_peer_out(tmp_path, monkeypatch):
    """Seen in the WAN scenario: a sampler whose groups were refused as stale kept holding their leases (the seeds
    stayed open for twice the ttl), reached max_open_leases and was refused work as "busy" for ~90 s, and so was
    every sampler that fell behind: training stopped. A refused seed is spent, and a lease past its ttl no longer
    counts against its peer."""
    from node.rpc import Busy

    intake = make_intake(tmp_path, max_open_leases=2)
    leases = []
    for _ in range(2):
        intake.admit_work("alice")
        leases.append(intake.lease(WorkRequest(2), "alice", version=0))
    # both leases come back entirely stale: every seed is refused, and alice holds nothing any more
    for lease in leases:
        for spec in lease.tasks:
            ack = await intake.submit(group_for(intake, "alice", spec, lease, ["1", "2"], version=0), "alice", 3)
            assert "versions old" in ack.rejected[0][1]
    assert intake.leases.open_leases("alice") == 0
    intake.admit_work("alice")  # no Busy
    # someone else's refused group does not release alice's seeds
    lease = intake.lease(WorkRequest(2), "alice", version=3)
    await intake.submit(group_for(intake, "mallory", lease.tasks[0], lease, ["1", "2"], version=0), "mallory", 3)
    assert lease.tasks[0].seed in intake.leases.get(lease.lease_id).open_seeds
    # a lease the sampler gave up on (past its ttl) stops counting, though its late groups are still taken
    intake.lease(WorkRequest(2), "alice", version=3)
    try:
        intake.admit_work("alice")
        raise AssertionError("a third lease was admitted")
    except Busy:
        pass
    import node.intake.leases as leases_module

    now = leases_module.time.monotonic()
    monkeypatch.setattr(leases_module.time, "monotonic", lambda: now + intake.leases.ttl + 1)
    intake.admit_work("alice")
    assert intake.leases.get(lease.lease_id) is not None


async def test_modes_are_chosen_by_the_trainer_and_bound_to_the_peer(tmp_path):
    """int4 rollouts are refused without blame unless the trainer accepts them; a peer keeps the mode it declared
    first (a switch is refused, not struck); every refusal names the reason."""
    intake = make_intake(tmp_path)
    lease = intake.lease(WorkRequest(4), "alice", version=0)
    q4 = group_for(intake, "alice", lease.tasks[0], lease, ["1", "2"])
    q4.update(quant="q4", engine="mlx", compute="bf16")
    reason = (await intake.submit(q4, "alice", 0)).rejected[0][1]
    assert "does not train on q4" in reason and not intake.strikes.counts
    first = group_for(intake, "alice", lease.tasks[1], lease, ["1", "2"])
    first.update(quant="q8", engine="mlx", compute="bf16")
    assert (await intake.submit(first, "alice", 0)).accepted
    switched = group_for(intake, "alice", lease.tasks[2], lease, ["1", "2"])
    switched.update(quant="none", engine="torch", compute="fp32")
    reason = (await intake.submit(switched, "alice", 0)).rejected[0][1]
    assert "declared mlx/bf16/q8 first" in reason and not intake.strikes.counts
    lenient = make_intake(tmp_path / "lenient", accept_quant="none,q8,q4")
    lease = lenient.lease(WorkRequest(1), "bob", version=0)
    q4 = group_for(lenient, "bob", lease.tasks[0], lease, ["1", "2"])
    q4.update(quant="q4", engine="mlx", compute="fp32")
    assert (await lenient.submit(q4, "bob", 0)).accepted


async def test_a_completion_cut_short_is_forged(tmp_path):
    """A completion that ends neither with its stop token nor at max_tokens was cut by the sampler, not drawn:
    with a numeric reward, stopping early is a way to choose the answer."""
    intake = make_intake(tmp_path)
    lease = intake.lease(WorkRequest(2), "mallory", version=0)
    group = group_for(intake, "mallory", lease.tasks[0], lease, ["12", "3"])
    sample = group["samples"][0]
    sample["completion_ids"], sample["logprobs"] = sample["completion_ids"][:-1], sample["logprobs"][:-1]
    sample["finish_reason"] = "length"
    reason = (await intake.submit(group, "mallory", 0)).rejected[0][1]
    assert "cut short" in reason and intake.strikes.counts == {"mallory": 1}
    full = group_for(intake, "mallory", lease.tasks[1], lease, ["1234567", "3"])
    sample = full["samples"][0]  # 8 tokens without the stop token: at max_tokens, an honest "length" finish
    sample["completion_ids"] = [*sample["completion_ids"][:-1], 10]
    sample["finish_reason"] = "length"
    assert (await intake.submit(full, "mallory", 0)).accepted


def test_a_peer_whose_flips_are_too_rare_for_honest_noise_is_struck(tmp_path):
    """The sequential test refuses a group that passes on its own when the peer's history of near-boundary draws is
    implausible for honest noise, and the refusal says why; the peer's history starts afresh after it."""
    import dataclasses

    import pytest

    from node.intake.draws import assess_group
    from node.intake.noise import Mode
    from node.intake.verify import Forged

    intake = make_intake(tmp_path)
    row = [TokenDraw(-1.0, 0.0, 1.0, (), 1.0) for _ in range(8)]
    verdict = assess_group([row], [[-1.0] * 8], 5, Mode("mlx", "bf16", "q8"), 1.0, 1.0)
    assert verdict.ok and verdict.tails == ()
    intake.verifier.judge(verdict, "eve")  # nothing odd: accepted, history kept
    assert intake.verifier.history["eve"].groups == 1
    steered = dataclasses.replace(verdict, tails=(1e-6, 2e-6))  # two picks rarer than 1 honest flip in 10,000
    with pytest.raises(Forged, match=r"steering, not sampling \(limits for mlx/bf16/q8.*over 2 groups"):
        intake.verifier.judge(steered, "eve")
    assert "eve" not in intake.verifier.history and "mlx/bf16/q8" in intake.verifier.last_limits["eve"]
