"""Reads of py-libp2p 0.8.1 internals that have no public API, each behind a function named for what it gives.

Listed in ``patches.INTERNALS``: an upgrade checks these names still exist and mean the same.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio
from libp2p.abc import IHost, INetStream
from libp2p.kad_dht.kad_dht import KadDHT, _encode_key
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo


def inbound_stream_entry(host: IHost) -> Callable[[INetStream], Awaitable[None]]:
    """The host's own handler for every inbound stream (protocol negotiation, then the protocol's handler), to wrap
    with a gate: ``network.set_stream_handler`` replaces it, and the host offers no public way to call it."""
    return host._swarm_stream_handler  # type: ignore[attr-defined]


async def providers_from_peer(dht: KadDHT, peer: ID, cid: str) -> list[PeerInfo]:
    """The providers of ``cid`` that ``peer`` knows, asked directly (patch ``dht-local-providers``:
    ``find_providers`` answers from the local store alone once it holds any record)."""
    providers, _ = await dht.provider_store._get_providers_from_peer_with_closers(peer, _encode_key(cid))
    return list(providers)


async def provide_to_peer(dht: KadDHT, peer: ID, cid: str) -> bool:
    """Give ``peer`` our provider record for ``cid`` directly (one ADD_PROVIDER), whether or not it is among the
    key's closest peers: how the trusted bootstrap peers come to hold every role's records."""
    return bool(await dht.provider_store._send_add_provider(peer, _encode_key(cid)))


def set_dht_handlers(dht: KadDHT, most: int) -> None:
    """Let ``dht`` answer up to ``most`` inbound requests at once. py-libp2p resets every stream past 12 (a guard
    against floods of Kubo connections) and waits for a stream's request without a deadline: 12 DHT streams opened
    and left idle, by slow peers or one hostile peer, made the node refuse every lookup (tests/test_rendezvous.py).
    A bootstrap node is every newcomer's first DHT peer: a crowd of joiners must not be refused. node/host.py's
    ``bound_dht_streams`` hands a stream to the handler (and its slot) only once a request has arrived, and bounds
    each stream's life; a per-peer cap is not done."""
    dht_slots(dht).total_tokens = most


def dht_slots(dht: KadDHT) -> trio.CapacityLimiter:
    """The limiter whose tokens are ``dht``'s inbound request slots (a stream offered when all are borrowed is
    reset unserved)."""
    return dht._inbound_limiter
