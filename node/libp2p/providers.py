"""Provider records of one key: keep many, prefer the live, answer each lookup with a sample (issue 29).

py-libp2p 0.8.1's provider store keeps at most k = 20 providers per key, first come first kept, for 48 h, and
answers every GET_PROVIDERS with all it holds. For a role key every sampler provides, that made one 20: every
DHT node and the bootstrap node held the first 20 samplers to join, every newcomer learned those 20 and dialled
them (bench/swarm_scale, N = 64: "listed 20" at every lookup), so 20 samplers held a connection from nearly
every other and the rest were never listed; an attacker's 20 identities, first in, would have hidden every honest
provider for two days. Here a node keeps up to ``PROVIDERS_PER_KEY`` records per key; past that a new record
replaces the oldest one whose provider is not connected to us (a connected provider is alive: its record is kept),
and is refused only when every holder is connected. A lookup is answered with at most ``ANSWER_MOST`` records,
the connected providers first, each group in a fresh random order: lookups spread over the live providers.

The rules are pure functions (``make_room``, ``answer_sample``), tested alone; ``add_provider`` and
``get_providers`` are the ``ProviderStore`` methods that node/libp2p/patches.py installs in their place.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, TypeVar

from libp2p.kad_dht.provider_store import PROVIDER_RECORD_EXPIRATION_INTERVAL, ProviderRecord
from libp2p.peer.peerinfo import PeerInfo

PROVIDERS_PER_KEY = 1024  # records kept per key (~0.5 KB each: 0.5 MB for a key every sampler provides)
ANSWER_MOST = 32  # records in one answer (a sampler dials up to 24 others; ~16 KB with their signed records)

K = TypeVar("K")
T = TypeVar("T")


def make_room(held: Mapping[K, float], connected: Collection[K], new: K, most: int) -> tuple[bool, K | None]:
    """(whether ``new``'s record is stored, the provider whose record it replaces, if any). ``held`` maps each
    provider holding a record to the record's time. A provider already held is updated in place; below ``most``
    the record is added; at ``most`` it replaces the oldest record of a provider not ``connected``, and is refused
    when every holder is connected."""
    if new in held or len(held) < most:
        return True, None
    idle = [p for p in held if p not in connected]
    if not idle:
        return False, None
    return True, min(idle, key=lambda p: held[p])


def answer_sample(providers: Sequence[T], is_live: Callable[[T], bool], most: int, rng: random.Random) -> list[T]:
    """At most ``most`` of ``providers``: the live ones first, then the others, each group shuffled."""
    live = [p for p in providers if is_live(p)]
    others = [p for p in providers if not is_live(p)]
    rng.shuffle(live)
    rng.shuffle(others)
    return (live + others)[:most]


_rng = random.Random()


def add_provider(self: Any, key: bytes, provider: PeerInfo) -> None:
    """``ProviderStore.add_provider``: store ``provider``'s record of ``key`` as ``make_room`` says."""
    if not provider or not provider.peer_id:
        return
    records: dict[str, ProviderRecord] = self.providers.setdefault(key, {})
    name = str(provider.peer_id)
    if name not in records and len(records) >= PROVIDERS_PER_KEY:  # full: whom to replace (O(records), rare)
        connected = {str(p) for p in self.host.get_connected_peers()}
        held = {peer: record.timestamp for peer, record in records.items()}
        store, replaced = make_room(held, connected, name, PROVIDERS_PER_KEY)
        if not store:
            return
        if replaced is not None:
            del records[replaced]
    records[name] = ProviderRecord(provider_info=provider, timestamp=time.time())
    self._save()


def get_providers(self: Any, key: bytes) -> list[PeerInfo]:
    """``ProviderStore.get_providers``: the unexpired providers of ``key``, an ``answer_sample`` of them (expired
    records are dropped, as upstream does)."""
    records: dict[str, ProviderRecord] = self.providers.get(key, {})
    now = time.time()
    for peer in [p for p, r in records.items() if now - r.timestamp > PROVIDER_RECORD_EXPIRATION_INTERVAL]:
        del records[peer]
    if not records:
        self.providers.pop(key, None)
        return []
    connected = set(self.host.get_connected_peers())
    infos = [PeerInfo(r.peer_id, r.addresses) for r in records.values()]
    return answer_sample(infos, lambda i: i.peer_id in connected, ANSWER_MOST, _rng)
