"""Issue 26, item 4: a newcomer's rollout draws on the newcomers' shared budget once its body has arrived, not
when its frame's header does. Drawn on the header, 40 identities at 40 addresses sending only headers of rollout
frames (bench/netlab/hostile.py ``headers``) emptied it for every newcomer: a sampler joining under that attack
on the emulated WAN had its first group refused as rate_limited for 40 s and accepted only after 96 s (44 s in a
clean window)."""

from __future__ import annotations

import pytest

from node.ratelimit import RateLimited
from protocols.work import WorkRequest
from tests.helpers import group_for, make_intake


def frozen(intake) -> None:
    from node.ratelimit import PeerRateLimiter

    for limiter in vars(intake).values():  # time stands still: counts, not refills, are what is checked
        if isinstance(limiter, PeerRateLimiter):
            limiter.clock = lambda: 0.0


def admitted(intake, peer: str, ip: str, n: int) -> int:
    got = 0
    for _ in range(n):
        try:
            intake.admit_rollouts(peer, ip)
            got += 1
        except RateLimited:
            pass
    return got


async def test_headers_from_many_identities_leave_a_joiner_the_newcomer_budget(tmp_path):
    intake = make_intake(tmp_path)
    frozen(intake)
    # 40 identities at 40 addresses each open 8 rollout streams and send only a header: admitted on their own
    # shares, and nothing of the shared budget is spent (the old code: its 16-token burst, then every newcomer
    # refused)
    for k in range(40):
        admitted(intake, f"sybil{k}", f"203.0.{k // 32}.{k % 32 + 1}", 8)
    assert intake.newcomer_limit.wait("(newcomers)") == 0
    intake.admit_rollouts("joiner", "198.51.100.7")
    intake.admit_work("joiner", "198.51.100.7")
    lease = intake.lease(WorkRequest(2), "joiner", version=0)
    ack = await intake.submit(group_for(intake, "joiner", lease.tasks[0], lease, ["1", "22"]), "joiner", 0)
    assert ack.accepted  # checked, and accepted


async def test_newcomers_bodies_still_share_one_budget(tmp_path):
    """Groups that do arrive whole draw on the shared budget: six newcomers admitted at once (their headers came
    while it was full) get four groups checked, the burst, and fresh identities buy no more checking than one."""
    intake = make_intake(tmp_path, newcomer_rate=1.0)  # a burst of 4 groups for all newcomers together
    frozen(intake)
    groups = {}
    for k in range(6):
        peer, ip = f"fresh{k}", f"203.0.113.{k + 1}"
        intake.admit_work(peer, ip)
        lease = intake.lease(WorkRequest(2), peer, version=0)
        intake.admit_rollouts(peer, ip)
        groups[peer] = group_for(intake, peer, lease.tasks[0], lease, ["1", "22"])
    checked = refused = 0
    for peer, group in groups.items():
        try:
            await intake.submit(group, peer, 0)
            checked += 1
        except RateLimited:
            refused += 1
    assert (checked, refused) == (4, 2)
    with pytest.raises(RateLimited):  # and once it is out, a newcomer is refused on the header again
        intake.admit_rollouts("fresh9", "203.0.113.99")
