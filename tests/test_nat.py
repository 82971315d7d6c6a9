"""Samplers behind NATs (issue 15): the NAT namespaces behave like home routers and carrier NATs, and a swarm with
4 of its 8 samplers behind NATs converges, with relays and hole punching (node/reachability.py).

Needs root and nftables (bench/netlab/nat.py; tests/provision.sh installs it); skipped, saying why, without them.
The in-process tests need neither.
"""

from __future__ import annotations

import subprocess
import sys
import time

import multiaddr
import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from bench.netlab.nat import NatLab, nat_unavailable
from bench.netlab.topology import Link, lab_unavailable
from node.host import open_swarm
from node.libp2p.nat import conn_kind
from node.reachability import PRIVATE, PUBLIC, DialBack, ReachOptions, is_relayed_addr
from tests.helpers import slowdown, wait_for, wait_until

why_not = lab_unavailable() or nat_unavailable()  # nftables: tests/provision.sh installs it
needs_lab = pytest.mark.skipif(why_not is not None, reason=f"no NAT lab: {why_not}")

OBSERVER = """
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('0.0.0.0', 5000)); s.listen()
print('listening', flush=True)
while True:
    c, a = s.accept(); c.sendall(f'{a[0]}:{a[1]}'.encode()); c.close()
"""
SEEN_AS = """
import socket, sys
c = socket.socket(); c.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1); c.bind(('0.0.0.0', int(sys.argv[2])))
c.settimeout(3); c.connect((sys.argv[1], 5000)); print(c.recv(100).decode())
"""
PUNCH = """
import socket, sys, time
c = socket.socket(); c.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1); c.bind(('0.0.0.0', 4001)); c.settimeout(6)
time.sleep(max(0.0, float(sys.argv[2]) - time.time()))  # both ends dial at once: the simultaneous open under test
try:
    c.connect((sys.argv[1], 4001)); c.sendall(b'hi'); print('punched', c.recv(2).decode())
except OSError as e:
    print('failed', e)
"""


@needs_lab
def test_nat_namespaces_map_filter_and_punch_like_real_nats(tmp_path):
    lab = NatLab(tmp_path / "lab", [Link("na", "na", 40)])
    lab.add_host("pub", "na", 50, 50)
    lab.add_nat_host("cone1", "na", 50, 50, "cone")
    lab.add_nat_host("cone2", "na", 50, 50, "cone")
    lab.add_nat_host("sym", "na", 50, 50, "symmetric")
    with lab:
        logs = [tmp_path / "observer.log", tmp_path / "observer-cone.log"]
        lab.popen("pub", [sys.executable, "-c", OBSERVER], logs[0])
        lab.popen("cone1", [sys.executable, "-c", OBSERVER], logs[1])
        wait_for(lambda: all("listening" in log.read_text() for log in logs), 30, "the observers", interval=0.05)

        def seen_as(host: str, port: int) -> str:
            r = lab.run(host, [sys.executable, "-c", SEEN_AS, lab.hosts["pub"].ip, str(port)])
            assert r.returncode == 0, r.stderr
            return r.stdout.strip()

        # a cone NAT keeps the source port (the same outside port for every destination), on its public address
        assert seen_as("cone1", 40001) == f"{lab.hosts['cone1'].ip}:40001"
        # a symmetric NAT picks a new outside port per connection
        # (distinct inside ports: reusing one 4-tuple right after it closed fails with EADDRNOTAVAIL)
        inside = (40011, 40012, 40013)
        outside = tuple(int(seen_as("sym", port).split(":")[1]) for port in inside)
        assert all(o != i for o, i in zip(outside, inside, strict=True)) and len(set(outside)) == 3, outside
        # nobody outside can open a connection to a host behind a NAT (dropped silently, no RST)
        r = lab.run("pub", [sys.executable, "-c", SEEN_AS, lab.hosts["cone1"].ip, "40002"])
        assert r.returncode != 0 and "timed out" in r.stderr

        def punch(a: str, b: str) -> tuple[str, str]:
            at = time.time() + 1.0 * slowdown()  # time for both processes to start, on a loaded box too
            procs = [
                subprocess.Popen(
                    ["ip", "netns", "exec", lab.hosts[x].ns, sys.executable, "-c", PUNCH, lab.hosts[y].ip, str(t)],
                    stdout=subprocess.PIPE,
                    text=True,
                )
                for x, y, t in ((a, b, at), (b, a, at + 0.05))
            ]
            return tuple(p.communicate(timeout=20)[0].strip() for p in procs)

        # TCP simultaneous open from the listen port gets through two cone NATs, not through a symmetric one
        assert punch("cone1", "cone2") == ("punched hi", "punched hi")
        assert all(out.startswith("failed") for out in punch("cone1", "sym"))
    leftover = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"srl{lab.tag}" not in leftover


