"""Role records at the trusted peers (node/discovery.py): every node gives its provider records to the connected
bootstrap peers first, and a lookup asks them first; the DHT walks only when they have nothing, and a node's first
DHT provide waits its turn when they took its record."""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import multiaddr
import pytest
import trio
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from node import discovery
from protocols.errors import PeerClosed
from tests.helpers import wait_until

ME, BOOT, OTHER_BOOT, TRAINER, STRANGER = (ID(bytes([i]) * 34) for i in range(1, 6))


@dataclass
class FakeDht:
    records: dict[str, list[PeerInfo]] = field(default_factory=dict)  # what the DHT's walk would find
    walks: int = 0
    provides: int = 0
    provide_ok: bool = True  # whether a DHT provide reaches some peer (False: the swarm is too busy to answer)

    async def find_providers(self, cid: str) -> list[PeerInfo]:
        self.walks += 1
        return self.records.get(cid, [])

    async def provide(self, cid: str) -> bool:
        self.provides += 1
        return self.provide_ok


class FakeHost:
    def __init__(self, connected: list[ID]) -> None:
        self.connected = connected

    def get_connected_peers(self) -> list[ID]:
        return self.connected


@dataclass
class FakeNode:
    host: FakeHost
    dht: FakeDht
    trusted: frozenset[ID]
    peer_id: ID = ME


@pytest.fixture(autouse=True)
def no_late_trusted_peers(monkeypatch):
    """Each test starts with no trusted peer known to be late (discovery keeps that per process)."""
    monkeypatch.setattr(discovery, "_clocks", {})


def node(connected: list[ID]) -> FakeNode:
    return FakeNode(FakeHost(connected), FakeDht(), frozenset({BOOT, OTHER_BOOT}))


async def timed_lookup(n: FakeNode, key: str) -> tuple[list[PeerInfo], float]:
    """``find_role``'s answer, and how long it took (trio's clock)."""
    start = trio.current_time()
    found = await discovery.find_role(n, key)
    return found, trio.current_time() - start


async def test_a_lookup_takes_the_trusted_peers_answer_without_walking_the_dht(monkeypatch):
    held = {BOOT: [PeerInfo(TRAINER, []), PeerInfo(ME, [])]}
    asked: list[ID] = []

    async def providers_from_peer(dht, peer, cid):
        asked.append(peer)
        return held.get(peer, [])

    monkeypatch.setattr(discovery, "providers_from_peer", providers_from_peer)
    n = node([BOOT, STRANGER])  # the other bootstrap peer is not connected: not asked
    found = await discovery.find_role(n, discovery.role_key("s", "trainer"))
    assert [i.peer_id for i in found] == [TRAINER]  # ourselves left out
    assert asked == [BOOT] and n.dht.walks == 0


async def test_the_dht_walks_when_the_trusted_peers_know_nothing(monkeypatch):
    async def providers_from_peer(dht, peer, cid):
        return []

    monkeypatch.setattr(discovery, "providers_from_peer", providers_from_peer)
    n = node([BOOT])
    key = discovery.role_key("s", "trainer")
    n.dht.records[discovery.dht_key(key)] = [PeerInfo(TRAINER, [])]
    found = await discovery.find_role(n, key)
    assert [i.peer_id for i in found] == [TRAINER] and n.dht.walks == 1


async def test_a_trusted_peer_too_slow_to_answer_is_busy_not_empty_the_dht_is_not_walked(monkeypatch, autojump_clock):
    async def providers_from_peer(dht, peer, cid):
        await trio.sleep_forever()

    monkeypatch.setattr(discovery, "providers_from_peer", providers_from_peer)
    n = node([BOOT, OTHER_BOOT])
    key = discovery.role_key("s", "trainer")
    n.dht.records[discovery.dht_key(key)] = [PeerInfo(TRAINER, [])]
    assert await timed_lookup(n, key) == ([], discovery.TRUSTED_TIMEOUT)  # both asked at once, one bound
    assert n.dht.walks == 0


