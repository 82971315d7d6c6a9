"""node/connmgr.py: whom a node keeps connected (issue 26, items 1a and 4), its rules alone and on real hosts.

The hosts are real ones on 127.0.0.1 (TCP + Noise + yamux): idle identities that fill the inbound slots, one
address over its cap, a peer that stops answering keepalive pings, a peer opening streams it never negotiates.
"""

from __future__ import annotations

from contextlib import AsyncExitStack

import multiaddr
import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.stream_muxer.yamux import yamux as yamux_module

from node.config import SwarmSettings
from node.connmgr import (
    Conn,
    ConnLimits,
    ConnManager,
    address_groups,
    admit_peer,
    conn_limits,
    make_room,
    pong_overdue,
    prune_order,
    refuse_address,
    refuse_stream,
)
from node.host import build_host, open_swarm
from node.libp2p import patches as libp2p_patches
from tests.helpers import wait_until

LISTEN = multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")
ECHO = "/swarmrl-test/echo/1"

# -- the rules -------------------------------------------------------------------------------------------------------

OPEN = ConnLimits(exempt=())


def test_address_groups_are_the_ip_its_24_and_its_16_or_v6_prefixes():
    assert address_groups("203.0.113.7", OPEN) == (
        ("203.0.113.7/32", 8),
        ("203.0.113.0/24", 32),
        ("203.0.0.0/16", 64),
    )
    assert [net for net, _ in address_groups("2001:db8:1:2::5", OPEN)] == [
        "2001:db8:1:2::/64",
        "2001:db8:1::/48",
        "2001:db8::/32",
    ]
    assert address_groups("::ffff:203.0.113.7", OPEN)[0] == ("203.0.113.7/32", 8)  # a v4 peer on a v6 socket
    assert address_groups("127.0.0.1", ConnLimits()) == ()  # loopback: every local process shares it
    assert address_groups("::1", ConnLimits()) == ()
    assert address_groups(None, OPEN) == () and address_groups("not an ip", OPEN) == ()
    assert [net for net, _ in address_groups("10.0.0.1", ConnLimits(per_ip=0, exempt=()))] == [
        "10.0.0.0/24",
        "10.0.0.0/16",
    ]


def test_refuse_address_names_the_first_group_at_its_cap():
    groups = address_groups("198.51.100.9", OPEN)
    assert refuse_address(groups, {}) is None
    assert refuse_address(groups, {"198.51.100.9/32": 7, "198.51.100.0/24": 31}) is None
    assert "198.51.100.9/32" in (refuse_address(groups, {"198.51.100.9/32": 8}) or "")
    # a /24 full of other addresses refuses this one too
    assert "198.51.100.0/24" in (refuse_address(groups, {"198.51.100.0/24": 32}) or "")


def conn(key: int, *, inbound=True, protected=False, opened=0.0, last=None, streams=0) -> Conn:
    return Conn(key, inbound, protected, opened, opened if last is None else last, streams)


def test_prune_order_takes_the_idlest_unprotected_inbound_connection_past_its_grace():
    limits = ConnLimits(grace=10, busy_idle=60)
    now = 100.0
    conns = [
        conn(1, last=50),  # idle since 50
        conn(2, last=20),  # idle since 20: first
        conn(3, last=10, protected=True),  # protected: never
        conn(4, last=0, inbound=False),  # outbound: ours, never
        conn(5, opened=95),  # in its grace period
        conn(6, last=30, streams=2),  # streams open, unchanged for 70 s: after every idle one
        conn(7, last=90, streams=1),  # streams open and busy: never
    ]
    assert prune_order(conns, now, limits) == [2, 1, 6]
    assert make_room(1, conns, now, limits) == []  # a slot is free: nobody goes
    assert make_room(0, conns, now, limits) == [2]
    assert make_room(0, [conn(3, protected=True), conn(5, opened=95)], now, limits) == []  # none may go: refused


def test_admit_peer_keeps_the_reserved_slots_for_protected_peers():
    limits = ConnLimits(max_inbound=4, reserved=1, grace=0)
    now = 10.0
    others = [conn(1, last=5), conn(2, last=1), conn(3, protected=True)]
    assert admit_peer(conn(9, opened=now), others[:1], now, limits).admit  # 2 unprotected of 3 allowed
    # a third unprotected one would take the reserved slot: the idlest unprotected one goes for it
    full = [*others, conn(4, last=8)]
    assert admit_peer(conn(9, opened=now), full, now, limits).evict == (2,)
    assert admit_peer(conn(9, opened=now, protected=True), full, now, limits) == admit_peer(
        conn(9, inbound=False), full, now, limits
    )  # protected, or outbound: in without pruning anyone
    assert admit_peer(conn(9, opened=now, protected=True), full, now, limits).evict == ()
    # nobody may go (all busy or protected): the newcomer is refused
    busy = [conn(1, last=9, streams=1), conn(2, last=9, streams=1), conn(4, last=9, streams=1), conn(3, protected=True)]
    assert not admit_peer(conn(9, opened=now), busy, now, limits).admit


