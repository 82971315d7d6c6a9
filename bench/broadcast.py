"""bench/broadcast: deliver one policy version to N samplers on loopback, swarming vs a naive baseline.

Swarm: samplers fetch rarest-first from the trainer and from each other (every peer re-serves).
Naive: every sampler downloads the whole version from the trainer alone.
Everything runs in this process on the same model bytes; the trainer's uplink is capped, so the bound for any N is
one version through that uplink (S/U). For each N: every one of ``--runs`` swarm runs (a stall shows as inf), the
worst against the bound, the trainer's upload, the CPU used (to show the CPU is not what limits), and the naive
time. Writes bench/results/broadcast.txt and broadcast.png.

    .venv/bin/python bench/broadcast.py [--mb 8] [--n 2 4 8 16] [--trainer-mbps 10] [--runs 5]
"""

from __future__ import annotations

import argparse
import shutil
import time
from contextlib import AsyncExitStack
from pathlib import Path
from tempfile import TemporaryDirectory

import multiaddr
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import info_from_p2p_addr
from rich.console import Console

from node.host import open_swarm
from node.rpc import serve
from node.strikes import Strikes
from node.weights.fetcher import Download
from node.weights.publish import Publisher
from node.weights.server import WeightServer
from node.weights.store import ChunkStore
from protocols import weights as w
from trainer.tiny_qwen2 import build_random_model

console = Console()
LOOPBACK = multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")


class Uplink:
    """The trainer's upload link as a shared token bucket: replies wait until the link could have sent them.
    Stands in for a WAN uplink (the thing swarming saves); every other link is plain loopback."""

    def __init__(self, mbps: float) -> None:
        self.bytes_per_s = mbps * 1e6 / 8
        self.free_at = 0.0

    def wrap(self, handler):
        async def limited(message, remote):
            reply = await handler(message, remote)
            size = sum(len(d) for _, d in reply.get("found", []))
            if not size:
                return reply
            now = trio.current_time()
            self.free_at = max(self.free_at, now) + size / self.bytes_per_s
            await trio.sleep_until(self.free_at)
            return reply

        return limited


async def deliver(root: Path, trainer_store: ChunkStore, n: int, swarming: bool, mbps: float) -> tuple[float, int]:
    mid, signed, manifest = trainer_store.latest()
    async with AsyncExitStack() as stack:
        trainer = await stack.enter_async_context(open_swarm(create_new_key_pair(), LOOPBACK))
        server = WeightServer(trainer_store, origin=swarming)
        handler = Uplink(mbps).wrap(server.handle) if mbps else server.handle
        trainer.host.set_stream_handler(
            w.PROTOCOL_ID, serve("w", handler, 1 << 16, w.MAX_REPLY_FRAME, 30, reply_sent=server.reply_sent)
        )
        nodes = []
        for i in range(n):
            sw = await stack.enter_async_context(open_swarm(create_new_key_pair(), LOOPBACK))
            store = ChunkStore(root / f"{'swarm' if swarming else 'naive'}-{n}-{i}")
            store.add_manifest(signed, manifest)
            sw.host.set_stream_handler(
                w.PROTOCOL_ID, serve("w", WeightServer(store).handle, 1 << 16, w.MAX_REPLY_FRAME, 30)
            )
            await sw.connect(info_from_p2p_addr(trainer.addrs()[0]))
            nodes.append((sw, store))
        if swarming:
            for i, (a, _) in enumerate(nodes):
                for b, _ in nodes[i + 1 :]:
                    await a.connect(info_from_p2p_addr(b.addrs()[0]))
        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for sw, store in nodes:
                others = [o.peer_id for o, _ in nodes if o is not sw] if swarming else []
                d = Download(sw.host, store, manifest, mid, trainer.peer_id, lambda o=others: o, Strikes(2))
                nursery.start_soon(d.run)
        elapsed = time.perf_counter() - t0
        for _, store in nodes:
            assert not store.missing(manifest)
        return elapsed, server.bytes_served