def test_dial_back_dials_only_the_observed_ip_at_the_advertised_ports():
    addrs = [
        multiaddr.Multiaddr("/ip4/192.168.1.5/tcp/4001").to_bytes(),
        multiaddr.Multiaddr("/ip4/0.0.0.0/tcp/4001").to_bytes(),
        multiaddr.Multiaddr("/ip4/8.8.8.8/tcp/4002").to_bytes(),
        multiaddr.Multiaddr("/ip4/8.8.8.8/udp/4003/quic-v1").to_bytes(),
    ]
    out = [str(multiaddr.Multiaddr(a)) for a in DialBack._filter_by_observed_ip(addrs, "203.0.113.7")]
    assert out == ["/ip4/203.0.113.7/tcp/4001", "/ip4/203.0.113.7/tcp/4002"]
    assert DialBack._filter_by_observed_ip(addrs, None) == []


def test_a_connections_kind_is_read_from_its_addresses_once():
    class Conn:
        def __init__(self, addrs: list[str]) -> None:
            self.addrs, self.reads = [multiaddr.Multiaddr(a) for a in addrs], 0

        def get_transport_addresses(self) -> list[multiaddr.Multiaddr]:
            self.reads += 1
            return self.addrs

    relay = "/ip4/10.0.0.1/tcp/4001/p2p/12D3KooWRBy97UB99e3J6hiPesre1MZeuNQvfan4gBziswrRJsNK/p2p-circuit"
    direct, relayed = Conn(["/ip4/10.0.0.2/tcp/4001"]), Conn([relay])
    for _ in range(3):
        assert conn_kind(direct) == "direct" and conn_kind(relayed) == "relayed"
    assert direct.reads == relayed.reads == 1


async def test_reachability_relay_and_fresh_dial_backs_on_loopback():
    """On loopback everyone is reachable: dial-backs say so (on a fresh connection, not the one the request came on),
    a node can reserve a relay slot and advertise a circuit address, and a peer can connect through it."""
    loop = multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")
    keys = [create_new_key_pair() for _ in range(3)]

    async with (
        open_swarm(keys[0], loop, reach=ReachOptions(swarm_name="t", relay=True, assume_public=True)) as relay,
        open_swarm(keys[1], loop, reach=ReachOptions(swarm_name="t", trusted=frozenset())) as a,
        open_swarm(keys[2], loop, reach=ReachOptions(swarm_name="t")) as b,
    ):
        await a.connect(PeerInfo(relay.peer_id, relay.addrs()))
        await b.connect(PeerInfo(relay.peer_id, relay.addrs()))
        with trio.fail_after(30 * slowdown()):
            assert await a.reach.check([relay.peer_id]) == PUBLIC
        dials = a.reach.dialback
        assert isinstance(dials, DialBack)
        # b holds a reservation at the relay and advertises a circuit address through it
        assert await b.reach.reserve(relay.peer_id)
        circuits = [x for x in b.host.get_addrs() if is_relayed_addr(x)]
        assert circuits and str(relay.peer_id) in str(circuits[0]) and str(circuits[0]).endswith(str(b.peer_id))
        # a reaches b through the relay, and the relay counts what it carried
        with trio.fail_after(30 * slowdown()):
            await a.reach.dial_relayed(PeerInfo(b.peer_id, circuits), timeout=20 * slowdown())
        assert "relayed" in a.reach.kinds(b.peer_id)
        assert relay.reach.hop.circuits >= 1
        await wait_until(lambda: relay.reach.hop.bytes_relayed > 0, 30, 0.1, what="the relay to carry bytes")
        assert a.reach.status()["relay_dials"] == 1
        assert relay.reach.status()["relay_service"]["circuits"] >= 1
        assert PRIVATE != a.reach.state


