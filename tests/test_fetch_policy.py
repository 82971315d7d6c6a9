"""The rules of weight distribution (node/weights/policy.py), on plain data: which chunks from which peer, the
endgame, pacing by this node's own downlink, whom to drop, which versions to chase."""

from __future__ import annotations

import trio

from node.rpc import MAX_PAUSE, backpressure
from node.weights import policy
from node.weights.policy import Board, FetchSettings, Layout, Record
from protocols import weights as w
from protocols.errors import RemoteError

KIB = 1 << 10


def layout(n: int, size: int = 64 * KIB, batch: int = 64) -> Layout:
    chunks = [bytes([i]) * 32 for i in range(n)]
    return Layout.of(chunks, {h: size for h in chunks}, chunks, 1 << 20, batch, [i / n for i in range(n)])


def board(**kw) -> Board:
    base = dict(missing=set(range(8)), holders={}, in_flight={}, requests=[], origin="O", last_arrival=100.0)
    return Board(**(base | kw))


def test_layout_sizes_requests_by_a_typical_chunk():
    lay = layout(8, size=64 * KIB)
    assert lay.typical == 256 * KIB  # 4x the mean chunk
    assert lay.batch == w.MAX_CHUNKS_PER_REQUEST  # ~4 MiB would be 16: the wire's limit holds
    assert lay.origin_batch == 4  # ~1 MiB from the origin
    assert lay.endgame_batch == 4
    assert lay.index[lay.chunks[3]] == 3 and lay.bytes_of([0, 1]) == 128 * KIB
    assert layout(8, batch=2).batch == 2 and layout(8, batch=2).origin_batch == 2  # the knob caps them all
    big = layout(8, size=1 << 20)  # typical capped at chunk_size: 4 a request, 1 from the origin
    assert (big.typical, big.batch, big.origin_batch) == (1 << 20, 4, 1)


def test_a_peer_is_asked_for_the_rarest_chunks_it_holds_that_nobody_is_fetching():
    holders = {"A": {0, 1, 2, 3}, "B": {1, 2}, "C": {2}, "O": set(range(8))}
    b = board(holders=holders, in_flight={3: 1})
    # 0 only A has; 1 B has too; 2 B and C; 3 is in flight; the origin's claims never count for rarity
    assert policy.pick("A", b, layout(8), now=100.0, room=1 << 30) == [0, 1, 2]
    assert policy.rarity(2, b) == 3 and policy.rarity(2, b, exclude="C") == 2
    assert policy.rarity(2, board(holders=holders, dropped={"B", "C"})) == 1  # a dropped peer's claims are void


def test_ties_follow_the_downloads_own_order():
    holders = {"A": {0, 1, 2}}
    lay = layout(3)
    shuffled = Layout.of(
        lay.chunks, dict(zip(lay.chunks, lay.sizes, strict=True)), lay.chunks, 1 << 20, 64, [0.9, 0.1, 0.5]
    )
    assert policy.pick("A", board(missing={0, 1, 2}, holders=holders), shuffled, 100.0, 1 << 30) == [1, 2, 0]


def test_the_origin_serves_only_what_nobody_else_holds_or_failed_elsewhere():
    holders = {"A": {0, 1}, "O": set(range(8))}
    busy = {7: 1}  # something is moving
    b = board(missing={0, 1, 2, 3}, holders=holders, in_flight=busy, failed={1})
    assert sorted(policy.pick("O", b, layout(8), now=100.5, room=1 << 30)) == [1, 2, 3]
    # declined a moment ago (super-seeding): not asked for those again before the wait is over
    declined = board(missing={0, 1, 2, 3}, holders=holders, in_flight=busy, declined={2: 101.0, 3: 101.0})
    assert policy.pick("O", declined, layout(8), now=100.5, room=1 << 30) == []
    assert sorted(policy.pick("O", declined, layout(8), now=101.0, room=1 << 30)) == [2, 3]


def test_the_origin_serves_claimed_chunks_when_nothing_arrives_or_moves():
    holders = {"A": {0, 1}, "O": {0, 1}}
    moving = board(missing={0, 1}, holders=holders, in_flight={5: 1}, last_arrival=100.0)
    assert policy.pick("O", moving, layout(8), now=100.0 + policy.STALL_GRACE, room=1 << 30) == []
    stalled = policy.pick("O", moving, layout(8), now=100.1 + policy.STALL_GRACE, room=1 << 30)
    assert sorted(stalled) == [0, 1]
    quiet = board(missing={0, 1}, holders=holders, last_arrival=100.0)
    assert sorted(policy.pick("O", quiet, layout(8), now=100.0, room=1 << 30)) == [0, 1]


