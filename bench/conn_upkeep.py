"""What an idle connection costs a host: K real swarms (host, DHT, gossip, connection manager: node.host.open_swarm)
in one trio process, connected at two degrees, nothing sent but what they send on their own (keepalive pings, gossip
heartbeats, DHT upkeep). Prints CPU per host at each degree, and the difference per connection: the baseline is the
lower degree, in the same run.

    .venv/bin/python bench/conn_upkeep.py --hosts 40 --degrees 6 39 --seconds 40
"""

from __future__ import annotations

import argparse
import os
import random
import time
from typing import Any

import multiaddr
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import PeerInfo

from node.host import open_swarm
from node.runtime import quiet_gc
from node.weights.gossip import announce_topic

LISTEN = multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")


async def measure(hosts: int, degree: int, seconds: float, settle: float) -> tuple[float, float]:
    """(connections per host, CPU milliseconds per second per host) for ``hosts`` swarms, each dialling ``degree``
    others (all of them when ``degree`` >= hosts - 1)."""
    swarms: list[Any] = []
    async with trio.open_nursery() as nursery:

        async def one(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            async with open_swarm(create_new_key_pair(), LISTEN) as swarm:

                async def ignore(sender: Any, message: Any) -> None:
                    pass

                nursery.start_soon(swarm.gossip.listen, announce_topic("bench"), ignore)
                task_status.started(swarm)
                await trio.sleep_forever()

        for _ in range(hosts):
            swarms.append(await nursery.start(one))
        rng = random.Random(1)
        for i, swarm in enumerate(swarms):
            others = [j for j in range(hosts) if j != i]
            for j in others if degree >= hosts - 1 else rng.sample(others, degree):
                peer = swarms[j].host
                if peer.get_id() not in swarm.host.get_connected_peers():
                    with trio.move_on_after(10):
                        await swarm.host.connect(PeerInfo(peer.get_id(), peer.get_addrs()))
        await trio.sleep(settle)
        conns = sum(len(s.host.get_connected_peers()) for s in swarms) / hosts
        cpu, wall = sum(os.times()[:2]), time.monotonic()
        await trio.sleep(seconds)
        used = (sum(os.times()[:2]) - cpu) / (time.monotonic() - wall)
        nursery.cancel_scope.cancel()
    return conns, used / hosts * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=40)
    ap.add_argument("--degrees", type=int, nargs=2, default=[6, 39])
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--settle", type=float, default=20.0, help="seconds after the dials before measuring")
    args = ap.parse_args()
    quiet_gc()  # what `swarmrl node` does
    rows = [trio.run(measure, args.hosts, d, args.seconds, args.settle) for d in args.degrees]
    for d, (conns, ms) in zip(args.degrees, rows, strict=True):
        print(f"{args.hosts} hosts dialling {d}: {conns:.1f} connections per host, {ms:.2f} ms CPU/s per host")
    (c0, m0), (c1, m1) = rows
    print(f"ratio {m1 / m0:.2f}x the CPU for {c1 / c0:.2f}x the connections: "
          f"{(m1 - m0) / (c1 - c0):.3f} ms CPU/s per idle connection")  # fmt: skip


if __name__ == "__main__":
    main()
