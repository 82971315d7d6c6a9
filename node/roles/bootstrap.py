"""Bootstrap role: a plain DHT server that others join through; it holds no model and runs no work."""

from __future__ import annotations

from typing import Any

import trio

from node.host import Swarm


class BootstrapRole:
    name = "bootstrap"

    def register(self, swarm: Swarm) -> None:
        pass

    async def run(self, swarm: Swarm) -> None:
        await trio.sleep_forever()

    def status(self) -> dict[str, Any]:
        return {}