async def test_a_trusted_peer_whose_request_failed_did_not_answer_the_dht_is_not_walked(monkeypatch):
    """py-libp2p's provider request answered "no providers" when its stream failed (its own 10 s negotiation on a
    loaded node, a reset): that counted as an answer, and every failed lookup walked the DHT, at N = 256 on one box
    0.4 DHT stream opens a second per host, nearly all cancelled. A failure now raises: not an answer, no walk."""

    async def providers_from_peer(dht, peer, cid):
        raise PeerClosed("no DHT answer")

    monkeypatch.setattr(discovery, "providers_from_peer", providers_from_peer)
    n = node([BOOT, OTHER_BOOT])
    key = discovery.role_key("s", "trainer")
    n.dht.records[discovery.dht_key(key)] = [PeerInfo(TRAINER, [])]
    assert await discovery.find_role(n, key) == []
    assert n.dht.walks == 0


async def test_a_late_trusted_peer_gets_twice_the_time_at_each_call_and_then_as_long_as_its_answers_take(
    monkeypatch, autojump_clock
):
    """A fixed 10 s abandoned every answer of an overloaded bootstrap node, and asked again: at N = 256 on one box
    the samplers still searching timed out on 115 of 121 calls in a minute. The bound doubles while the peer is
    late (up to TRUSTED_TIMEOUT_MOST); once it answers, the bound is how long its answers take (SRTT + 4 RTTVAR),
    not 10 s again: answers took 10-30 s at N = 256, and a bound reset to 10 s lost the next two calls."""
    answers_after = {"seconds": float("inf")}

    async def providers_from_peer(dht, peer, cid):
        await trio.sleep(answers_after["seconds"])
        return [PeerInfo(TRAINER, [])]

    monkeypatch.setattr(discovery, "providers_from_peer", providers_from_peer)
    n = node([BOOT])
    key = discovery.role_key("s", "trainer")
    assert [await timed_lookup(n, key) for _ in range(5)] == [([], t) for t in (10.0, 20.0, 40.0, 80.0, 80.0)]
    answers_after["seconds"] = 50.0  # it answers within its bound now
    assert [i.peer_id for i in await discovery.find_role(n, key)] == [TRAINER]
    answers_after["seconds"] = float("inf")
    assert await timed_lookup(n, key) == ([], 80.0)  # its answers take 50 s: SRTT + 4 RTTVAR = 150 s, capped
    answers_after["seconds"] = 0.5  # it answers fast again: the bound comes down to the floor
    for _ in range(29):
        assert [i.peer_id for i in await discovery.find_role(n, key)] == [TRAINER]
    answers_after["seconds"] = float("inf")
    assert await timed_lookup(n, key) == ([], discovery.TRUSTED_TIMEOUT)


async def test_a_record_given_at_once_does_not_reset_a_late_peers_lookup_backoff(monkeypatch, autojump_clock):
    """Giving a record is fire-and-forget and done at once; it says nothing of how long an answer takes. At N = 256
    on one box each provide reset the lookups' backoff, so every lookup ran out at 10 s (bench/swarm_scale
    --profile: 21-37 trusted answers a process-minute cancelled, 0-3 answered) and late joiners found no sampler."""

    async def providers_from_peer(dht, peer, cid):
        await trio.sleep_forever()

    async def provide_to_peer(dht, peer, cid):
        return True

    monkeypatch.setattr(discovery, "providers_from_peer", providers_from_peer)
    monkeypatch.setattr(discovery, "provide_to_peer", provide_to_peer)
    n = node([BOOT])
    key = discovery.role_key("s", "sampler")
    took = []
    for _ in range(3):
        took.append((await timed_lookup(n, key))[1])
        assert await discovery._provide_to_trusted(n, discovery.dht_key(key)) == 1  # taken at once
    assert took == [10.0, 20.0, 40.0]


async def test_with_no_trusted_peer_connected_the_dht_is_walked(monkeypatch):
    async def providers_from_peer(dht, peer, cid):
        raise AssertionError("no trusted peer is connected: none is asked")

    monkeypatch.setattr(discovery, "providers_from_peer", providers_from_peer)
    n = node([STRANGER])
    key = discovery.role_key("s", "trainer")
    n.dht.records[discovery.dht_key(key)] = [PeerInfo(TRAINER, [])]
    assert [i.peer_id for i in await discovery.find_role(n, key)] == [TRAINER] and n.dht.walks == 1


