"""Serves what this node's store holds: manifests, chunks and have-bitfields. Every peer re-serves."""

from __future__ import annotations

from typing import Any

import trio
from libp2p.peer.id import ID

from node.weights.store import ChunkStore
from protocols import weights as w
from protocols.errors import ProtocolError


class NotFound(ProtocolError):
    code = "not_found"


class WeightServer:
    def __init__(self, store: ChunkStore) -> None:
        self.store = store
        self.bytes_served = 0
        self.chunks_served = 0

    async def handle(self, message: dict[str, Any], remote: ID) -> dict[str, Any]:
        kind, arg = w.parse_request(message)
        if kind == "get_manifest":
            if arg is None:
                latest = self.store.latest()
                if latest is None:
                    raise NotFound("this peer holds no complete version yet")
                return latest[1].to_wire()
            entry = self.store.manifest(arg)
            if entry is None:
                raise NotFound(f"manifest {arg.hex()[:12]} is not held here")
            return entry[0].to_wire()
        if kind == "get_chunks":
            found, missing = [], []
            for h in arg:
                data = await trio.to_thread.run_sync(self.store.read, h)
                if data is None:
                    missing.append(h)
                else:
                    found.append((h, data))
                    self.bytes_served += len(data)
                    self.chunks_served += 1
            return w.chunks_reply(found, missing)
        entry = self.store.manifest(arg)
        if entry is None:
            raise NotFound(f"manifest {arg.hex()[:12]} is not held here")
        return w.have_reply(arg, self.store.bitfield(entry[1]))
