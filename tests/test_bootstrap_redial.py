"""When a node dials a lost bootstrap peer again: at once while it has few peers, not while it is settled, and
with backoff when the bootstrap keeps hanging up (a full bootstrap node closes its idlest connections)."""

from __future__ import annotations

import logging
from functools import partial

import trio
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from node.host import (
    BOOTSTRAP_RETRY_SETTLED,
    BOOTSTRAP_STABLE,
    BOOTSTRAP_WELL_CONNECTED,
    bootstrap_redial_wait,
    keep_bootstrap_peers,
    says_outage,
)

BOOT = ID(bytes([1, 1]) * 17)


def test_a_node_with_few_peers_redials_at_once_and_backs_off_when_hung_up_on():
    assert bootstrap_redial_wait(0, 1, 1.0, 60.0) == 1.0
    assert [bootstrap_redial_wait(2, n, 1.0, 60.0) for n in (2, 3, 4)] == [2.0, 4.0, 8.0]
    assert bootstrap_redial_wait(0, 50, 1.0, 60.0) == 60.0


def test_a_settled_node_waits_the_longest_backoff_and_doubles_it():
    settled = BOOTSTRAP_WELL_CONNECTED
    assert [bootstrap_redial_wait(settled, n, 1.0, 60.0) for n in (1, 2, 3)] == [60.0, 120.0, 240.0]
    assert bootstrap_redial_wait(settled, 40, 1.0, 60.0) == BOOTSTRAP_RETRY_SETTLED
    assert bootstrap_redial_wait(settled - 1, 1, 1.0, 60.0) == 1.0
    assert bootstrap_redial_wait(settled, 1, 1.0, 60.0, settles=False) == 1.0  # a bootstrap node wants its siblings


async def test_a_bootstrap_node_redials_a_sibling_at_once_however_many_peers_it_holds(autojump_clock):
    node = Node(BOOTSTRAP_WELL_CONNECTED * 4)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(keep_bootstrap_peers, node, [PeerInfo(BOOT, [])], 1.0, 60.0, settles=False))
        await trio.sleep(BOOTSTRAP_STABLE + 5)
        node.host.connected.remove(BOOT)  # the sibling restarts
        lost = trio.current_time()
        while not node.dials:
            await trio.sleep(0.5)
        assert node.dials[0] - lost <= 2.0
        nursery.cancel_scope.cancel()


class Host:
    def __init__(self) -> None:
        self.connected: list[ID] = []

    def get_connected_peers(self) -> list[ID]:
        return list(self.connected)


class Node:
    """What keep_bootstrap_peers uses of a Swarm: its connected peers and dialling (each dial recorded)."""

    def __init__(self, others: int) -> None:
        self.host = Host()
        self.host.connected = [BOOT, *(ID(bytes([9, i]) * 17) for i in range(others))]
        self.dials: list[float] = []

    async def connect(self, info: PeerInfo, timeout: float = 10.0) -> None:
        self.dials.append(trio.current_time())
        self.host.connected.append(info.peer_id)


async def hang_up_and_time_the_redials(node: Node, times: int, lived: float) -> list[float]:
    """The bootstrap hangs up on ``node`` ``lived`` seconds after each connection: the seconds to each redial."""
    waits = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(keep_bootstrap_peers, node, [PeerInfo(BOOT, [])], 1.0, 60.0)
        for _ in range(times):
            await trio.sleep(lived)
            node.host.connected.remove(BOOT)
            lost, dials = trio.current_time(), len(node.dials)
            while len(node.dials) == dials:
                await trio.sleep(0.5)
            waits.append(node.dials[-1] - lost)
        nursery.cancel_scope.cancel()
    return waits


async def test_a_settled_node_hung_up_on_again_and_again_redials_ever_later(autojump_clock):
    waits = await hang_up_and_time_the_redials(Node(BOOTSTRAP_WELL_CONNECTED), 4, lived=5.0)
    for wait, rule in zip(waits, [60, 120, 240, 480], strict=True):
        assert rule <= wait <= rule + 1.5  # the loss is seen within a poll (1 s)


async def test_a_lone_node_redials_at_once_after_a_connection_that_lived(autojump_clock):
    waits = await hang_up_and_time_the_redials(Node(0), 3, lived=BOOTSTRAP_STABLE + 5)
    assert all(w <= 2.0 for w in waits)  # the bootstrap went down and came back: no backoff carried over


def test_an_outage_is_said_at_its_first_second_fourth_eighth_failure():
    assert [n for n in range(1, 40) if says_outage(n)] == [1, 2, 4, 8, 16, 32]


class Unreachable(Node):
    async def connect(self, info: PeerInfo, timeout: float = 10.0) -> None:
        self.dials.append(trio.current_time())
        raise ConnectionError("refused")


async def test_a_long_outage_is_said_again_with_its_length_and_its_end(autojump_clock, caplog):
    node = Unreachable(0)
    node.host.connected = []
    caplog.set_level(logging.INFO, logger="node.host")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(keep_bootstrap_peers, node, [PeerInfo(BOOT, [])], 1.0, 60.0)
        while len(node.dials) < 9:
            await trio.sleep(1.0)
        node.__class__ = Node  # the bootstrap peer is back
        while BOOT not in node.host.connected:
            await trio.sleep(1.0)
        nursery.cancel_scope.cancel()
    said = [r.getMessage() for r in caplog.records if r.name == "node.host" and "bootstrap peer" in r.getMessage()]
    assert "not reached, trying again" in said[0]
    assert [m.split("after ")[1].split(" tries")[0] for m in said[1:-1]] == ["2", "4", "8"]
    assert "reached after 9 failed tries over" in said[-1]