async def main(mb: int, ns: list[int], mbps: float, runs: int) -> None:
    with TemporaryDirectory() as tmp:
        root = Path(tmp)
        hidden = 256 if mb <= 8 else 512
        layers = max(1, round(mb * 1e6 / (4 * 12 * hidden * hidden)))
        model_dir = build_random_model(root / "model", layers=layers, hidden=hidden)
        store = ChunkStore(root / "trainer")
        key = create_new_key_pair()
        staging = shutil.copytree(model_dir, root / "staging")  # the base model dir is what version 0 ships
        _, _, manifest = Publisher(store, key, "bench").publish(staging, 0)
        size = manifest.total_size
        bound = size / (mbps * 1e6 / 8) if mbps else float("nan")
        console.print(
            f"version size {size / 1e6:.1f} MB in {len(manifest.all_chunks())} chunks; "
            f"single-transfer bound S/U = {bound:.2f} s"
        )
        rows, lines = [], []
        for n in ns:
            times, uploads, cpu = [], [], []
            for r in range(runs):
                with console.status(f"N={n}: swarm run {r + 1}/{runs}"):
                    c0 = time.process_time()
                    with trio.move_on_after(20 * bound + 60) as scope:
                        t, up = await deliver(root / f"run{n}-{r}", store, n, swarming=True, mbps=mbps)
                    if scope.cancelled_caught:
                        t, up = float("inf"), 0  # a stall
                    times.append(t)
                    uploads.append(up)
                    cpu.append((time.process_time() - c0) / t if t != float("inf") else float("nan"))
            with console.status(f"N={n}: naive"):
                t_naive, up_naive = await deliver(root / f"naive{n}", store, n, swarming=False, mbps=mbps)
            rows.append((n, times, uploads, t_naive, up_naive))
            worst = max(times)
            lines.append(
                f"N={n:2d}: swarm runs "
                + " ".join(f"{t:.2f}" for t in times)
                + f" s; worst/bound {worst / bound:.2f}; "
                f"trainer upload {sum(uploads) / len(uploads) / size:.2f}x model; CPU busy {max(cpu):.0%} of one core; "
                f"naive {t_naive:.2f} s (upload {up_naive / size:.1f}x)"
            )
            console.print(lines[-1])
        link = f"trainer uplink {mbps:g} Mbit/s" if mbps else "no uplink cap"
        head = (
            f"bench/broadcast ({time.strftime('%Y-%m-%d')}, loopback, one process, {link}; version "
            f"{size / 1e6:.1f} MB, bound S/U {bound:.2f} s; {runs} swarm runs per N, all printed)"
        )
        out = Path(__file__).parent / "results"
        out.mkdir(exist_ok=True)
        (out / "broadcast.txt").write_text(head + "\n" + "\n".join(lines) + "\n")
        plot(rows, size, bound)


def plot(rows, size: int, bound: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(__file__).parent / "results"
    ns = [r[0] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    a.plot(ns, [sum(r[2]) / len(r[2]) / size for r in rows], "o-", label="swarm")
    a.plot(ns, [r[4] / size for r in rows], "s--", label="naive")
    a.set(xlabel="samplers", ylabel="trainer upload (x model size)", title="trainer upload")
    a.legend()
    for n, times, *_ in rows:
        b.plot([n] * len(times), times, "o", color="tab:blue", alpha=0.6)
    b.plot(ns, [max(r[1]) for r in rows], "-", color="tab:blue", label="swarm (every run; line: worst)")
    b.plot(ns, [r[3] for r in rows], "s--", color="tab:orange", label="naive")
    b.axhline(bound, color="grey", ls=":", label="bound S/U")
    b.axhline(1.5 * bound, color="grey", ls="--", label="1.5 x bound")
    b.set(xlabel="samplers", ylabel="seconds", title="time for every sampler to hold the version", yscale="log")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "broadcast.png", dpi=110)
    console.print(f"plot: {out / 'broadcast.png'}")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=int, default=8)
    p.add_argument("--n", type=int, nargs="+", default=[2, 4, 8, 16])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument(
        "--trainer-mbps",
        type=float,
        default=10.0,
        help="cap on the trainer's upload: low enough that it, not the CPU (everything runs in one process), "
        "bounds the transfer",
    )
    args = p.parse_args()
    trio.run(main, args.mb, args.n, args.trainer_mbps, args.runs)
