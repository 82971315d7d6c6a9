"""Discovery through the Kad-DHT: roles provide swarm-scoped keys; peers find each other with find_providers."""

from __future__ import annotations

import logging

import trio
from libp2p.peer.peerinfo import PeerInfo

from node.host import Swarm

log = logging.getLogger(__name__)


def role_key(swarm_name: str, role: str) -> str:
    return f"/swarmrl/{swarm_name}/{role}"


async def provide_forever(swarm: Swarm, key: str, interval: float) -> None:
    """Re-provide ``key`` on an interval, faster until the first announcement reached some peer."""
    while True:
        try:
            ok = await swarm.dht.provide(key)
        except Exception as exc:
            log.debug("provide %s failed: %s", key, exc)
            ok = False
        await trio.sleep(interval if ok else min(interval, 2.0))


async def find_role(swarm: Swarm, key: str, timeout: float = 10.0) -> list[PeerInfo]:
    """Providers of ``key`` other than ourselves, one entry per peer (the DHT may repeat them)."""
    with trio.move_on_after(timeout):
        try:
            found = await swarm.dht.find_providers(key)
        except Exception as exc:
            log.info("find_providers %s failed: %s", key, exc)
            return []
        unique: dict[str, PeerInfo] = {}
        for info in found:
            if info.peer_id != swarm.peer_id:
                unique.setdefault(str(info.peer_id), info)
        return list(unique.values())
    return []
