"""Relay reservations and AutoNAT dial-backs are keyed on the stream's authenticated peer and its IP (issue 26,
items 1b and 1c): the pure rules (node/reachability.py), py-libp2p's bugs on stock code, and real hosts on loopback.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager, suppress

import multiaddr
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.host.autonat.autonat import AUTONAT_PROTOCOL_ID, AutoNATService
from libp2p.host.autonat.pb.autonat_pb2 import Message
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL_ID
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg
from libp2p.tools.anyio_service import background_trio_service
from libp2p.utils.varint import encode_varint_prefixed, read_varint_prefixed_bytes_limited

from node import reachability
from node.host import build_host, open_swarm
from node.libp2p import DialBack
from node.reachability import (
    DialBackGate,
    DialBackLimits,
    ReachOptions,
    dial_back_refusal,
    ip_group,
    reservation_refusal,
)
from tests.helpers import slowdown, wait_until

LOOP = multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")


def made_up() -> ID:
    return ID.from_pubkey(create_new_key_pair().public_key)


def info(host) -> PeerInfo:
    return PeerInfo(host.get_id(), [a for a in host.get_addrs() if "127.0.0.1" in str(a)])


# -- the rules ------------------------------------------------------------------------------------------------------


def test_ip_group_is_the_ipv4_address_or_the_ipv6_64():
    assert ip_group("203.0.113.7") == "203.0.113.7"
    assert ip_group("::ffff:203.0.113.7") == "203.0.113.7"
    assert ip_group("2001:db8:1:2::5") == ip_group("2001:db8:1:2:ffff::9") == "2001:db8:1:2::/64"
    assert ip_group("2001:db8:1:3::5") != ip_group("2001:db8:1:2::5")


def test_reachability_is_rechecked_ever_less_often_while_the_verdict_holds():
    waits = [reachability.next_check(reachability.PUBLIC, 60.0, held) for held in range(7)]
    assert waits == [60.0, 120.0, 240.0, 480.0, 960.0, 960.0, 960.0]
    assert max(waits) == reachability.CHECK_CAP * 60.0
    assert reachability.next_check(reachability.PRIVATE, 60.0, 0) == 60.0  # just changed: soon again
    assert reachability.next_check(reachability.UNKNOWN, 60.0, 5) == 3.0


def test_reservation_refusal_one_per_peer_a_few_per_ip_then_no_free_slot():
    a, b, c = made_up(), made_up(), made_up()
    holders = {a: "10.0.0.1", b: "10.0.0.1"}
    assert reservation_refusal(a, "10.0.0.1", holders, slots=3, per_ip=2) is None  # a renews its own
    assert "2 reservations already held from 10.0.0.1" in str(reservation_refusal(c, "10.0.0.1", holders, 3, 2))
    assert reservation_refusal(c, "10.0.0.2", holders, 3, 2) is None
    full = {**holders, made_up(): "10.0.0.3"}
    assert "all 3 reservation slots taken" in str(reservation_refusal(c, "10.0.0.2", full, 3, 2))
    assert reservation_refusal(a, "10.0.0.1", full, 3, 2) is None  # a renewal needs no free slot
    # an IPv6 host rotating through its /64 is one IP
    assert reservation_refusal(c, "2001:db8::ffff", {a: "2001:db8::1"}, 3, 1) is not None
    assert reservation_refusal(c, "2001:db8:0:1::1", {a: "2001:db8::1"}, 3, 1) is None
    assert reservation_refusal(c, None, {}, 3, 2) is not None


def test_dial_back_refusal_per_peer_per_ip_and_queue():
    limits = DialBackLimits(every=5.0, queue=3, per_ip=2, ip_burst=4.0, ip_rate=0.5)
    ok = dict(since_asked=None, peer_pending=False, ip_pending=0, pending=0, ip_tokens=4.0, cost=4, limits=limits)
    assert dial_back_refusal(**ok) is None
    assert dial_back_refusal(**{**ok, "since_asked": 5.0}) is None
    assert "asked too often" in str(dial_back_refusal(**{**ok, "since_asked": 4.9}))
    assert "asked too often" in str(dial_back_refusal(**{**ok, "since_asked": 60.0, "peer_pending": True}))
    assert "pending from your IP" in str(dial_back_refusal(**{**ok, "ip_pending": 2}))
    assert "30 addresses a minute" in str(dial_back_refusal(**{**ok, "ip_tokens": 3.9}))
    assert "busy: 3 dial-backs pending" in str(dial_back_refusal(**{**ok, "pending": 3}))


def test_dial_back_gate_counts_pending_requests_and_refills_ip_budgets():
    now = [0.0]
    gate = DialBackGate(DialBackLimits(every=5.0, queue=3, per_ip=2, ip_burst=4.0, ip_rate=0.5), clock=lambda: now[0])
    a, b, c, d = made_up(), made_up(), made_up(), made_up()
    assert gate.admit(a, "10.0.0.1", 3) is None
    assert "asked too often" in str(gate.admit(a, "10.0.0.1", 1))  # pending, and too soon
    assert "addresses a minute" in str(gate.admit(b, "10.0.0.1", 2))  # 1 address left at 10.0.0.1
    assert gate.admit(b, "10.0.0.1", 1) is None
    assert "pending from your IP" in str(gate.admit(c, "10.0.0.1", 1))
    assert gate.admit(c, "10.0.0.2", 4) is None
    assert "busy: 3 dial-backs pending" in str(gate.admit(d, "10.0.0.3", 1))
    gate.release(a, "10.0.0.1")
    assert gate.admit(d, "10.0.0.3", 1) is None
    for peer, ip in ((b, "10.0.0.1"), (c, "10.0.0.2"), (d, "10.0.0.3")):
        gate.release(peer, ip)
    assert gate.pending == 0 and gate.refused == 4
    now[0] = 4.0  # a is not pending any more, but asked 4 s ago
    assert "asked too often" in str(gate.admit(a, "10.0.0.1", 1))
    now[0] = 5.0  # and 10.0.0.1 has 0 + 5 s x 0.5 = 2.5 addresses again
    assert "addresses a minute" in str(gate.admit(a, "10.0.0.1", 3))
    assert gate.admit(a, "10.0.0.1", 2) is None


# -- circuit relay v2: RESERVE ---------------------------------------------------------------------------------------


async def reserve(host, relay: ID, claims: list[ID | None]) -> list[int]:
    """Send one RESERVE per entry of ``claims`` on one HOP stream (each naming that peer id, or none), and return
    the status of each reply."""
    stream = await host.new_stream(relay, [HOP_PROTOCOL_ID])
    out = []
    try:
        for claimed in claims:
            msg = HopMessage(type=HopMessage.RESERVE)
            if claimed is not None:
                msg.peer.id = claimed.to_bytes()
            await write_delimited_msg(stream, msg)
            with trio.fail_after(15 * slowdown()):
                out.append(int((await read_delimited_msg(stream, HopMessage)).status))
    finally:
        with suppress(Exception):
            await stream.close()
    return out


async def reserve_each(host, relay: ID, claims: list[ID | None]) -> list[int]:
    """``reserve`` with a stream per RESERVE (py-libp2p's relay ends a HOP stream after an error reply)."""
    return [(await reserve(host, relay, [claimed]))[0] for claimed in claims]


async def test_stock_relay_books_reservations_for_claimed_peer_ids():
    """py-libp2p's ``_handle_reserve`` books ``msg.peer.id``: one peer naming 4 made-up ids fills a relay's 4 slots
    (each RESERVE is answered with an error, after its slot was booked) and an honest peer is refused."""
    limits = RelayLimits(duration=60, data=1 << 20, max_circuit_conns=4, max_reservations=4, reservation_ttl=600)
    relay, attacker, honest = (build_host(create_new_key_pair()) for _ in range(3))
    stock = CircuitV2Protocol(relay, limits, allow_hop=True)
    with trio.fail_after(60 * slowdown()):
        async with relay.run([LOOP]), attacker.run([]), honest.run([]), background_trio_service(stock):
            await attacker.connect(info(relay))
            await honest.connect(info(relay))
            statuses = await reserve_each(attacker, relay.get_id(), [made_up() for _ in range(4)])
            assert StatusCode.OK not in statuses  # an error reply (AttributeError: NetStream has no is_open)
            assert len(stock.resource_manager._reservations) == 4  # booked for peers that do not exist
            assert attacker.get_id() not in stock.resource_manager._reservations
            assert await reserve(honest, relay.get_id(), [None]) == [StatusCode.RESOURCE_LIMIT_EXCEEDED]


async def test_one_peer_naming_made_up_ids_holds_one_relay_slot():
    """Issue 26, 1(b): one identity sending RESERVEs that name made-up peer ids, a stream each or all on one
    stream, holds one slot (its own, renewed); an honest peer still reserves. On the old code the attacker took
    all 4 slots."""
    relay_options = ReachOptions(swarm_name="t", relay=True, relay_slots=4, assume_public=True)
    attacker, honest = build_host(create_new_key_pair()), build_host(create_new_key_pair())
    with trio.fail_after(90 * slowdown()):
        async with open_swarm(create_new_key_pair(), LOOP, reach=relay_options) as relay:
            async with attacker.run([]), honest.run([]):
                await attacker.connect(PeerInfo(relay.peer_id, relay.addrs()))
                await honest.connect(PeerInfo(relay.peer_id, relay.addrs()))
                hop = relay.reach.hop
                await reserve_each(attacker, relay.peer_id, [made_up() for _ in range(6)])
                assert set(hop.resource_manager._reservations) <= {attacker.get_id()}
                assert await reserve(attacker, relay.peer_id, [made_up() for _ in range(6)]) == [StatusCode.OK] * 6
                assert set(hop.resource_manager._reservations) == {attacker.get_id()}
                assert await reserve(honest, relay.peer_id, [honest.get_id()]) == [StatusCode.OK]
                assert honest.get_id() in hop.resource_manager._reservations and hop.reservations <= 2


async def test_relay_caps_reservations_per_ip_and_frees_a_departed_peers_slot():
    """Peers at one IP hold ``relay_slots_per_ip`` reservations; one that disconnects frees its slot at once."""
    options = ReachOptions(swarm_name="t", relay=True, relay_slots=8, relay_slots_per_ip=2, assume_public=True)
    peers = [build_host(create_new_key_pair()) for _ in range(3)]
    with trio.fail_after(90 * slowdown()):
        async with open_swarm(create_new_key_pair(), LOOP, reach=options) as relay:
            async with peers[0].run([]), peers[1].run([]), peers[2].run([]):
                for peer in peers:
                    await peer.connect(PeerInfo(relay.peer_id, relay.addrs()))
                assert [(await reserve(p, relay.peer_id, [p.get_id()]))[0] for p in peers] == [
                    StatusCode.OK,
                    StatusCode.OK,
                    StatusCode.RESOURCE_LIMIT_EXCEEDED,
                ]
                assert relay.reach.status()["relay_service"]["reservations_refused"] == 1
                await peers[0].disconnect(relay.peer_id)
                await wait_until(
                    lambda: peers[0].get_id() not in relay.host.get_connected_peers(), 20, what="the relay to see it"
                )
                assert await reserve(peers[2], relay.peer_id, [None]) == [StatusCode.OK]


# -- AutoNAT dial-backs ----------------------------------------------------------------------------------------------


async def ask_dial_back(host, server: ID, claimed: bytes, addrs: list[bytes]) -> Message:
    """One AutoNAT DIAL request from ``host`` naming ``claimed`` as the peer to dial back, and the server's reply."""
    request = Message()
    request.type = Message.DIAL
    request.dial.peer.id = claimed
    request.dial.peer.addrs.extend(addrs)
    stream = await host.new_stream(server, [AUTONAT_PROTOCOL_ID])
    try:
        await stream.write(encode_varint_prefixed(request.SerializeToString()))
        reply = Message()
        reply.ParseFromString(await read_varint_prefixed_bytes_limited(stream, 1 << 16))
        return reply
    finally:
        with suppress(Exception):
            await stream.close()


@asynccontextmanager
async def silent_ports(n: int) -> AsyncIterator[tuple[list[int], list[int]]]:
    """``n`` TCP ports on 127.0.0.1 that accept connections and never answer (a dial's Noise handshake waits there
    until its timeout), and a one-item list counting the connections they accepted."""
    accepted = [0]

    async def hold(stream: trio.SocketStream) -> None:
        accepted[0] += 1
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        listeners = [(await trio.open_tcp_listeners(0, host="127.0.0.1"))[0] for _ in range(n)]
        for listener in listeners:
            nursery.start_soon(trio.serve_listeners, hold, [listener])
        yield [listener.socket.getsockname()[1] for listener in listeners], accepted
        nursery.cancel_scope.cancel()


def dial_request(ports: list[int], ip: str = "127.0.0.1") -> list[bytes]:
    return [multiaddr.Multiaddr(f"/ip4/{ip}/tcp/{port}").to_bytes() for port in ports]


async def test_stock_autonat_dials_back_any_peer_id_a_request_names():
    """py-libp2p's AutoNAT server dials the peer id the request names, not the requester's, and admits every
    request: one peer naming 5 made-up ids gets 5 dial-backs. ``DialBack`` answers each with E_BAD_REQUEST."""
    dialed: list[ID] = []

    async def fake_dial(peer_id: ID, addrs: list[bytes]) -> bytes | None:
        dialed.append(peer_id)
        return None

    server, attacker = build_host(create_new_key_pair()), build_host(create_new_key_pair())
    ids = [made_up() for _ in range(5)]
    with trio.fail_after(60 * slowdown()):
        async with server.run([LOOP]), attacker.run([]):
            await attacker.connect(info(server))
            stock = AutoNATService(server, serve=True)
            stock._try_dial = fake_dial  # type: ignore[method-assign]
            for peer in ids:
                reply = await ask_dial_back(attacker, server.get_id(), peer.to_bytes(), dial_request([4001]))
                assert reply.dialResponse.status == Message.E_DIAL_ERROR
            assert dialed == ids  # dialed back peers that never asked, as often as anyone liked

            dialed.clear()
            ours = DialBack(server, every=5.0, timeout=5.0)
            ours._try_dial = fake_dial  # type: ignore[method-assign]
            server.set_stream_handler(AUTONAT_PROTOCOL_ID, ours.handle_stream)
            for peer in ids:
                reply = await ask_dial_back(attacker, server.get_id(), peer.to_bytes(), dial_request([4001]))
                assert reply.dialResponse.status == Message.E_BAD_REQUEST
                assert "peer id mismatch" in reply.dialResponse.statusText
            assert dialed == []


async def test_made_up_requester_ids_cost_the_node_nothing_and_honest_dial_backs_are_answered():
    """Issue 26, 1(c): one identity sends 16 dial-back requests naming made-up peer ids, and 16 naming itself with
    another IP's addresses, all at ports that accept and never answer. The node dials nothing for the first, one
    request's addresses (at most 4, at the IP the requests came from) for the second, and an honest peer asking
    meanwhile is dialed back at once. On the old code the node dialed 4 silent ports per made-up id, queued behind
    4 slots, and the honest request waited over a minute."""
    attacker, honest = build_host(create_new_key_pair()), build_host(create_new_key_pair())
    dialed: list[str] = []
    replies: list[int] = []
    with trio.fail_after(120 * slowdown()):
        async with open_swarm(create_new_key_pair(), LOOP, reach=ReachOptions(swarm_name="t")) as server:
            network = server.host.get_network()
            stock_dial = network.dial_addr

            async def recording_dial(addr: multiaddr.Multiaddr, peer_id: ID):
                dialed.append(str(addr))
                return await stock_dial(addr, peer_id)

            network.dial_addr = recording_dial  # type: ignore[method-assign]
            async with attacker.run([]), honest.run([LOOP]), silent_ports(4) as (ports, accepted):
                await attacker.connect(PeerInfo(server.peer_id, server.addrs()))
                await honest.connect(PeerInfo(server.peer_id, server.addrs()))

                async def ask(claimed: bytes, addrs: list[bytes]) -> None:
                    with suppress(Exception):
                        replies.append(
                            (await ask_dial_back(attacker, server.peer_id, claimed, addrs)).dialResponse.status
                        )

                async def attack() -> None:
                    """16 requests at once naming made-up ids, then 16 naming the attacker with another IP's
                    addresses (a batch at a time: of 32 streams opened at once, 16 stalled here)."""
                    for claimed, addrs in (
                        (None, dial_request(ports)),
                        (attacker.get_id().to_bytes(), dial_request(ports, "10.9.8.7")),
                    ):
                        async with trio.open_nursery() as batch:
                            for _ in range(16):
                                batch.start_soon(ask, claimed or made_up().to_bytes(), addrs)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(attack)
                    await trio.sleep(0.5)  # the attack's requests are in (or would be queued) before the honest one
                    started = trio.current_time()
                    with trio.move_on_after(10 * slowdown()) as waited:
                        own = [a.to_bytes() for a in honest.get_addrs()]
                        reply = await ask_dial_back(honest, server.peer_id, honest.get_id().to_bytes(), own)
                    took = trio.current_time() - started
                    assert not waited.cancelled_caught, f"no answer to an honest dial-back in {took:.0f} s"
                    assert reply.dialResponse.status == Message.OK, reply
                    await wait_until(lambda: len(replies) >= 31, 20, what="every refused request to be answered")
                    nursery.cancel_scope.cancel()
                attack_dials = [a for a in dialed if any(a.endswith(f"/tcp/{p}") for p in ports)]
                assert len(attack_dials) <= 4 and accepted[0] <= 4, (attack_dials, accepted)
                assert all(a.startswith("/ip4/127.0.0.1/") for a in dialed), dialed


async def test_identities_at_one_ip_get_a_bounded_share_of_dial_backs_and_prompt_refusals():
    """Sybils: 10 identities at one IP, each asking at once to be dialed back at 4 silent ports. The node takes 2
    of the requests (``DIAL_BACKS_PER_IP``), so dials at most their 8 addresses, and refuses the other 8 at once,
    saying why. On the old code all 10 queued behind its 4 dial slots: 40 dials, nothing refused."""
    sybils = [build_host(create_new_key_pair()) for _ in range(10)]
    refusals: list[str] = []
    with trio.fail_after(120 * slowdown()):
        async with open_swarm(create_new_key_pair(), LOOP, reach=ReachOptions(swarm_name="t")) as server:
            async with AsyncExitStack() as stack:
                for sybil in sybils:
                    await stack.enter_async_context(sybil.run([]))
                ports, accepted = await stack.enter_async_context(silent_ports(4))
                for sybil in sybils:
                    await sybil.connect(PeerInfo(server.peer_id, server.addrs()))

                async def ask(sybil) -> None:
                    reply = await ask_dial_back(sybil, server.peer_id, sybil.get_id().to_bytes(), dial_request(ports))
                    if reply.dialResponse.status == Message.E_DIAL_REFUSED:
                        refusals.append(reply.dialResponse.statusText)

                async with trio.open_nursery() as nursery:
                    for sybil in sybils:
                        nursery.start_soon(ask, sybil)
                    await wait_until(lambda: len(refusals) >= 8, 8, what="8 requests refused at once")
                    nursery.cancel_scope.cancel()
                assert all("your IP" in text for text in refusals), refusals
                assert accepted[0] <= 8, accepted
