"""Issue 26, 2(c), the newcomer part: peers without an accepted record share the newcomer budgets, and one
identity, or one IP, may take only a share of them, so neither a greedy newcomer nor identities rotated through
from one place can drain them. The rules are pure (``node.ratelimit``); the intake applies them."""

from __future__ import annotations

import pytest

from node.intake import RolloutIntake
from node.ratelimit import PeerRateLimiter, RateLimited, ip_key, take_all
from node.settings import TrainerSettings
from trainer.tasks.reverse import ReverseDigitsTask


def test_ip_keys_group_a_hosts_addresses_and_spare_loopback():
    assert ip_key("203.0.113.9") == "203.0.113.9"
    assert ip_key("::ffff:203.0.113.9") == "203.0.113.9"
    assert ip_key("2001:db8:1:2:3:4:5:6") == ip_key("2001:db8:1:2:ffff::1") == "2001:db8:1:2::/64"
    assert ip_key("2001:db8:1:3::1") != ip_key("2001:db8:1:2::1")
    assert ip_key("127.0.0.1") is None and ip_key("::1") is None  # this machine's own processes
    assert ip_key(None) is None and ip_key("not an ip") is None


def test_take_all_spends_every_bucket_or_none():
    now = [0.0]
    a = PeerRateLimiter(1.0, 2.0, clock=lambda: now[0])
    b = PeerRateLimiter(1.0, 1.0, clock=lambda: now[0])
    take_all([(a, "x"), (b, "y")])
    with pytest.raises(RateLimited) as refused:
        take_all([(a, "x"), (b, "y")])  # b is empty: a must not be spent for it
    assert refused.value.retry_after == pytest.approx(1.0)
    assert a.wait("x") == 0  # a still holds its second token
    now[0] = 1.0
    take_all([(a, "x"), (b, "y")])


def make_intake(tmp_path, **kw) -> RolloutIntake:
    intake = RolloutIntake(
        ReverseDigitsTask(),
        lambda text: [1] + [10 + ord(c) % 20 for c in text],
        lambda ids: "",
        (2,),
        lambda *a: [],
        tmp_path / "journal",
        TrainerSettings(group_size=2, max_tokens=8, **kw),
    )
    intake.start(None)
    for limiter in vars(intake).values():  # time stands still: counts, not refill races, are what is checked
        if isinstance(limiter, PeerRateLimiter):
            limiter.clock = lambda: 0.0
    return intake


def admitted(admit, peers: list[str], ip: str | None) -> int:
    n = 0
    for peer in peers:
        try:
            admit(peer) if ip is None else admit(peer, ip)
            n += 1
        except RateLimited:
            pass
    return n


def test_one_newcomer_takes_only_its_share_of_the_newcomer_budget(tmp_path):
    """A greedy fresh identity could take the whole newcomer burst (16 groups at the default 4/s): each one now
    takes at most half, and the next newcomer finds the rest."""
    intake = make_intake(tmp_path, rollout_burst=100.0)
    assert admitted(intake.admit_rollouts, ["greedy"] * 50, None) == 8
    assert admitted(intake.admit_rollouts, ["next"] * 8, None) == 8


def test_identities_rotated_through_from_one_ip_leave_a_new_honest_sampler_its_share(tmp_path):
    """Issue 26, 2(c): 246 identities took 819 leases, and a joining sampler got 217 groups/min against ~750
    for established ones. Identities from one IP share a quarter of the newcomer budget, and ask for leases at
    most as fast as two peers together: a sampler joining from elsewhere is not starved."""
    intake = make_intake(tmp_path)
    sybils = [f"sybil{k}" for k in range(246)]
    attacker = "203.0.113.9"
    took = admitted(intake.admit_rollouts, sybils, attacker)
    assert took == 4  # a quarter of the 16-group newcomer burst
    assert admitted(intake.admit_rollouts, ["joiner"] * 4, "198.51.100.7") == 4  # its first groups get checked
    leases = admitted(intake.admit_work, [f"hoarder{k}" for k in range(246)], attacker)
    assert leases == 16  # two peers' lease burst, for every identity at that IP together
    assert admitted(intake.admit_work, ["joiner"], "198.51.100.7") == 1
    # loopback (a local swarm) and unknown addresses have no per-IP share; the peer's share still holds
    assert admitted(intake.admit_rollouts, ["local"] * 10, "127.0.0.1") == 8
