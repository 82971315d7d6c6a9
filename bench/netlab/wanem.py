"""A userspace WAN emulator on a TUN device: per-region-pair delay, jitter and loss, and partitions.

This kernel has no ``sch_netem`` (``tc qdisc add ... netem`` says "unknown qdisc"), so the router namespace
sends every forwarded packet through ``tun0`` instead; this process holds each packet for the one-way delay
of its (source region, destination region) pair, drops it with the pair's loss rate (or always, across a
partition), and writes it back, whereupon the kernel routes it on to the destination's veth. Bandwidth caps
stay in the kernel (``tbf`` on the veths). Jitter never reorders packets of one pair (TCP hates reordering
more than delay, and real paths mostly keep order).

Run inside the router namespace: ``python -m bench.netlab.wanem CONFIG.json``. The config maps node IPs to
regions and gives the link matrix; the harness rewrites it (atomically) to partition or heal, and this loop
re-reads it when its mtime changes. Counters are written next to it as ``<config>.stats.json``.
"""

from __future__ import annotations

import fcntl
import heapq
import json
import os
import random
import select
import signal
import struct
import sys
import time
from pathlib import Path

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000


def open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


class LinkTable:
    """Who is in which region, and what the path between two regions does to a packet."""

    def __init__(self, config: dict) -> None:
        self.region_of: dict[bytes, str] = {bytes(map(int, ip.split("."))): r for ip, r in config["nodes"].items()}
        self.links: dict[tuple[str, str], tuple[float, float, float]] = {}
        for link in config["links"]:
            params = (link["rtt_ms"] / 2000.0, link.get("jitter_ms", 0.0) / 1000.0, link.get("loss", 0.0))
            self.links[(link["a"], link["b"])] = params
            self.links[(link["b"], link["a"])] = params
        self.blocked = {(a, b) for a, b in config.get("blocked", [])} | {(b, a) for a, b in config.get("blocked", [])}

    def path(self, src: bytes, dst: bytes) -> tuple[float, float, float] | None:
        """(one-way delay s, jitter s, loss) for a packet, or None when a partition cuts the path."""
        a, b = self.region_of.get(src), self.region_of.get(dst)
        if a is None or b is None:
            return (0.0, 0.0, 0.0)
        if (a, b) in self.blocked:
            return None
        return self.links.get((a, b), (0.0, 0.0, 0.0))


def write_stats(config: Path, stats: dict[str, int]) -> None:
    """The counters, replaced whole: a reader never sees the file empty or half written (Lab.stats then read {}, and
    the WAN lab test failed on a missing counter beside two CPU burners: run f3)."""
    tmp = Path(f"{config}.stats.json.tmp")
    tmp.write_text(json.dumps(stats))
    os.replace(tmp, f"{config}.stats.json")


def main(config_path: str) -> None:
    path = Path(config_path)
    config = json.loads(path.read_text())
    table, mtime = LinkTable(config), path.stat().st_mtime_ns
    fd = open_tun(config.get("tun", "tun0"))
    rng = random.Random(config.get("seed", 0))
    queue: list[tuple[float, int, bytes]] = []
    last_release: dict[tuple[bytes, bytes], float] = {}
    stats = {"forwarded": 0, "dropped_loss": 0, "dropped_partition": 0, "bytes": 0, "max_queue": 0}
    seq = 0
    stop = False

    def on_term(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    print("wanem ready", flush=True)
    next_check = 0.0
    while not stop:
        now = time.monotonic()
        if now >= next_check:  # partitions and heals arrive as a rewritten config
            next_check = now + 0.05
            try:
                m = path.stat().st_mtime_ns
                if m != mtime:
                    table, mtime = LinkTable(json.loads(path.read_text())), m
            except (OSError, ValueError):
                pass
            write_stats(path, stats)
        timeout = max(0.0, min(queue[0][0] - now if queue else 0.05, 0.05))
        try:
            readable, _, _ = select.select([fd], [], [], timeout)
        except InterruptedError:
            continue
        if readable:
            for _ in range(256):  # drain what is waiting, up to a bound, then release what is due
                try:
                    packet = os.read(fd, 65536)
                except BlockingIOError:
                    break
                if len(packet) < 20 or packet[0] >> 4 != 4:
                    continue  # not IPv4: drop
                src, dst = packet[12:16], packet[16:20]
                link = table.path(src, dst)
                if link is None:
                    stats["dropped_partition"] += 1
                    continue
                delay, jitter, loss = link
                if loss and rng.random() < loss:
                    stats["dropped_loss"] += 1
                    continue
                release = time.monotonic() + delay + (rng.uniform(-jitter, jitter) if jitter else 0.0)
                release = max(release, last_release.get((src, dst), 0.0))  # jitter without reordering
                last_release[(src, dst)] = release
                seq += 1
                heapq.heappush(queue, (release, seq, packet))
            stats["max_queue"] = max(stats["max_queue"], len(queue))
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            _, _, packet = heapq.heappop(queue)
            try:
                os.write(fd, packet)
                stats["forwarded"] += 1
                stats["bytes"] += len(packet)
            except OSError:
                pass
    write_stats(path, stats)


if __name__ == "__main__":
    main(sys.argv[1])