def test_origin_requests_are_smaller():
    holders = {"O": set(range(8))}
    assert len(policy.pick("O", board(holders=holders), layout(8), 100.0, 1 << 30)) == 4  # origin_batch
    assert len(policy.pick("O", board(holders=holders), layout(8), 100.0, 1 << 30)) < layout(8).batch


def test_endgame_duplicates_chunks_requested_once_elsewhere_oldest_first():
    holders = {"A": {0, 1, 2, 3, 4}, "B": {0}, "C": {1}}
    requests = [("B", [2, 0]), ("C", [1, 3]), ("A", [4])]
    in_flight = {0: 1, 1: 2, 2: 1, 3: 1, 4: 1}
    b = board(missing={0, 1, 2, 3, 4}, holders=holders, in_flight=in_flight, requests=requests)
    # nothing new for A: chunks asked once of others, in request order; 1 is asked twice, 4 of A itself
    assert policy.pick("A", b, layout(8), 100.0, 1 << 30) == [2, 0, 3]
    assert policy.endgame("A", b, limit=2) == [2, 0]
    # chunks arrived meanwhile are not asked for again
    assert policy.endgame("A", board(**{**b.__dict__, "missing": {3}}), limit=8) == [3]
    # the origin is never part of the endgame
    assert policy.pick("O", board(**{**b.__dict__, "holders": {"O": {0, 2, 3}}}), layout(8), 100.0, 1 << 30) == []


def test_a_request_fits_the_in_flight_budget_but_always_carries_one_chunk():
    sizes = [100, 200, 300, 400]
    assert policy.fit([0, 1, 2, 3], sizes, room=350) == [0, 1]
    assert policy.fit([3, 0], sizes, room=10) == [3]
    assert policy.fit([3, 0], sizes, room=-500) == [3]
    assert policy.fit([], sizes, room=1000) == []
    holders = {"A": set(range(8))}
    assert len(policy.pick("A", board(holders=holders), layout(8), 100.0, room=130 * KIB)) == 2


def test_bytes_in_flight_follow_the_arrival_rate():
    arrivals = [(90.0, 10_000), (96.0, 1_000_000), (100.0, 1_000_000)]
    assert policy.arrival_rate(arrivals, now=100.0, started=0.0) == 2_000_000 / policy.RATE_WINDOW
    assert policy.arrival_rate(arrivals, now=100.0, started=99.5) == 2_000_000  # at least one second's span
    assert policy.arrival_rate([], now=100.0, started=0.0) == 0.0
    assert policy.in_flight_budget(0.0, 4 << 20) == 4 << 20
    assert policy.in_flight_budget(10 << 20, 4 << 20) == int(policy.IN_FLIGHT_SECONDS * (10 << 20))


def test_a_replys_deadline_scales_with_its_size_and_the_queue_before_it():
    s = FetchSettings(request_timeout=20.0, min_rate=100_000)
    assert policy.reply_deadline(True, 10**9, 10**9, 0.0, s) == 20.0  # the origin: its timeout alone
    assert policy.reply_deadline(False, 200_000, 0, 0.0, s) == 3.0 + 2.0
    assert policy.reply_deadline(False, 100_000, 1_000_000, 200_000.0, s) == 3.0 + 5.0  # queued behind 5 s of bytes
    assert policy.reply_deadline(False, 100_000, 1_000_000, 0.0, s) == 3.0 + 10.0  # no rate yet: min_rate
    assert policy.reply_deadline(False, 10**8, 0, 0.0, s) == 20.0


def test_slow_or_withholding_peers_are_dropped_busy_ones_rest():
    typical = 1000
    assert policy.drop_reason(Record(), typical) is None
    assert policy.drop_reason(Record(slow=1), typical) is None
    assert "no reply" in policy.drop_reason(Record(slow=2), typical)
    assert policy.drop_reason(Record(withheld=3), typical) is None
    assert "advertised 4" in policy.drop_reason(Record(withheld=4, served=3 * typical), typical)
    assert policy.drop_reason(Record(withheld=4, served=4 * typical), typical) is None  # served as much as it held back
    # busy ones rest: the one backpressure rule every client follows
    assert backpressure(RemoteError("busy", "full")) == 1.0
    assert backpressure(RemoteError("rate_limited", "slow down", retry_after=3.0)) == 3.0
    assert backpressure(RemoteError("busy", "full", retry_after=600.0)) == MAX_PAUSE  # a peer cannot park us
    assert backpressure(RemoteError("forged", "no")) is None and backpressure(trio.TooSlowError()) is None