async def test_a_pair_that_stays_relayed_gets_a_fresh_hole_punch_budget_after_a_pause(mock_clock):
    """After the library's attempts in a row fail (an end too busy to dial in time), the pair is left alone for a
    while, then tried again: a long-lived relayed pair is not given up on for good."""
    import node.reachability as reachability

    mock_clock.rate = 1.0  # the swarm runs in real time; the pause is jumped over
    pause = reachability.PUNCH_RETRY_AFTER
    loop = multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")
    async with open_swarm(create_new_key_pair(), loop, reach=ReachOptions()) as a:
        punch, other = a.reach.punch, ID.from_pubkey(create_new_key_pair().public_key)
        assert punch._may_try(other)
        punch._hole_punch_attempts[other] = reachability.MAX_HOLE_PUNCH_ATTEMPTS
        assert not punch._may_try(other)  # budget spent: pause
        mock_clock.jump(pause / 2)
        assert not punch._may_try(other)
        mock_clock.jump(pause / 2 + 0.01)
        assert punch._may_try(other) and punch._hole_punch_attempts[other] == 0 and punch.retries == 1
        assert a.reach.status()["hole_punches"]["retries"] == 1


async def test_a_hole_punch_whose_stream_never_opens_is_given_up_and_the_pair_freed(mock_clock, monkeypatch):
    """Upstream opens the DCUtR stream with no deadline (patch dcutr-stream-no-deadline): over a relayed connection
    gone quiet it waited 9 minutes in the NAT lab, and the pair, marked in progress, got no other attempt. Each
    attempt now ends within PUNCH_DEADLINE, counted as failed, and the pair may be tried again."""
    from node.libp2p import nat

    mock_clock.rate = 1.0  # the swarm runs in real time; the deadline is jumped over
    loop = multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")
    async with open_swarm(create_new_key_pair(), loop, reach=ReachOptions()) as a:
        punch, other = a.reach.punch, ID.from_pubkey(create_new_key_pair().public_key)

        async def never_opens(*args, **kwargs):
            await trio.sleep_forever()

        monkeypatch.setattr(punch.host, "new_stream", never_opens)
        done = trio.Event()

        async def drive() -> None:
            await punch._drive_one(other)
            done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(drive)
            with trio.fail_after(10):
                while other not in punch._in_progress:  # the attempt began, and waits on the stream
                    await trio.sleep(0.01)
            mock_clock.jump(nat.PUNCH_DEADLINE + 1)
            with trio.fail_after(10):
                await done.wait()
        assert other not in punch._in_progress and punch.attempts(other) == 1
        assert punch.failed == 1 and a.reach.status()["hole_punches"]["failed"] == 1


@needs_lab
@pytest.mark.slow
def test_nat_swarm_converges_with_relays_and_hole_punching(tmp_path, tiny_model_dir):
    from bench.nat import punch_log, report, run_scenario, save

    # the scenario's deadlines (convergence, then the cone pair's punch) stretch with the load like every wait here
    result = run_scenario(tmp_path, tiny_model_dir, steps=40, timeout=480, punch_wait=150, stretch=slowdown)
    print(report(result))
    save(result, tmp_path / "results")
    rows = {r["sampler"]: r for r in result["samplers"]}
    for r in rows.values():
        # every sampler converged to the trainer's last version, and the trainer accepted its rollouts
        assert r["version"] == result["final_version"], r
        assert r["rollouts_accepted"] > 0, r
        # each node knows whether it can be dialed
        assert r["reachability"] == (PUBLIC if r["nat"] == "public" else PRIVATE), r
        if r["nat"] != "public":
            assert r["relay_reservations"] >= 1, r
    assert result["trainer"]["reachability"] == PUBLIC and result["boot_reachability"] == PUBLIC
    # the two cone-NAT samplers got a direct connection to each other by hole punching (at some point: on this
    # busy box an attempt can fail or a connection die later; the pair is then tried again after a pause)
    logs = "\n".join(f"--- {n}\n{punch_log(tmp_path, n)}" for n in ("s4", "s5"))
    assert result["cone_pair_punched_s"] is not None, logs
    assert "s5" in rows["s4"]["punched_samplers"] or "s4" in rows["s5"]["punched_samplers"], (rows["s4"], rows["s5"])
    # symmetric-NAT samplers reach the other NATed ones only through relays, yet converge
    assert rows["s6"]["paths_to_samplers"].get("s7") in ("relayed", None)
    assert "s7" not in rows["s6"]["punched_samplers"] and "s6" not in rows["s7"]["punched_samplers"]
    # NATed samplers serve chunks too (to public peers over their own outbound connections, to cones punched)
    assert rows["s4"]["chunk_bytes_served"] > 0 and rows["s5"]["chunk_bytes_served"] > 0
    # relays are for control traffic: they carry a few percent of the chunk bytes at most
    assert result["relay_share"] <= 0.05, result["relay_share"]
    # nothing accepted is lost
    t = result["trainer"]
    assert (
        t["groups_accepted"] == t["groups_trained"] + t["groups_stale"] + t["groups_no_signal"] + t["groups_buffered"]
    )
