"""A sampler dials other samplers only up to a bounded degree (issue 29): dialling every sampler the DHT listed made
a clique, N(N-1)/2 connections (bench/swarm_scale: 16.8 connections per sampler at N=16, every other one)."""

from node import discovery


def test_a_sampler_dials_at_most_its_degree_of_the_listed_samplers():
    listed = [f"s{i}" for i in range(300)]
    known, dial = discovery.sampler_dials(listed, "me", set(), {}, now=0.0, degree=24)
    assert known == [] and len(dial) == 24
    assert dial == [p for p in listed if p in set(dial)]  # in the listed order


def test_connections_held_count_against_the_degree_those_that_dialled_us_included():
    listed = [f"s{i}" for i in range(100)]
    connected = set(listed[:20])
    assert len(discovery.sampler_dials(listed, "me", connected, {}, now=0.0, degree=24)[1]) == 4
    # 30 samplers dialled us (not all listed by this lookup): nothing to dial
    assert discovery.sampler_dials(listed, "me", connected, {}, now=0.0, have=30, degree=24)[1] == []


def test_samplers_choose_different_peers_and_keep_their_choice():
    listed = [f"s{i}" for i in range(200)]
    a = discovery.sampler_dials(listed, "a", set(), {}, now=0.0)[1]
    b = discovery.sampler_dials(listed, "b", set(), {}, now=0.0)[1]
    assert len(set(a) & set(b)) < len(a) // 2  # a random graph, not everyone on the same first providers
    shuffled = listed[::-1]
    assert set(discovery.sampler_dials(shuffled, "a", set(), {}, now=0.0)[1]) == set(a)


def test_a_small_swarm_is_still_fully_connected():
    listed = ["me", "a", "b", "c", "d"]
    assert discovery.sampler_dials(listed, "me", set(), {}, now=0.0)[1] == ["a", "b", "c", "d"]