def test_the_dht_is_walked_unless_the_trusted_peers_found_it_or_were_all_too_slow():
    assert discovery.walk_after_trusted(asked=0, answered=0, found=False)  # none connected
    assert discovery.walk_after_trusted(asked=2, answered=1, found=False)  # one answered: it holds nothing
    assert not discovery.walk_after_trusted(asked=2, answered=1, found=True)
    assert not discovery.walk_after_trusted(asked=2, answered=0, found=False)  # both busy: look again later


async def test_providing_gives_the_record_to_the_trusted_peers_at_once_and_to_the_dht_later(
    monkeypatch, autojump_clock
):
    given: list[tuple[float, ID]] = []

    async def provide_to_peer(dht, peer, cid):
        given.append((trio.current_time(), peer))
        return True

    monkeypatch.setattr(discovery, "provide_to_peer", provide_to_peer)
    n = node([BOOT, OTHER_BOOT, STRANGER])
    key = discovery.role_key("s", "sampler")
    first = discovery.first_dht_provide(2, 30.0, discovery.spread_point(ME, discovery.dht_key(key)))
    assert 0.0 < first < discovery.PROVIDE_SPREAD * 30.0
    start = trio.current_time()
    with trio.move_on_after(first - 0.1):
        await discovery.provide_forever(n, key, 30.0)
    assert sorted(map(str, (p for _, p in given))) == sorted(map(str, [BOOT, OTHER_BOOT]))
    assert all(t == start for t, _ in given) and n.dht.provides == 0  # the trusted peers now, the DHT not yet
    with trio.move_on_after(first + 0.1):
        await discovery.provide_forever(n, key, 30.0)
    assert n.dht.provides == 1


async def test_a_node_no_trusted_peer_took_provides_to_the_dht_at_once(monkeypatch, autojump_clock):
    async def provide_to_peer(dht, peer, cid):
        return False

    monkeypatch.setattr(discovery, "provide_to_peer", provide_to_peer)
    n = node([BOOT, STRANGER])
    with trio.move_on_after(0.1):
        await discovery.provide_forever(n, discovery.role_key("s", "sampler"), 30.0)
    assert n.dht.provides == 1


@pytest.mark.parametrize("trusted_take_it", [True, False])
async def test_a_failing_dht_provide_is_retried_far_less_often_while_the_trusted_peers_hold_the_record(
    monkeypatch, autojump_clock, trusted_take_it
):
    async def provide_to_peer(dht, peer, cid):
        return trusted_take_it

    monkeypatch.setattr(discovery, "provide_to_peer", provide_to_peer)
    n = node([BOOT, OTHER_BOOT])
    n.dht.provide_ok = False
    with trio.move_on_after(1800.0):
        await discovery.provide_forever(n, discovery.role_key("s", "sampler"), 30.0)
    if trusted_take_it:  # 2, 4, 8 ... 512 s, then every 10 min (jittered)
        assert 9 <= n.dht.provides <= 13
    else:  # the DHT is how it is found: every 30 s once the retries reach the interval
        assert n.dht.provides >= 50


def test_first_dht_provides_spread_over_the_window_when_a_trusted_peer_holds_the_record():
    assert discovery.first_dht_provide(0, 30.0, 0.7) == 0.0
    assert discovery.first_dht_provide(1, 30.0, 0.5) == discovery.PROVIDE_SPREAD * 30.0 * 0.5
    key = discovery.dht_key(discovery.role_key("s", "sampler"))
    points = [discovery.spread_point(ID(bytes([7, i]) * 17), key) for i in range(200)]
    assert all(0.0 <= p < 1.0 for p in points)
    assert sum(p < 0.5 for p in points) in range(70, 131)  # spread, not bunched
    assert discovery.spread_point(ID(bytes([7, 1]) * 17), key) == points[1]  # fixed per node and key


