"""bench/wanem_ceiling: how much traffic the WAN lab's emulator can carry before it, not the links, sets the pace.

Every packet between lab hosts goes through bench/netlab/wanem.py, one Python process reading and writing a TUN
device (this kernel has no netem). This bench builds a lab of 2K hosts in two regions, caps no link (tbf at 10
Gbit/s), and sends plain TCP (no Noise, no yamux: the cheapest traffic there is) from K senders to K receivers at
once, for each K and each path delay asked for. Per run: MB/s delivered, packets/s through the emulator (its own
counters), the emulator's CPU share of one core, and the machine's CPU share. The same transfer between two hosts
wired without the emulator is not possible in this lab (the router sends every packet through it), so the baseline
in the same run is the loopback: one sender and one receiver in one namespace, no emulator.

Writes a dated block to bench/results/wanem_ceiling.txt. Needs root.

    sudo .venv/bin/python bench/wanem_ceiling.py [--flows 1 4 14] [--rtt-ms 0 100] [--mb 200]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from tempfile import TemporaryDirectory

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.netlab.topology import MTU, Lab, Link, lab_unavailable

RESULTS = Path(__file__).resolve().parent / "results"
PORT = 5201
RECEIVER = r"""
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); n = 0; buf = bytearray(1 << 20); t0 = None
while True:
    k = c.recv_into(buf)
    if not k: break
    if t0 is None: t0 = time.time()
    n += k
print(n, t0, time.time(), flush=True)
"""
SENDER = r"""
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
block = b"\0" * (1 << 20)
for _ in range(int(sys.argv[3])): s.sendall(block)
s.close()
"""


def cpu_of(pid: int) -> float:
    """CPU seconds a process has used (user + system), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine."""
    vals = list(map(int, Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]))
    idle = vals[3] + vals[4]
    return sum(vals) - idle, sum(vals)


def transfer(lab: Lab, pairs: list[tuple[str, str]], mb: int, workdir: Path) -> dict[str, float]:
    """K simultaneous TCP flows of ``mb`` MiB each; returns MB/s, packets/s and CPU shares."""
    recv = []
    for i, (_, dst) in enumerate(pairs):
        p = lab.popen(dst, [sys.executable, "-c", RECEIVER, lab.hosts[dst].ip, str(PORT + i)], workdir / f"r{i}.log")
        recv.append((p, workdir / f"r{i}.log"))
    deadline = time.time() + 30
    while not all("ready" in log.read_text() for _, log in recv):
        if time.time() > deadline:
            raise TimeoutError("receivers did not start")
        time.sleep(0.05)
    assert lab.wanem is not None
    stats0, cpu0, mach0 = lab.stats(), cpu_of(lab.wanem.pid), machine_cpu()
    senders = [
        lab.popen(src, [sys.executable, "-c", SENDER, lab.hosts[dst].ip, str(PORT + i), str(mb)], workdir / f"s{i}.log")
        for i, (src, dst) in enumerate(pairs)
    ]
    for p in senders:
        p.wait(timeout=600)
    for p, _ in recv:
        p.wait(timeout=60)
    time.sleep(0.2)  # the emulator writes its counters every 50 ms
    stats1, cpu1, mach1 = lab.stats(), cpu_of(lab.wanem.pid), machine_cpu()
    results = [log.read_text().split()[-3:] for _, log in recv]
    got = sum(int(n) for n, _, _ in results)
    span = max(float(end) for _, _, end in results) - min(float(start) for _, start, _ in results)
    return {
        "mb_s": got / 1e6 / span,
        "pps": (stats1.get("forwarded", 0) - stats0.get("forwarded", 0)) / span,  # the flows' span: no startup
        "emu_core": (cpu1 - cpu0) / span,
        "machine": (mach1[0] - mach0[0]) / max(1, mach1[1] - mach0[1]),
        "bytes_ok": float(got == mb * len(pairs) << 20),
    }


def loopback(mb: int, workdir: Path) -> float:
    """MB/s of one flow over the loopback, no emulator (the baseline)."""
    import subprocess

    log = workdir / "lo.log"
    r = subprocess.Popen([sys.executable, "-c", RECEIVER, "127.0.0.1", str(PORT + 99)], stdout=open(log, "w"))
    while "ready" not in log.read_text():
        time.sleep(0.05)
    subprocess.run([sys.executable, "-c", SENDER, "127.0.0.1", str(PORT + 99), str(mb)], check=True)
    r.wait(timeout=60)
    n, start, end = log.read_text().split()[-3:]
    return int(n) / 1e6 / (float(end) - float(start))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flows", type=int, nargs="+", default=[1, 4, 14])
    ap.add_argument("--rtt-ms", type=float, nargs="+", default=[0.0, 100.0], help="between the two regions")
    ap.add_argument("--mb", type=int, default=200, help="MiB per flow")
    args = ap.parse_args()
    why = lab_unavailable()
    if why:
        print(f"bench/wanem_ceiling needs a network lab: {why}")
        return 2
    lines = [
        f"## {datetime.now(UTC):%Y-%m-%d %H:%M} UTC: bench/wanem_ceiling, plain TCP through the lab's emulator "
        f"(MTU {MTU}, links uncapped), {args.mb} MiB per flow, {os.cpu_count()} cores"
    ]
    with TemporaryDirectory(prefix="swarmrl-ceiling-") as tmp:
        base = loopback(args.mb, Path(tmp))
        lines.append(f"baseline, loopback without the emulator, 1 flow: {base:.0f} MB/s")
        print(lines[-1], flush=True)
        for rtt in args.rtt_ms:
            k = max(args.flows)
            lab = Lab(Path(tmp) / f"lab{rtt:g}", [Link("a", "a", 0.0), Link("b", "b", 0.0), Link("a", "b", rtt)])
            for i in range(k):
                lab.add_host(f"a{i}", "a", 10000, 10000)
                lab.add_host(f"b{i}", "b", 10000, 10000)
            with lab:
                for flows in args.flows:
                    work = Path(tmp) / f"run-{rtt:g}-{flows}"
                    work.mkdir()
                    r = transfer(lab, [(f"a{i}", f"b{i}") for i in range(flows)], args.mb, work)
                    lines.append(
                        f"RTT {rtt:g} ms, {flows} flows: {r['mb_s']:.0f} MB/s ({r['mb_s'] / base:.2f}x loopback), "
                        f"{r['pps']:.0f} packets/s through the emulator, emulator {100 * r['emu_core']:.0f}% of one "
                        f"core, machine {100 * r['machine']:.0f}% busy{'' if r['bytes_ok'] else ' (BYTES LOST)'}"
                    )
                    print(lines[-1], flush=True)
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "wanem_ceiling.txt", "a") as fh:
        fh.write("\n".join(lines) + "\n\n")
    print(f"wrote {RESULTS / 'wanem_ceiling.txt'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