def test_the_peer_set_keeps_its_members_and_fills_up_in_the_given_order():
    assert policy.neighbours([], ["a", "b", "c"], 2) == ["a", "b"]
    assert policy.neighbours(["c", "x"], ["a", "b", "c"], 2) == ["c", "a"]  # x is gone
    assert policy.neighbours(["a", "b", "c"], ["a", "b", "c"], 2) == ["a", "b", "c"]  # kept ones are not evicted
    assert policy.due_for_poll(3, 8, None, 10.0, 0.5)
    assert not policy.due_for_poll(8, 8, None, 10.0, 0.5)  # holds everything
    assert not policy.due_for_poll(3, 8, 9.8, 10.0, 0.5) and policy.due_for_poll(3, 8, 9.5, 10.0, 0.5)
    assert policy.superseded([1, 2], {3}) and not policy.superseded([1, 2], {2})


def test_have_polls_space_out_as_a_download_ages():
    """A version's polls cost each host CPU in proportion to its download's length, and long downloads were the
    loaded swarm's: a short download is polled at the base interval, a long one ever less often, up to a cap."""
    base = 0.5
    assert policy.poll_interval(base, 0.0) == base and policy.poll_interval(base, policy.POLLS_SLOW_AFTER) == base
    later = [policy.poll_interval(base, t) for t in (4.0, 8.0, 16.0, 32.0, 600.0)]
    assert later == sorted(later) and later[0] > base
    assert later[-1] == base * policy.POLL_INTERVAL_CAP
    # polls of one peer over a 60 s download: a fraction of the 120 at the base interval
    t, polls = 0.0, 0
    while t < 60.0:
        t += policy.poll_interval(base, t)
        polls += 1
    assert polls < 120 / 4, polls


def test_only_newer_versions_are_chased_and_announcers_of_nothing_are_struck():
    assert policy.is_news(5, current=4, target=None)
    assert not policy.is_news(4, current=4, target=None)
    assert not policy.is_news(5, current=2, target=5) and policy.is_news(6, current=2, target=5)
    assert policy.take_announcement(6, b"m", 2, 5, set(), False)
    assert not policy.take_announcement(6, b"m", 2, 5, {b"m"}, False)  # being fetched
    assert not policy.take_announcement(6, b"m", 2, 5, set(), True)  # banned sender
    full = {bytes([i]) for i in range(policy.MAX_PENDING_ANNOUNCEMENTS)}
    assert not policy.take_announcement(6, b"m", 2, 5, full, False)
    assert not policy.take_announcement(5, b"m", 2, 5, set(), False)
    assert [policy.strike_announcer(n) for n in (1, 2, 3)] == [False, False, True]


def test_a_node_announces_a_version_it_installed_only_while_few_others_have():
    """Trickle's suppression: the first holders gossip, the rest keep quiet (not O(N^2) messages per version)."""
    assert [policy.announce_installed(n, redundancy=4) for n in range(6)] == [True] * 4 + [False] * 2
    assert policy.announce_installed(0) and not policy.announce_installed(policy.ANNOUNCE_REDUNDANCY)
    assert policy.manifest_sources("T", ["a", "T", "b", "c", "d"]) == ["T", "a", "b", "c"]


def test_reannouncements_slow_down_to_the_cap():
    assert [policy.reannounce_delay(2.0, k, most=60.0) for k in range(7)] == [2, 4, 8, 16, 32, 60, 60]
    assert policy.reannounce_delay(2.0, 10**6) == policy.REANNOUNCE_MOST  # a version announced for days
    assert policy.reannounce_delay(0.0, 0) == policy.REANNOUNCE_MOST  # a zero interval is not a busy loop


def test_a_newer_version_cancels_a_download_unless_it_is_mostly_done_or_the_last_one_was_cancelled():
    assert policy.cancel_for_newer(0.2, 0.5, 0)
    assert not policy.cancel_for_newer(0.5, 0.5, 0)
    assert not policy.cancel_for_newer(0.2, 0.5, 1)
    assert [policy.rebuild_now(n) for n in (1, 2, 3)] == [True, True, False]
