"""Issue 26, 1(a), the churn part: an address whose connection was pruned to make room cools down before it may
connect again. An attacker with more addresses than the trainer has slots (bench/hostile ``idle``: 256 fresh
identities at 256 addresses, 234 unreserved slots) kept ~5 new connections a second coming, each closing another;
now each pruned address is out for ``cooldown`` seconds, so keeping up that rate takes that many times more
addresses."""

from __future__ import annotations

from contextlib import AsyncExitStack

import multiaddr
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import PeerInfo

from node.connmgr import ConnLimits, address_key, cooling
from node.host import build_host, open_swarm
from tests.helpers import slowdown, wait_until

LISTEN = multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")


def test_an_address_cools_down_after_a_prune_and_only_that_address():
    limits = ConnLimits(exempt=())
    a, b = address_key("203.0.113.9", limits), address_key("203.0.113.10", limits)
    pruned = {a: 100.0}
    assert cooling(a, pruned, 130.0, 60.0) and not cooling(b, pruned, 130.0, 60.0)
    assert not cooling(a, pruned, 160.0, 60.0)  # cooled down
    assert address_key("2001:db8::1", limits) == address_key("2001:db8::2", limits) == "2001:db8::/64"
    assert address_key("127.0.0.1", ConnLimits()) is None and not cooling(None, {}, 0.0, 60.0)  # exempt


async def connect_from(stack: AsyncExitStack, server: PeerInfo, source: str) -> bool:
    """A fresh identity dials ``server`` from ``source`` (a loopback address) and holds the connection; whether the
    server still holds it a moment later."""
    host = build_host(create_new_key_pair())
    for transport in host.get_network().transport_manager.get_transports():
        dial_with_source = getattr(transport, "dial_with_source", None)
        if dial_with_source is not None:

            async def dial(maddr, _dial=dial_with_source):
                return await _dial(maddr, (source, 0))

            transport.dial = dial
    await stack.enter_async_context(host.run([]))
    try:
        with trio.fail_after(10 * slowdown()):
            await host.connect(server)
        await trio.sleep(0.3)  # a refused connection is closed right after the handshake, or never handshakes
    except Exception:
        return False
    return bool(host.get_network().get_connections(server.peer_id))


async def test_a_pruned_address_is_refused_until_it_has_cooled_down():
    limits = ConnLimits(max_inbound=3, reserved=0, per_ip=0, per_subnet=0, per_wide_subnet=0, exempt=(), grace=0.5)
    async with open_swarm(create_new_key_pair(), LISTEN, conns=limits) as server, AsyncExitStack() as stack:
        where = PeerInfo(server.peer_id, [a for a in server.host.get_addrs() if "127.0.0.1" in str(a)])
        for _ in range(3):  # every slot held by idle identities at one address
            assert await connect_from(stack, where, "127.0.0.1")
        await trio.sleep(limits.grace + 0.2)
        assert await connect_from(stack, where, "127.0.0.2")  # in, by closing one of them
        await wait_until(lambda: server.conns.counts["pruned"] == 1, 10, what="the prune")
        assert not await connect_from(stack, where, "127.0.0.1")  # its address is cooling down: refused
        assert server.conns.counts["refused_cooling"] >= 1  # (a dial may be retried)
        await trio.sleep(limits.grace)
        assert await connect_from(stack, where, "127.0.0.3")  # another address still gets in


async def test_a_peer_announcing_an_oversized_frame_is_hung_up_on_and_its_address_cools():
    """bench/hostile ``headers``: 40 identities announcing 1 MiB work frames (limit 4 KiB) reopened ~64 streams a
    second, each refused, each costing the trainer a protocol negotiation and an error reply (honest throughput
    0.32-0.78 of clean). Now the first one costs the peer its connection, and its address a cooldown."""
    from node.rpc import serve
    from protocols.framing import HEADER, FrameReader, unpack

    limits = ConnLimits(exempt=(), cooldown=60.0)
    async with open_swarm(create_new_key_pair(), LISTEN, conns=limits) as server, AsyncExitStack() as stack:

        async def echo(message, peer):
            return {"v": 1, "t": "ok"}

        server.host.set_stream_handler("/test/echo/1", serve("echo", echo, max_request=4096, max_reply=4096))
        where = PeerInfo(server.peer_id, [a for a in server.host.get_addrs() if "127.0.0.1" in str(a)])
        attacker = build_host(create_new_key_pair())
        for transport in attacker.get_network().transport_manager.get_transports():
            dial_with_source = getattr(transport, "dial_with_source", None)
            if dial_with_source is not None:

                async def dial(maddr, _dial=dial_with_source):
                    return await _dial(maddr, ("127.0.0.2", 0))

                transport.dial = dial
        await stack.enter_async_context(attacker.run([]))
        with trio.fail_after(10 * slowdown()):
            await attacker.connect(where)
            stream = await attacker.new_stream(server.peer_id, ["/test/echo/1"])
            await stream.write(HEADER.pack(1 << 20))  # a 1 MiB frame announced, and nothing sent
            reply = unpack(await FrameReader(stream).read_body(4096), 4096)
        assert reply["t"] == "error", reply  # told why, as before
        await wait_until(
            lambda: not attacker.get_network().get_connections(server.peer_id), 10, what="the server to hang up"
        )
        assert server.conns.counts["hung_up_oversized"] == 1
        assert not await connect_from(stack, where, "127.0.0.2")  # its address cools down
        assert await connect_from(stack, where, "127.0.0.3")  # another address is served


async def test_a_peer_hung_up_on_is_not_dialled_back_during_its_cooldown():
    """Burner run i2: after the hang-up the trainer's own dial (its DHT or a reachability check) connected it to the
    flooder again at once, so the hang-up did not hold. Our dials to a peer we hung up on are closed for the
    cooldown; the peer may still come back by dialling in (its address's cooldown governs that)."""
    from libp2p.peer.peerinfo import info_from_p2p_addr

    from node.rpc import serve
    from protocols.framing import HEADER, FrameReader

    limits = ConnLimits(cooldown=60.0)  # loopback is exempt from address cooldowns: only the peer's id counts here
    async with (
        open_swarm(create_new_key_pair(), LISTEN, conns=limits) as server,
        open_swarm(create_new_key_pair(), LISTEN) as flooder,
    ):

        async def echo(message, peer):
            return {"v": 1, "t": "ok"}

        server.host.set_stream_handler("/test/echo/1", serve("echo", echo, max_request=4096, max_reply=4096))
        with trio.fail_after(10 * slowdown()):
            await flooder.connect(info_from_p2p_addr(server.addrs()[0]))
            stream = await flooder.host.new_stream(server.peer_id, ["/test/echo/1"])
            await stream.write(HEADER.pack(1 << 20))
            await FrameReader(stream).read_body(4096)
        await wait_until(lambda: not server.host.get_network().get_connections(flooder.peer_id), 10, what="hang-up")
        try:
            await server.connect(info_from_p2p_addr(flooder.addrs()[0]))  # our own dial back to it
        except Exception:
            pass  # closed under the dialler, or refused: either way no connection stays
        await wait_until(lambda: server.conns.counts["closed_dial_to_hung_up"] >= 1, 10, what="the dial closed")
        await wait_until(lambda: not flooder.host.get_network().get_connections(server.peer_id), 10, what="no conn")
        await flooder.connect(info_from_p2p_addr(server.addrs()[0]))  # it may dial in again
        assert server.host.get_network().get_connections(flooder.peer_id)
