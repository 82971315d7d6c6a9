"""py-libp2p's own connection manager is off (issue 29): its dialler connected a node to every peer in its peerstore
up to 200 connections (a clique in any swarm under ~200: bench/swarm_scale), and its cap of 300 connections in all
(and pruner, down to 100 above that) silently overrode ``--max-inbound``: a trainer could not hold 256 samplers."""

from __future__ import annotations

from contextlib import AsyncExitStack

import multiaddr
from libp2p.crypto.ed25519 import create_new_key_pair

from node.connmgr import ConnLimits, total_connections
from node.host import build_host, open_swarm

LISTEN = multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")


def test_the_library_cap_on_connections_follows_max_inbound():
    assert total_connections(ConnLimits(max_inbound=1000)) == 1064
    config = build_host(create_new_key_pair(), limits=ConnLimits(max_inbound=1000)).get_network().connection_config
    assert config.max_connections == 1064
    assert config.high_watermark == 1064  # the library's pruner never acts below the cap


async def test_a_node_does_not_dial_the_peers_its_peerstore_knows_on_its_own():
    async with open_swarm(create_new_key_pair(), LISTEN) as node, AsyncExitStack() as stack:
        others = [build_host(create_new_key_pair()) for _ in range(3)]
        for other in others:
            await stack.enter_async_context(other.run([LISTEN]))
            node.host.get_peerstore().add_addrs(other.get_id(), other.get_addrs(), 3600)
        await node.host.get_network().auto_connector.maybe_connect()  # what its timer and each disconnect call
        assert node.host.get_connected_peers() == []
