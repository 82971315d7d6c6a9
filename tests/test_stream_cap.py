"""Issue 26, item 4, the process-wide part: inbound streams waiting for protocol negotiation are capped in all, not
only per connection. Each connection may have 32 waiting (node/connmgr.py), so many identities at many addresses,
each under its own cap, held thousands at once (each waits up to 10 s for a peer that never speaks). Past
``max_unnegotiated_total`` a connection gets its fair share: a stream over it is reset, its connection kept."""

from __future__ import annotations

import multiaddr
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import PeerInfo

from node.connmgr import ConnLimits, refuse_stream
from node.host import build_host, open_swarm
from tests.helpers import slowdown, wait_until

LISTEN = multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")
ECHO = "/swarmrl-test/echo/1"


def test_a_connection_over_its_cap_is_closed_and_past_the_process_cap_each_gets_a_fair_share():
    limits = ConnLimits(max_unnegotiated=32, max_unnegotiated_total=100)
    assert refuse_stream(31, limits, 99, 4) is None
    assert refuse_stream(32, limits, 40, 4) == "close"  # its own cap, whatever the rest
    assert refuse_stream(25, limits, 100, 4) == "reset"  # 100 in all: 25 each
    assert refuse_stream(24, limits, 100, 4) is None
    # a share rounds down to 0 with many connections waiting: a connection with none waiting still gets one
    assert refuse_stream(0, limits, 100, 200) is None
    assert refuse_stream(1, limits, 100, 200) == "reset"


def expected_resets(limits: ConnLimits, arrivals: list[int]) -> int:
    """How many streams the rule resets when connection i opens ``arrivals[i]`` streams, one connection after
    the other, none negotiating."""
    waiting: list[int] = []
    resets = 0
    for n in arrivals:
        waiting.append(0)
        for _ in range(n):
            verdict = refuse_stream(waiting[-1], limits, sum(waiting), sum(1 for w in waiting if w) or 1)
            if verdict is None:
                waiting[-1] += 1
            else:
                resets += 1
    return resets


async def test_many_connections_under_their_own_cap_share_the_process_cap():
    """Three peers each open 24 streams they never negotiate (under the per-connection cap of 32), one after the
    other: past 40 in all, each connection's streams beyond a fair share of the 40 are reset (15 of the 72),
    nobody is disconnected, and another peer's request is answered. On the old code all 72 waited."""
    total, per_peer, peers = 40, 24, 3
    limits = ConnLimits(max_unnegotiated=32, max_unnegotiated_total=total)
    want = expected_resets(limits, [per_peer] * peers)
    assert want == 15  # A: 24; B: 16, then 20 (40 // 2); C: 13 (40 // 3)
    async with open_swarm(create_new_key_pair(), LISTEN, conns=limits) as server:

        async def echo(stream) -> None:
            await stream.write(await stream.read(64))
            await stream.close()

        server.host.set_stream_handler(ECHO, echo)
        where = PeerInfo(server.peer_id, [a for a in server.host.get_addrs() if "127.0.0.1" in str(a)])
        flooders = [build_host(create_new_key_pair()) for _ in range(peers)]
        honest = build_host(create_new_key_pair())
        network = server.host.get_network()

        def arrived() -> int:  # streams the server holds from the flooders, and those it reset
            held = sum(len(c.get_streams()) for f in flooders for c in network.get_connections(f.get_id()))
            return held + server.conns.counts["streams_refused"]

        async with flooders[0].run([]), flooders[1].run([]), flooders[2].run([]), honest.run([]):
            for host in [*flooders, honest]:
                await host.connect(where)
            await wait_until(lambda: arrived() == 0, 10, what="the connections' first streams (identify) to end")
            with trio.fail_after(8 * slowdown()):  # inside the 10 s each stream waits to negotiate
                for i, host in enumerate(flooders):
                    conn = host.get_network().get_connections(server.peer_id)[0]
                    for _ in range(per_peer):  # raw yamux streams: no multistream-select
                        await conn.muxed_conn.open_stream()
                    await wait_until(lambda i=i: arrived() >= (i + 1) * per_peer, 8, what=f"flooder {i}'s streams")
            refused = server.conns.counts["streams_refused_total"]
            assert want - 2 <= refused <= want, dict(server.conns.counts)  # (an identify stream may count)
            assert server.conns.counts["closed_for_streams"] == 0
            assert all(server.peer_id in host.get_connected_peers() for host in flooders)
            with trio.fail_after(10 * slowdown()):
                stream = await honest.new_stream(server.peer_id, [ECHO])
                await stream.write(b"ping")
                assert await stream.read(64) == b"ping"