@asynccontextmanager
async def dht_server_and_client(tmp_path):
    """Two real hosts on loopback, connected: the server provides the trainer's key (``cid``) in its DHT."""
    import multiaddr
    from libp2p.peer.peerinfo import info_from_p2p_addr

    from node import host as node_host
    from node.identity import load_or_create_key

    loopback = multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")
    async with (
        node_host.open_swarm(load_or_create_key(tmp_path / "server.key"), loopback) as server,
        node_host.open_swarm(load_or_create_key(tmp_path / "client.key"), loopback) as client,
    ):
        cid = discovery.dht_key(discovery.role_key("s", "trainer"))
        await server.dht.provide(cid)
        await client.connect(info_from_p2p_addr(server.addrs()[0]))
        yield server, client, cid


async def test_dht_streams_without_a_request_hold_no_slot_and_are_reset_after_their_bound(tmp_path, monkeypatch):
    """py-libp2p resets every inbound DHT stream past 12 at once, and its handler takes a slot when a stream opens
    and waits for the request without a deadline: 16 streams opened and left idle made the node refuse every
    lookup. At 256 samplers, streams whose lagging askers had not yet written their request held a bootstrap
    node's 64 slots. A stream now takes a slot only once its request has arrived, and one with no request is reset
    after DHT_STREAM_SECONDS."""
    from libp2p.custom_types import TProtocol

    from node import host as node_host
    from node.libp2p import dht_slots, providers_from_peer

    monkeypatch.setattr(node_host, "DHT_HANDLERS", 4)
    monkeypatch.setattr(node_host, "DHT_STREAM_SECONDS", 1.0)
    async with dht_server_and_client(tmp_path) as (server, client, cid):
        held = [await client.host.new_stream(server.peer_id, [TProtocol("/ipfs/kad/1.0.0")]) for _ in range(16)]
        slots = dht_slots(server.dht)
        with trio.fail_after(10):
            found = await providers_from_peer(client.dht, server.peer_id, cid)
        assert [i.peer_id for i in found] == [server.peer_id]  # answered, not reset
        assert server.status()["dht_streams"]["refused"] == 0  # sixteen idle streams took none of the four slots
        for stream in held:
            with trio.fail_after(5):
                try:
                    await stream.read(1)
                except Exception:
                    continue  # reset by the server
                raise AssertionError("an idle DHT stream was served past its bound")
        await wait_until(lambda: server.status()["dht_streams"]["cut"] == 16, 5, 0.05, what="every idle stream cut")
        assert server.status()["dht_streams"]["served"] >= 1
        assert slots.borrowed_tokens == 0


async def test_a_request_that_finds_every_dht_slot_taken_is_refused_and_counted(tmp_path, monkeypatch):
    """The slots bound the requests handled at once; one past them is reset (py-libp2p's rule) and the node's
    status counts it, so a saturated bootstrap node shows."""
    from node import host as node_host
    from node.libp2p import dht_slots, providers_from_peer

    monkeypatch.setattr(node_host, "DHT_HANDLERS", 2)
    async with dht_server_and_client(tmp_path) as (server, client, cid):
        slots = dht_slots(server.dht)
        busy = [object(), object()]
        for borrower in busy:  # two requests in progress
            slots.acquire_on_behalf_of_nowait(borrower)
        with pytest.raises(PeerClosed):  # reset: the asker knows it learned nothing (not "no providers")
            await providers_from_peer(client.dht, server.peer_id, cid)
        assert server.status()["dht_streams"]["refused"] == 1
        for borrower in busy:
            slots.release_on_behalf_of(borrower)
        found = await providers_from_peer(client.dht, server.peer_id, cid)
        assert [i.peer_id for i in found] == [server.peer_id]