def test_pong_overdue_and_the_stream_cap():
    assert not pong_overdue(0.0, False, 100.0, 45)  # no ping sent yet
    assert not pong_overdue(10.0, True, 100.0, 45)  # answered
    assert not pong_overdue(60.0, False, 100.0, 45)
    assert pong_overdue(50.0, False, 100.0, 45)
    # bytes read since the ping went out: the peer is there, its pong late or dropped; nothing since: dead
    assert not pong_overdue(50.0, False, 100.0, 45, last_read=51.0)
    assert pong_overdue(50.0, False, 100.0, 45, last_read=49.0)
    assert not pong_overdue(60.0, False, 100.0, 45, last_read=10.0)  # not overdue yet
    limits = ConnLimits(max_unnegotiated=16)
    assert not refuse_stream(15, limits) and refuse_stream(16, limits)


def test_conn_limits_from_the_swarm_knobs():
    limits = conn_limits(SwarmSettings(max_inbound=100, reserved_inbound=10, inbound_per_ip=4))
    assert (limits.max_inbound, limits.reserved, limits.per_ip, limits.per_subnet, limits.per_wide_subnet) == (
        100, 10, 4, 16, 32,
    )  # fmt: skip
    assert conn_limits(SwarmSettings()) == ConnLimits()


# -- on real hosts ---------------------------------------------------------------------------------------------------

SLOTS = 20


def info(host) -> PeerInfo:
    return PeerInfo(host.get_id(), [a for a in host.get_addrs() if "127.0.0.1" in str(a)])


async def hold_idle_connection(stack: AsyncExitStack, server: PeerInfo) -> ID | None:
    """A fresh identity that connects and does nothing; its peer id, or None if it was refused."""
    client = await idle_identity(stack, server)
    return None if client is None else client.get_id()


async def idle_identity(stack: AsyncExitStack, server: PeerInfo):
    """A fresh identity's host, connected to ``server`` (None if it was refused), running until ``stack`` ends."""
    client = build_host(create_new_key_pair())
    await stack.enter_async_context(client.run([]))
    try:
        with trio.fail_after(20):
            await client.connect(server)
    except Exception:
        return None
    return client


async def newcomer_connects(server: PeerInfo, server_host) -> bool:
    """A fresh identity connects, and the server still holds its connection a moment later."""
    client = build_host(create_new_key_pair())
    async with client.run([]):
        try:
            with trio.fail_after(20):
                await client.connect(server)
        except Exception:
            return False
        try:
            await wait_until(lambda: bool(server_host.get_network().get_connections(client.get_id())), 5, 0.05)
            await trio.sleep(0.3)  # a refused connection is closed right after the handshake
        except TimeoutError:
            return False
        return client.get_id() in server_host.get_connected_peers()


async def test_stock_idle_identities_lock_out_a_newcomer():
    """Issue 26, 1a, on stock py-libp2p (patch ``inbound-no-admission``): 20 idle identities hold 20 slots, and a
    fresh identity is refused for as long as they stay."""
    with libp2p_patches.disabled():
        server = build_host(create_new_key_pair())
        async with server.run([LISTEN]), AsyncExitStack() as stack:
            server.get_network()._inbound_limiter.total_tokens = SLOTS
            held = [await hold_idle_connection(stack, info(server)) for _ in range(SLOTS)]
            assert all(held)
            assert not await newcomer_connects(info(server), server)


async def test_idle_identities_no_longer_lock_out_a_newcomer():
    """The same 20 slots, held by idle identities from the same address: each newcomer gets in by closing the
    connection idle the longest; the unreserved slots stay bounded."""
    limits = ConnLimits(max_inbound=SLOTS, reserved=2, grace=0.0)
    async with open_swarm(create_new_key_pair(), LISTEN, conns=limits) as server, AsyncExitStack() as stack:
        me = info(server.host)
        held = [await hold_idle_connection(stack, me) for _ in range(SLOTS + 5)]
        assert all(held)  # every idle identity got in, each pruning an older one once the slots ran short
        assert await newcomer_connects(me, server.host)
        assert await newcomer_connects(me, server.host)
        inbound = server.conns.status()["inbound"]
        assert inbound <= SLOTS - limits.reserved
        assert server.conns.counts["pruned"] >= SLOTS + 5 - (SLOTS - limits.reserved)


