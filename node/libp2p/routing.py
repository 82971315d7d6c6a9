"""The routing-table refresh: a round ends at its first walk that no peer answered (issue 29).

py-libp2p 0.8.1's ``PeerRouting.refresh_routing_table`` (run by ``KadDHT._run_main_loop`` when the DHT starts and
every 600 s) walks the DHT for the node's own id and then for a random key in every non-empty bucket. Each walk asks
up to its 20 closest known peers, ten at a time, each under a 10 s deadline. The walks run one after another
whatever came of the one before: when the table's peers cannot be reached in time, every walk of the round asks
much the same unreachable peers again. At N = 256 on this box (bench/swarm_scale --profile, four runs) not one
stream that py-libp2p's own DHT code opened was answered in the profile window, of about 6,500 tried. The refresh
rounds were the largest share, 0.24 cancelled stream opens a second per host. Each had cost a dial or a
negotiation on a loaded peer.

Here a round walks as upstream does (its own id first: that walk keeps the node findable), and it ends after a walk
in which no query was answered (``go_on``). The next round, one interval later, tries again. A healthy table
refreshes exactly as before; an unreachable one costs one walk a round, not one per bucket. At N = 256 (three runs)
the refresh's cancelled opens fell to 0.022-0.025 a second per host, and the swarm accepted 1.47-1.82 groups/s
against 0.79-1.39 in the four runs before (docs/capacity.md). go-libp2p-kad-dht's
refresh manager also skips a bucket that a lookup covered within the interval. That does not carry over here:
py-libp2p walks other lookups under keys that land in no bucket's range.

``refresh_routing_table`` and ``count_answers`` are the ``PeerRouting`` methods that node/libp2p/patches.py
installs. ``count_answers`` wraps the one query of a walk so the refresh can count the answers without changing
the walk.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar

from libp2p.kad_dht.peer_routing import PeerRouting
from libp2p.kad_dht.routing_table import gen_random_key_in_bucket
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

log = logging.getLogger(__name__)

_answers: ContextVar[list[ID] | None] = ContextVar("walk_answers", default=None)  # peers that answered a walk
_stock_query = PeerRouting._query_peer_for_closest


def go_on(answered: int) -> bool:
    """Whether a refresh round walks on after a walk that ``answered`` queries answered."""
    return answered > 0


async def count_answers(self: PeerRouting, peer: ID, target_key: bytes) -> list[ID]:
    """``PeerRouting._query_peer_for_closest``: upstream's query. Inside ``answered_walk`` a query that returned
    peers is counted. Upstream returns ``[]`` for a failure and for a timeout alike; an answer that names no peer
    but the asker teaches the table nothing either, so it counts as none."""
    found = await _stock_query(self, peer, target_key)
    tally = _answers.get()
    if tally is not None and found:
        tally.append(peer)
    return found


async def answered_walk(routing: PeerRouting, key: bytes) -> int:
    """Walk the DHT toward ``key``, add the peers found to the routing table (as upstream's refresh does), and
    return how many queries of the walk were answered."""
    token = _answers.set(tally := [])
    try:
        found = await routing.find_closest_peers_network(key)
    finally:
        _answers.reset(token)
    store = routing.host.get_peerstore()
    for peer in found:
        try:  # the peerstore raises for a peer it does not hold
            if addrs := store.addrs(peer):
                await routing.routing_table.add_peer(PeerInfo(peer, addrs))
        except Exception as exc:  # upstream's refresh logs and goes on too
            log.debug("refresh: adding %s failed: %s", peer, exc)
    return len(tally)


async def refresh_routing_table(self: PeerRouting) -> None:
    """``PeerRouting.refresh_routing_table``: upstream's walks (own id, then a random key per non-empty bucket),
    ending the round at the first walk no peer answered."""
    if not go_on(await answered_walk(self, self.host.get_id().to_bytes())):
        log.debug("routing-table refresh: the walk for our own id was answered by no peer; the round ends")
        return
    # the buckets as the first walk left them (it may have split some), as upstream takes them
    keys = [gen_random_key_in_bucket(b) for b in self.routing_table.buckets if b.size() > 0]
    for i, key in enumerate(keys):
        if not go_on(await answered_walk(self, key)):
            log.debug("routing-table refresh: bucket walk %d of %d answered by none; round ended", i + 1, len(keys))
            return
