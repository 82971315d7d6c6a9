"""Discovery through the Kad-DHT: roles provide swarm-scoped keys; peers find each other with find_providers.

DHT keys. A role has a readable key, ``/swarmrl/<swarm>/<role>`` (``role_key``, used in logs), and a DHT key
derived from it (``role_cid``, ``dht_key``): the CIDv1 of the readable key's UTF-8 bytes, raw codec, sha256::

    multihash = 0x12 0x20 || sha256(utf8("/swarmrl/<swarm>/<role>"))     # sha2-256, 32-byte digest
    cid       = varint(1) || varint(0x55) || multihash                   # CIDv1, raw codec: 0x01 0x55 ...
    text      = "b" + base32(cid)                                        # RFC 4648 alphabet, lowercase, no padding

e.g. ``/swarmrl/test/trainer`` -> ``bafkreigc2gtfxkff24ufrfysbpkazzp2wev7d5fryk4flvi3tv3g2uloey``.

The text form is what goes to py-libp2p's ``dht.provide``/``dht.find_providers``: its ``_encode_key`` parses
the CID and puts only the multihash (``0x12 0x20`` + digest) on the wire, which is how provider records are
keyed in the libp2p Kad-DHT. Other implementations (js-libp2p, go-libp2p) decode that key as a CID and refuse
anything else, so a raw string key (what swarmrl used before) is stored only by Python peers. Peers running the
older scheme do not find records of this one, and the other way round.
"""

from __future__ import annotations

import base64
import hashlib
import logging
from typing import Protocol

import trio
from libp2p.abc import IHost
from libp2p.kad_dht.kad_dht import KadDHT
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from node.libp2p import providers_from_peer

log = logging.getLogger(__name__)

CID_VERSION = 1
RAW_CODEC = 0x55
SHA2_256 = 0x12


class DhtNode(Protocol):
    """What discovery needs of a node (node/host.py's Swarm): a protocol, so that this module, which reachability
    uses, does not import the host module that uses reachability."""

    host: IHost
    dht: KadDHT

    @property
    def peer_id(self) -> ID: ...

    @property
    def trusted(self) -> frozenset[ID]: ...


def role_key(swarm_name: str, role: str) -> str:
    """The readable key of a role in a swarm (for logs); ``dht_key`` turns it into what the DHT stores."""
    return f"/swarmrl/{swarm_name}/{role}"


def _varint(n: int) -> bytes:
    """Unsigned LEB128, as multiformats uses it."""
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def cid_bytes(data: bytes) -> bytes:
    """Binary CIDv1 (raw codec, sha2-256 multihash) of ``data``."""
    digest = hashlib.sha256(data).digest()
    multihash = _varint(SHA2_256) + _varint(len(digest)) + digest
    return _varint(CID_VERSION) + _varint(RAW_CODEC) + multihash


def dht_key(key: str) -> str:
    """The DHT key for a readable key such as ``role_key(...)``: its CIDv1 as a base32 multibase string."""
    return "b" + base64.b32encode(cid_bytes(key.encode("utf-8"))).decode("ascii").lower().rstrip("=")


def role_cid(swarm_name: str, role: str) -> str:
    """The DHT key (CID string) under which ``role`` in ``swarm_name`` is provided."""
    return dht_key(role_key(swarm_name, role))


async def provide_forever(swarm: DhtNode, key: str, interval: float) -> None:
    """Re-provide the readable role key ``key`` (stored under ``dht_key(key)``) on an interval, faster until the
    first announcement reached some peer."""
    cid = dht_key(key)
    while True:
        try:
            ok = await swarm.dht.provide(cid)
        except Exception as exc:
            log.debug("provide %s (%s) failed: %s", key, cid, exc)
            ok = False
        await trio.sleep(interval if ok else min(interval, 2.0))


async def _ask_trusted(swarm: DhtNode, cid: str) -> list[PeerInfo]:
    """Providers as the connected bootstrap peers / trainer know them. py-libp2p's find_providers answers from the
    local store alone once it holds any record, and a node behind a NAT receives records only from the peers it
    is connected to: without this, NATed peers never learn of each other (node/reachability.py)."""
    out: list[PeerInfo] = []
    connected = set(swarm.host.get_connected_peers())
    for peer in [p for p in swarm.trusted if p in connected][:2]:
        with trio.move_on_after(5.0):
            try:
                out += await providers_from_peer(swarm.dht, peer, cid)
            except Exception as exc:
                log.debug("providers of %s from %s: %s", cid, peer, exc)
    return out


async def find_role(swarm: DhtNode, key: str, timeout: float = 10.0) -> list[PeerInfo]:
    """Providers of the readable role key ``key`` (looked up as ``dht_key(key)``) other than ourselves, one entry
    per peer (the DHT may repeat them)."""
    cid = dht_key(key)
    with trio.move_on_after(timeout):
        try:
            found = await swarm.dht.find_providers(cid)
        except Exception as exc:
            log.info("find_providers %s (%s) failed: %s", key, cid, exc)
            return []
        found = list(found) + await _ask_trusted(swarm, cid)
        unique: dict[str, PeerInfo] = {}
        for info in found:
            if info.peer_id != swarm.peer_id:
                unique.setdefault(str(info.peer_id), info)
        return list(unique.values())
    return []
