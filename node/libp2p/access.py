"""Reads of py-libp2p 0.8.1 internals that have no public API, each behind a function named for what it gives.

Listed in ``patches.INTERNALS``: an upgrade checks these names still exist and mean the same.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio
import varint
from google.protobuf.message import DecodeError
from libp2p.abc import IHost, INetStream
from libp2p.exceptions import ParseError
from libp2p.io.exceptions import IncompleteReadError, MessageTooLarge
from libp2p.kad_dht.common import MAX_DHT_MESSAGE_SIZE, PROTOCOL_ID
from libp2p.kad_dht.kad_dht import KadDHT, _encode_key
from libp2p.kad_dht.pb.kademlia_pb2 import Message
from libp2p.kad_dht.utils import maybe_consume_signed_record
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.peer.peerstore import env_to_send_in_RPC
from libp2p.utils.varint import read_varint_prefixed_bytes_limited
from multiaddr import Multiaddr

from node import rpc  # (a module, not its names: node.rpc imports this package first)
from protocols.errors import PeerClosed, ProtocolError


def inbound_stream_entry(host: IHost) -> Callable[[INetStream], Awaitable[None]]:
    """The host's own handler for every inbound stream (protocol negotiation, then the protocol's handler), to wrap
    with a gate: ``network.set_stream_handler`` replaces it, and the host offers no public way to call it."""
    return host._swarm_stream_handler  # type: ignore[attr-defined]


async def _kad_request(host: IHost, peer: ID, message: Message, answered: bool) -> Message | None:
    """One DHT message to ``peer`` on a stream negotiated lazily (node/rpc.py ``open_stream``: the multistream
    header, the protocol and the message leave together), and its answer when ``answered``. py-libp2p's
    ``new_stream`` waits for each echo in turn: two round trips first, each costing the loop lag of both ends
    several times over, under its own fixed 10 s; and its provider request answered "no providers" when the stream
    failed, which counted as an answer and sent the asker walking the DHT. At 256 samplers on one box the trusted
    peers served 2-3x more lookups this way, with a third to a fifth of the streams wasted (docs/capacity.md).
    Failures raise here (StreamFailure: the peer does not speak the DHT; PeerClosed: it reset or ended the stream
    unanswered; ProtocolError: its answer does not parse)."""
    body = message.SerializeToString()
    stream = await rpc.open_stream(host, peer, PROTOCOL_ID, first=varint.encode(len(body)) + body)
    try:
        if not answered:
            return None
        try:
            data = await read_varint_prefixed_bytes_limited(stream, MAX_DHT_MESSAGE_SIZE)
        except (ParseError, IncompleteReadError, MessageTooLarge, *rpc.PEER_GONE) as exc:
            raise PeerClosed(f"{peer}: no DHT answer ({type(exc).__name__}: {exc})") from exc
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(1.0):
            try:
                await stream.close()
            except Exception:
                pass
    reply = Message()
    try:
        reply.ParseFromString(data)
    except DecodeError as exc:
        raise ProtocolError(f"{peer}: a DHT answer that does not parse ({exc})") from exc
    return reply


async def providers_from_peer(dht: KadDHT, peer: ID, cid: str) -> list[PeerInfo]:
    """The providers of ``cid`` that ``peer`` knows, asked directly (patch ``dht-local-providers``:
    ``find_providers`` answers from the local store alone once it holds any record), as upstream's
    ``ProviderStore._get_providers_from_peer_with_closers`` asks and reads them, but on a lazily negotiated stream
    and raising on a failure instead of answering "none" (``_kad_request``)."""
    host = dht.host
    message = Message(type=Message.MessageType.GET_PROVIDERS, key=_encode_key(cid))
    message.senderRecord = env_to_send_in_RPC(host)[0]
    reply = await _kad_request(host, peer, message, answered=True)
    assert reply is not None
    if reply.type != Message.MessageType.GET_PROVIDERS:
        raise ProtocolError(f"{peer} answered a provider request with DHT message type {reply.type}")
    if not maybe_consume_signed_record(reply, host, peer):
        raise ProtocolError(f"{peer} answered with an invalid signed peer record")
    found = []
    for record in reply.providerPeers:
        if not maybe_consume_signed_record(record, host):
            continue  # upstream's rule: a provider whose signed record does not verify is skipped
        addrs = []
        for raw in record.addrs:
            try:
                addrs.append(Multiaddr(raw))
            except Exception:
                continue
        try:
            found.append(PeerInfo(ID(record.id), addrs))
        except Exception:
            continue
    return found


async def provide_to_peer(dht: KadDHT, peer: ID, cid: str) -> bool:
    """Give ``peer`` our provider record for ``cid`` directly (one ADD_PROVIDER, fire-and-forget as upstream's
    ``_send_add_provider`` and Kubo send it), whether or not it is among the key's closest peers: how the trusted
    bootstrap peers come to hold every role's records. On a lazily negotiated stream (``_kad_request``)."""
    host = dht.host
    envelope = env_to_send_in_RPC(host)[0]
    message = Message(type=Message.MessageType.ADD_PROVIDER, key=_encode_key(cid))
    message.senderRecord = envelope
    provider = message.providerPeers.add()
    provider.id = host.get_id().to_bytes()
    provider.addrs.extend(a.to_bytes() for a in host.get_addrs())
    provider.signedRecord = envelope
    await _kad_request(host, peer, message, answered=False)
    return True


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