async def test_protected_peers_are_never_pruned_and_use_the_reserved_slots():
    limits = ConnLimits(max_inbound=6, reserved=2, grace=0.0)
    async with open_swarm(create_new_key_pair(), LISTEN, conns=limits) as server, AsyncExitStack() as stack:
        me = info(server.host)
        friends: set[ID] = set()
        server.conns.set_valued(lambda peer: peer in friends)
        first = await hold_idle_connection(stack, me)
        assert first is not None
        friends.add(first)  # a peer with an accepted record, say
        strangers = [await hold_idle_connection(stack, me) for _ in range(8)]
        assert all(strangers), (strangers, dict(server.conns.counts))  # None: refused (the counts say why)

        def unprotected() -> list[ID]:
            return [p for p in server.host.get_connected_peers() if p != first]

        # the server closes whom it pruned in its own tasks: the count comes down to the unreserved slots (it was
        # 4 at once after each connect in 15 runs beside two burners; 8 without the manager)
        await wait_until(lambda: len(unprotected()) <= limits.max_inbound - limits.reserved, 10, what="pruning")
        assert first in server.host.get_connected_peers()  # the idlest of all, but valued: kept


async def test_one_address_holds_at_most_its_cap_and_its_count_is_returned():
    limits = ConnLimits(per_ip=3, exempt=())  # 127.0.0.1 capped like any other address
    async with open_swarm(create_new_key_pair(), LISTEN, conns=limits) as server, AsyncExitStack() as stack:
        me = info(server.host)
        held = [await idle_identity(stack, me) for _ in range(5)]
        await wait_until(lambda: server.conns.status()["inbound"] == 3, 10, what="3 inbound connections")
        assert sum(c is not None and c.get_id() in server.host.get_connected_peers() for c in held) == 3
        assert server.conns.counts["refused_address"] >= 2
        for client in held:
            if client is not None:
                await client.disconnect(server.peer_id)
        # the peers left: their address counts are given back, nothing is kept per address
        await wait_until(lambda: not server.conns._held, 10, what="per-address counts back to none")
        assert await newcomer_connects(me, server.host)


async def test_a_departed_host_that_never_closed_its_connection_loses_it(monkeypatch):
    """A py-libp2p host whose run() has ended does not close its connections (nothing is sent: no FIN, no
    GO_AWAY): the server held them for good. No pong comes any more, so keepalive closes them."""
    monkeypatch.setattr("node.connmgr.KEEPALIVE_CHECK", 0.2)
    monkeypatch.setattr(yamux_module, "RTT_MEASURE_INTERVAL", 0.5)  # yamux's keepalive ping, every 30 s otherwise
    limits = ConnLimits(keepalive_timeout=1.5)
    async with open_swarm(create_new_key_pair(), LISTEN, conns=limits) as server:
        async with AsyncExitStack() as stack:
            gone = [await hold_idle_connection(stack, info(server.host)) for _ in range(3)]
            assert all(gone)
        assert all(p in server.host.get_connected_peers() for p in gone)  # still held: nobody said goodbye
        await wait_until(
            lambda: not set(gone) & set(server.host.get_connected_peers()), 10, what="the departed peers closed"
        )
        assert server.conns.counts["dead"] >= 3
        await wait_until(lambda: server.conns.status()["inbound"] == 0, 10, what="no inbound connection left")


async def test_streams_never_negotiated_are_capped_while_honest_requests_go_on():
    """Issue 26, item 4: one connection opens 200 streams and never says which protocol; the first one over
    ``max_unnegotiated`` is reset and the connection closed, and another peer's request is answered meanwhile."""
    limits = ConnLimits()  # max_unnegotiated 32
    async with open_swarm(create_new_key_pair(), LISTEN, conns=limits) as server:

        async def echo(stream) -> None:
            await stream.write(await stream.read(64))
            await stream.close()

        server.host.set_stream_handler(ECHO, echo)
        flooder = build_host(create_new_key_pair())
        honest = build_host(create_new_key_pair())
        async with flooder.run([]), honest.run([]):
            await flooder.connect(info(server.host))
            await honest.connect(info(server.host))
            conn = flooder.get_network().get_connections(server.peer_id)[0]
            opened = 0
            with trio.move_on_after(10):
                for _ in range(200):  # raw yamux streams: no multistream-select
                    try:
                        await conn.muxed_conn.open_stream()
                    except Exception:  # the server closed the connection
                        break
                    opened += 1
            await wait_until(
                lambda: flooder.get_id() not in server.host.get_connected_peers(), 10, what="the flooder closed"
            )
            assert opened > limits.max_unnegotiated  # it got past the cap, and no further than the close
            assert server.conns.counts["closed_for_streams"] == 1
            with trio.fail_after(10):
                stream = await honest.new_stream(server.peer_id, [ECHO])
                await stream.write(b"ping")
                assert await stream.read(64) == b"ping"


@pytest.mark.parametrize("max_inbound", [1, 250])
def test_the_manager_sizes_the_inbound_limiter(max_inbound):
    host = build_host(create_new_key_pair())
    ConnManager(host, ConnLimits(max_inbound=max_inbound)).install()
    assert host.get_network()._inbound_limiter.total_tokens == max_inbound
