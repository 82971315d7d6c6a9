"""A sampler's discovery rules (node/discovery.py), on plain data: when to look for the trainer, whose provider
records to trust, which samplers to dial and how long a failed one is left alone."""

from __future__ import annotations

from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from node import discovery


def test_the_trainer_is_looked_for_until_found_and_whenever_its_connection_is_gone():
    assert discovery.trainer_step(found=False, connected=False) == "find"
    assert discovery.trainer_step(found=True, connected=False) == "find"
    assert discovery.trainer_step(found=True, connected=True) == "keep"
    # connected to the trusted id (authenticated by the connection) but never looked up: taken as it is, no lookup
    assert discovery.trainer_step(found=False, connected=True) == "adopt"


def test_a_sampler_that_learns_nothing_looks_ever_less_often_up_to_a_cap():
    """N samplers each asking the DHT every 8 s forever was N/8 lookups/s of upkeep (bench/swarm_scale)."""
    waits = [discovery.next_look(2.0, quiet) for quiet in range(8)]
    assert waits[:4] == [8.0, 16.0, 32.0, 60.0]
    assert max(waits) == discovery.QUIET_CAP * 2.0 == 60.0


def test_losing_the_last_connection_to_a_known_sampler_wakes_discovery_at_once():
    d = discovery.SamplerDiscovery("test", ID(b"trainer"), 2.0)
    known, stranger = ID(b"known"), ID(b"stranger")
    d.samplers.add(str(known))
    d.quiet = 5
    d.lost_connection(stranger, still_connected=False)  # not a sampler we dialled through discovery
    d.lost_connection(known, still_connected=True)  # another connection to it remains
    assert not d._wake.is_set() and d.quiet == 5
    d.lost_connection(known, still_connected=False)
    assert d._wake.is_set() and d.quiet == 0 and not d._trainer_wake.is_set()
    d.lost_connection(ID(b"trainer"), still_connected=False)  # the trainer's last connection: looked for at once
    assert d._trainer_wake.is_set()


def test_only_the_trusted_trainers_provider_records_are_followed():
    trainer, impostor = ID(b"trainer"), ID(b"impostor")
    found = [PeerInfo(impostor, []), PeerInfo(trainer, []), PeerInfo(impostor, [])]
    trusted, others = discovery.trusted_providers(found, trainer)
    assert [i.peer_id for i in trusted] == [trainer]
    assert [i.peer_id for i in others] == [impostor, impostor]


def test_samplers_are_dialled_unless_connected_ourselves_or_backing_off():
    listed = ["me", "a", "b", "c", "d"]
    known, dial = discovery.sampler_dials(listed, "me", {"a", "me"}, {"b": 50.0, "c": 10.0}, now=20.0)
    assert known == ["a"]
    assert dial == ["c", "d"]  # b failed lately: not before 50
    assert discovery.sampler_dials(listed, "me", set(), {"b": 50.0}, now=50.0)[1] == ["a", "b", "c", "d"]


def test_failed_dials_back_off_exponentially_up_to_five_minutes():
    assert [discovery.dial_backoff(n) for n in (1, 2, 3)] == [20.0, 40.0, 80.0]
    assert discovery.dial_backoff(10) == 300.0


def test_the_trainers_last_addresses_outlive_the_process_and_a_bad_file_is_ignored(tmp_path):
    from multiaddr import Multiaddr

    trainer, other = ID(b"trainer"), ID(b"another trainer")
    path = tmp_path / "trainer.addrs"
    addrs = [Multiaddr("/ip4/10.0.0.1/tcp/4001"), Multiaddr("/ip6/::1/tcp/4002")]
    assert discovery.read_trainer_addrs(path, trainer) == []  # nothing remembered yet
    discovery.write_trainer_addrs(path, trainer, addrs)
    assert discovery.read_trainer_addrs(path, trainer) == addrs
    assert discovery.read_trainer_addrs(path, other) == []  # the swarm's trainer changed: not its addresses
    d = discovery.SamplerDiscovery("test", trainer, 1.0, remember=path)
    assert d.trainer_addrs == addrs  # a new process starts where the last one left off
    d.remember_trainer(addrs[:1])
    assert discovery.read_trainer_addrs(path, trainer) == addrs[:1]
    for damaged in (f"{trainer}\nnot a multiaddr\n", "", f"{trainer}\n" + "/ip4/10.0.0.1/tcp/1\n" * 2000):
        path.write_text(damaged)
        assert discovery.read_trainer_addrs(path, trainer) == [], damaged
    path.write_bytes(b"\xff\xfe\x00")
    assert discovery.read_trainer_addrs(path, trainer) == []


