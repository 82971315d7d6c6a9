"""Task switches one DHT lookup at a peer costs the asking task: ours (node/libp2p/access.py, a lazy stream that
carries the request in its opening write and reads buffered) against the baseline it replaced (the request in a
write of its own, the echoes and the reply read a varint byte at a time), measured in the same run.

Why switches and not seconds: on an idle box a lookup on loopback takes milliseconds either way, but on a loaded
one every switch waits for a pass of the loop. At N = 256 on one box (bench/swarm_scale.py) the samplers' loops
were 0.5 s behind at the median, and a lookup's latency looked like its switches times 0.5 s. It is CPU queueing:
on a saturated loop, fewer switches make every pass longer and move the wait to other tasks, and shorten lookups
only as far as they also save CPU (docs/capacity.md, "Locks that do not yield, tried and reverted").

    .venv/bin/python bench/lookup_steps.py [--rounds 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import multiaddr
import trio
import varint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


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
    counts: dict[str, list[int]] = {"ours": [], "baseline": []}
    async with open_swarm(create_new_key_pair(), listen) as a, open_swarm(create_new_key_pair(), listen) as b:
        await a.connect(PeerInfo(b.peer_id, b.host.get_addrs()))
        switches = Switches()
        trio.lowlevel.add_instrument(switches)
        switches.task = trio.lowlevel.current_task()
        message = Message(type=Message.MessageType.GET_PROVIDERS, key=_encode_key(cid))
        for i in range(rounds):
            print(f"\rround {i + 1}/{rounds}", end="", file=sys.stderr, flush=True)
            for name in ("ours", "baseline") if i % 2 else ("baseline", "ours"):
                switches.count = 0
                if name == "ours":
                    await providers_from_peer(a.dht, b.peer_id, cid)
                else:
                    await baseline_lookup(a.host, b.peer_id, message)
                counts[name].append(switches.count)
        trio.lowlevel.remove_instrument(switches)
    print(file=sys.stderr)
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    counts = trio.run(measure, args.rounds)
    ours, base = statistics.median(counts["ours"]), statistics.median(counts["baseline"])
    print(f"task switches of the asking task per lookup (median of {args.rounds}): ours {ours:.0f}, "
          f"baseline {base:.0f}, ratio {ours / base:.2f}")  # fmt: skip
    print(
        f"if each switch waits a pass of a loop 0.5 s behind (N = 256 on one box): ~{ours * 0.5:.0f} s against "
        f"~{base * 0.5:.0f} s"
    )


if __name__ == "__main__":
    main()