async def test_an_answered_dht_stream_left_open_is_closed_and_frees_its_slot(tmp_path, monkeypatch):
    """A lagging asker reads its answer seconds before it closes its stream; py-libp2p's handler held the slot
    until then, and at 256 samplers a bootstrap node's slots were all held so. Now the node closes an answered
    stream DHT_IDLE_SECONDS after its answer: the slot frees, the asker reads a clean end, not a reset."""
    import varint
    from libp2p.custom_types import TProtocol
    from libp2p.kad_dht.pb.kademlia_pb2 import Message
    from libp2p.network.stream.exceptions import StreamEOF

    from node import host as node_host
    from node.libp2p import dht_slots

    monkeypatch.setattr(node_host, "DHT_HANDLERS", 2)
    async with dht_server_and_client(tmp_path) as (server, client, cid):
        request = Message(type=Message.MessageType.GET_PROVIDERS, key=cid.encode()).SerializeToString()
        streams = []
        for _ in range(2):  # every slot, each answered and left open by its asker
            stream = await client.host.new_stream(server.peer_id, [TProtocol("/ipfs/kad/1.0.0")])
            await stream.write(varint.encode(len(request)) + request)
            streams.append(stream)
        slots = dht_slots(server.dht)
        for stream in streams:
            with trio.fail_after(10):
                answer = Message()
                answer.ParseFromString(await read_varint_prefixed(stream))
            assert answer.type == Message.MessageType.GET_PROVIDERS
        await wait_until(lambda: slots.borrowed_tokens == 0, 10, 0.05, what="the answered streams' slots freed")
        assert server.status()["dht_streams"]["idle"] == 2
        assert server.status()["dht_streams"]["cut"] == 0  # closed, not held to the 10 s bound
        for stream in streams:
            with trio.fail_after(5), pytest.raises(StreamEOF):  # a clean end (a reset raises StreamReset)
                await stream.read(1)
            await stream.close()


async def read_varint_prefixed(stream) -> bytes:
    """One varint-length-prefixed message read from ``stream``."""
    length, shift = 0, 0
    while True:
        byte = (await stream.read(1))[0]
        length |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            break
    data = b""
    while len(data) < length:
        data += await stream.read(length - len(data))
    return data


async def test_the_trainer_is_found_while_dials_to_samplers_hang(monkeypatch, autojump_clock):
    """The mesh's dials (24 samplers, 10 s each) ran before the next look for the trainer in one loop; the trainer
    is now looked for in a task of its own."""
    samplers = [PeerInfo(ID(bytes([9, i]) * 17), []) for i in range(24)]
    trainer_addr = multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/4001")
    trainer_looks = []

    async def providers_from_peer(dht, peer, cid):
        if cid == discovery.dht_key(discovery.role_key("s", "trainer")):
            trainer_looks.append(trio.current_time())
            return [PeerInfo(TRAINER, [trainer_addr])] if len(trainer_looks) > 1 else []  # not there yet at first
        return samplers

    class Network:
        def register_notifee(self, notifee):
            pass

    class DialingHost(FakeHost):
        def get_network(self):
            return Network()

    @dataclass
    class Node(FakeNode):
        async def connect(self, info: PeerInfo, timeout: float = 10.0) -> None:
            if info.peer_id != TRAINER:
                await trio.sleep_forever()  # a sampler that never answers
            self.host.connected.append(TRAINER)

    monkeypatch.setattr(discovery, "providers_from_peer", providers_from_peer)
    n = Node(DialingHost([BOOT]), FakeDht(), frozenset({BOOT}))
    d = discovery.SamplerDiscovery("s", TRAINER, 2.0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(d.run, n)
        with trio.fail_after(5.0):  # the dials hang forever
            await d.trainer_found.wait()
        nursery.cancel_scope.cancel()
    assert d.trainer_found_by["dht"] == 1 and d.trainer_addrs == [trainer_addr] and len(trainer_looks) == 2


async def test_a_dht_answer_that_does_not_parse_is_a_clear_error_not_an_empty_list(tmp_path):
    """A trusted peer's provider answer is read on a lazily negotiated stream; garbage is refused by name (a
    ProtocolError), not read as "no providers" (a reset is PeerClosed: the refused-request test above)."""
    import varint
    from libp2p.custom_types import TProtocol

    from node.libp2p import providers_from_peer
    from protocols.errors import ProtocolError

    async def garbage(stream):
        await stream.read(4096)
        await stream.write(varint.encode(6) + b"\xff" * 6)
        await stream.close()

    async with dht_server_and_client(tmp_path) as (server, client, cid):
        server.host.set_stream_handler(TProtocol("/ipfs/kad/1.0.0"), garbage)
        with trio.fail_after(10), pytest.raises(ProtocolError, match="does not parse"):
            await providers_from_peer(client.dht, server.peer_id, cid)