def test_a_record_that_reached_peers_is_re_provided_ever_less_often_up_to_a_cap():
    waits = [discovery.next_provide(30.0, provided) for provided in range(1, 9)]
    assert waits[:5] == [30.0, 60.0, 120.0, 240.0, 480.0]
    assert max(waits) == discovery.PROVIDE_CAP * 30.0 == 600.0
    assert discovery.next_provide(30.0, 0) == 2.0  # the last provide reached no one: again soon


def test_a_provide_that_keeps_failing_is_retried_ever_less_often_up_to_the_interval():
    waits = [discovery.next_provide(30.0, 0, failed) for failed in range(1, 8)]
    assert waits == [2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]


def test_a_failing_provide_of_a_record_the_trusted_peers_hold_backs_off_past_the_interval_up_to_the_cap():
    """Newcomers find the record at the trusted peers; the DHT's copy is the fallback, and a walk that fails on a
    busy swarm, retried every interval, added to its load (N = 256: 0.10 cancelled DHT stream opens/s per host)."""
    waits = [discovery.next_provide(30.0, 0, failed, held=True) for failed in range(1, 12)]
    assert waits == [2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 600.0, 600.0]
    assert discovery.next_provide(30.0, 2, held=True) == discovery.next_provide(30.0, 2)  # success: as before


def test_each_wait_between_provides_is_jittered_so_a_join_wave_does_not_re_provide_together():
    import random

    lo, mid, hi = (discovery.next_provide(30.0, 3, point=p) for p in (0.0, 0.5, 0.999999))
    assert mid == 120.0 and lo == 120.0 * (1 - discovery.PROVIDE_JITTER / 2)
    assert 120.0 < hi < 120.0 * (1 + discovery.PROVIDE_JITTER / 2)
    assert discovery.next_provide(30.0, 0, 2, point=0.0) == 4.0 * (1 - discovery.PROVIDE_JITTER / 2)  # retries too
    assert discovery.next_provide(30.0, 3, point=7.0) == discovery.next_provide(30.0, 3, point=1.0)  # clamped
    # 15 nodes that provided first within 6 s of each other (bench/wan's lab, interval 3 s): their 6th provide,
    # ~1.5 min on, spreads over more than 20 s instead of staying within those 6 s
    rng = random.Random(1)
    times = []
    for start in (rng.uniform(0, 6) for _ in range(15)):
        t = start
        for provided in range(1, 6):
            t += discovery.next_provide(3.0, provided, point=rng.random())
        times.append(t)
    assert max(times) - min(times) > 20.0
    unjittered = [start + sum(discovery.next_provide(3.0, k) for k in range(1, 6)) for start in (0.0, 6.0)]
    assert unjittered[1] - unjittered[0] == 6.0


def test_the_mesh_is_settled_when_full_or_when_every_listed_sampler_is_connected_or_gone():
    listed = ["me", "a", "b", "c"]
    assert discovery.mesh_settled(listed, "me", {"a", "b", "c"}, {}, have=3)
    assert not discovery.mesh_settled(listed, "me", {"a", "b"}, {"c": 2}, have=2)  # c may come back: keep looking
    assert discovery.mesh_settled(listed, "me", {"a", "b"}, {"c": discovery.GONE_AFTER}, have=2)  # c is gone
    assert discovery.mesh_settled(listed, "me", {"a"}, {}, have=1, degree=1)  # full: no more dials wanted
