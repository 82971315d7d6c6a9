"""Gossipsub for small announcements only ("version V, manifest M, and I hold it"); bulk bytes go direct.

py-libp2p's gossipsub heartbeat defaults to 120 s; it is set to 1 s here so meshes form quickly.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11, GossipSub
from libp2p.pubsub.pubsub import Pubsub
from libp2p.tools.anyio_service import background_trio_service

from protocols import weights as w
from protocols.errors import ProtocolError
from protocols.framing import pack, unpack

log = logging.getLogger(__name__)


def announce_topic(swarm_name: str) -> str:
    return f"/swarmrl/{swarm_name}/weights/announce"


class Gossip:
    def __init__(self, pubsub: Pubsub) -> None:
        self.pubsub = pubsub
        self.delivered = 0  # messages handed to our handlers (after gossipsub's dedup): what the swarm's size costs

    async def publish(self, topic: str, message: dict[str, Any]) -> None:
        data = pack(message)
        if len(data) > w.GOSSIP_MAX:
            raise ValueError("gossip messages must stay small; move bulk data over a direct stream")
        await self.pubsub.publish(topic, data)

    async def listen(self, topic: str, handler: Callable[[ID, dict[str, Any]], Awaitable[None]]) -> None:
        """Feed every valid message on ``topic`` to ``handler(sender, message)``; bad ones are logged and dropped."""
        sub = await self.pubsub.subscribe(topic)
        while True:
            msg = await sub.get()
            self.delivered += 1
            try:
                sender = ID(msg.from_id)
                await handler(sender, unpack(msg.data, w.GOSSIP_MAX))
            except ProtocolError as exc:
                log.info("dropped a bad gossip message on %s: %s", topic, exc)
            except Exception as exc:
                log.warning("gossip handler failed on %s: %s: %s", topic, type(exc).__name__, exc)


@asynccontextmanager
async def open_gossip(host: IHost) -> AsyncIterator[Gossip]:
    router = GossipSub(
        protocols=[PROTOCOL_ID_V11],
        degree=4,
        degree_low=2,
        degree_high=8,
        heartbeat_interval=1,
        min_mesh_diversity_ips=0,
    )
    pubsub = Pubsub(host, router)
    async with background_trio_service(pubsub), background_trio_service(router):
        await pubsub.wait_until_ready()
        yield Gossip(pubsub)
        await trio.sleep(0)
