"""How many groups a sampler asks for: what it finishes within half a lease's life at its own measured pace."""

from __future__ import annotations

from node.roles.sampler import LEASE_FILL, groups_to_ask


def test_a_sampler_asks_for_one_group_until_it_has_measured_one():
    assert groups_to_ask(None, None, 4) == 1
    assert groups_to_ask(None, 120.0, 4) == 1  # a lease seen, no group timed yet
    assert groups_to_ask(2.0, None, 4) == 1


def test_a_fast_sampler_asks_for_the_most_and_a_slow_one_for_what_fits_half_a_lease():
    assert groups_to_ask(1.0, 120.0, 4) == 4  # would fit 60: capped by the request's most
    assert groups_to_ask(20.0, 120.0, 4) == 3  # 60 s of a 120 s lease
    assert groups_to_ask(30.0, 120.0, 4) == 2
    assert groups_to_ask(64.0, 120.0, 4) == 1  # the bench's paced samplers: 4 took 256 s, past the lease's life
    assert groups_to_ask(500.0, 120.0, 4) == 1  # never fewer than one


def test_the_groups_asked_for_fit_within_the_lease_at_the_measured_pace():
    for pace in (0.5, 3.0, 17.0, 29.9, 45.0, 61.0):
        for life in (30.0, 120.0, 600.0):
            n = groups_to_ask(pace, life, 16)
            assert n == 1 or n * pace <= LEASE_FILL * life
            assert n == 16 or (n + 1) * pace > LEASE_FILL * life  # and no fewer than fit
