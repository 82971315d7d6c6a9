"""Task switches one DHT lookup at a peer costs the asking task, measured in the same run:
- ours: node/libp2p/access.py (a lazy stream that carries the request in its opening write and reads buffered) on
  connections whose locks take a free lock without yielding (node/libp2p/locks.py, patch 10);
- trio's locks: the same lookup on a pair of hosts built, and asked, with py-libp2p's modules on trio's own locks;
- baseline: the path before either (the request in a write of its own, the echoes and the reply read a varint byte
  at a time), on trio's locks.

Why switches and not seconds: on an idle box a lookup on loopback takes milliseconds either way, but on a loaded
one every switch waits for a pass of the loop. At N = 256 on one box (bench/swarm_scale.py) the samplers' loops
were 0.5 s behind at the median, so a lookup's latency was about its switches times 0.5 s (docs/capacity.md).

    .venv/bin/python bench/lookup_steps.py [--rounds 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Iterator
from contextlib import AsyncExitStack, contextmanager
from pathlib import Path
from typing import Any

import multiaddr
import trio
import varint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NAMES = ["ours", "trio's locks", "baseline"]


class Switches(trio.abc.Instrument):
    """Counts the steps of one task: each is a return from the scheduler, a switch away and back."""

    def __init__(self) -> None:
        self.task: trio.lowlevel.Task | None = None
        self.count = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task is self.task:
            self.count += 1


async def baseline_lookup(host, peer, message) -> bytes:  # type: ignore[no-untyped-def]
    """The path before: the request written after the opening write, everything read a varint byte at a time."""
    from libp2p.kad_dht.common import MAX_DHT_MESSAGE_SIZE, PROTOCOL_ID
    from libp2p.utils.varint import read_varint_prefixed_bytes_limited

    from node import rpc

    body = message.SerializeToString()
    stream = await rpc.open_stream(host, peer, PROTOCOL_ID)
    raw = stream._stream  # type: ignore[attr-defined]
    try:
        await stream.write(varint.encode(len(body)) + body)
        for _ in range(2):  # the listener's echoes
            await read_varint_prefixed_bytes_limited(raw, rpc.MAX_ECHO)
        return await read_varint_prefixed_bytes_limited(raw, MAX_DHT_MESSAGE_SIZE)
    finally:
        await stream.close()


@contextmanager
def trio_locks() -> Iterator[None]:
    """py-libp2p's modules on trio's own locks inside the block (the locks they make meanwhile stay trio's)."""
    from node.libp2p.patches import PATCHES

    modules = [p.install[0] for p in PATCHES if p.name == "free-lock-yields" and p.install]
    eager = [m.trio for m in modules]
    for module in modules:
        module.trio = trio
    try:
        yield
    finally:
        for module, was in zip(modules, eager, strict=True):
            module.trio = was


async def measure(rounds: int) -> dict[str, list[int]]:
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.kad_dht.kad_dht import _encode_key
    from libp2p.kad_dht.pb.kademlia_pb2 import Message
    from libp2p.peer.peerinfo import PeerInfo

    from node.discovery import role_cid
    from node.host import open_swarm
    from node.libp2p import providers_from_peer

    listen = multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")
    cid = role_cid("swarm", "trainer")
    message = Message(type=Message.MessageType.GET_PROVIDERS, key=_encode_key(cid))
    counts: dict[str, list[int]] = {name: [] for name in NAMES}
    async with AsyncExitStack() as stack:

        async def pair() -> tuple[Any, Any]:
            a = await stack.enter_async_context(open_swarm(create_new_key_pair(), listen))
            b = await stack.enter_async_context(open_swarm(create_new_key_pair(), listen))
            await a.connect(PeerInfo(b.peer_id, b.host.get_addrs()))
            return a, b

        eager = await pair()
        with trio_locks():
            stock = await pair()

        async def lookup(name: str) -> None:
            if name == "ours":
                await providers_from_peer(eager[0].dht, eager[1].peer_id, cid)
                return
            with trio_locks():
                if name == "trio's locks":
                    await providers_from_peer(stock[0].dht, stock[1].peer_id, cid)
                else:
                    await baseline_lookup(stock[0].host, stock[1].peer_id, message)

        switches = Switches()
        trio.lowlevel.add_instrument(switches)
        switches.task = trio.lowlevel.current_task()
        for i in range(rounds):
            print(f"\rround {i + 1}/{rounds}", end="", file=sys.stderr, flush=True)
            for name in NAMES[i % len(NAMES) :] + NAMES[: i % len(NAMES)]:  # each goes first in turn
                switches.count = 0
                await lookup(name)
                counts[name].append(switches.count)
        trio.lowlevel.remove_instrument(switches)
    print(file=sys.stderr)
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    counts = trio.run(measure, args.rounds)
    med = {name: statistics.median(c) for name, c in counts.items()}
    ours, locks, base = med["ours"], med["trio's locks"], med["baseline"]
    print(f"task switches of the asking task per lookup (median of {args.rounds}): ours {ours:.0f}, "
          f"with trio's locks {locks:.0f}, baseline {base:.0f}; ratio to trio's locks {ours / locks:.2f}, "
          f"to the baseline {ours / base:.2f}")  # fmt: skip
    print(
        f"if each switch waits a pass of a loop 0.5 s behind (N = 256 on one box): ~{ours * 0.5:.0f} s, "
        f"~{locks * 0.5:.0f} s with trio's locks, ~{base * 0.5:.0f} s for the baseline"
    )


if __name__ == "__main__":
    main()
