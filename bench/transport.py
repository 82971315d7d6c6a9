"""bench/transport: bulk throughput and CPU per byte of the product's chunk transfer (TCP + Noise + yamux, the
weights protocol: 4 MiB requests, several in flight), between two processes on loopback.

Three configurations in the same run, each twice: py-libp2p's own yamux (frames of 65,536 bytes, which Noise must
split into two messages; the receive window credited after every read), frames that fit one Noise message, and
those frames with the window credited once half of it is owed, as go-yamux does (both node/libp2p/patches.py: the
product runs the last). For each: MB/s, and MB per CPU-second of the sender and of the receiver (the cost that
bounds a 2-core node: on a machine with more cores than processes, that is also the throughput one core sustains).

    .venv/bin/python bench/transport.py [--mb 256] [--workers 4]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import time
from pathlib import Path
from tempfile import TemporaryDirectory

import trio

RESULTS = Path(__file__).resolve().parent / "results"
CHUNK = 1 << 20


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


STOCK, FITTED, PATCHED = "py-libp2p yamux", "Noise-sized frames", "Noise-sized frames + half-window credit (patched)"
CONFIGS = (STOCK, FITTED, PATCHED)


def configure(config: str) -> None:
    from libp2p.stream_muxer.yamux import yamux

    from node.libp2p import patches as libp2p_patches

    libp2p_patches.apply()
    if config == STOCK:
        yamux.MAX_MESSAGE_SIZE = 64 * 1024  # py-libp2p's own frame size
    if config in (STOCK, FITTED):  # py-libp2p's own credit, after every read
        original = libp2p_patches._state["originals"]["YamuxStream._auto_tune_and_send_window_update"]
        yamux.YamuxStream._auto_tune_and_send_window_update = original


def serve(root: str, config: str, ready, done, cpu_out) -> None:
    async def main() -> None:
        import multiaddr
        from libp2p.crypto.ed25519 import create_new_key_pair

        from node.host import open_swarm
        from node.weights.server import WeightServer
        from node.weights.store import ChunkStore

        configure(config)
        store = ChunkStore(Path(root) / "store")
        async with open_swarm(create_new_key_pair(), multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")) as swarm:
            WeightServer(store, upload_per_peer=1e12).register(swarm.host)
            ready.send(str(swarm.addrs()[0]))
            start = cpu_seconds()
            while not done.poll():
                await trio.sleep(0.05)
            done.recv()
            cpu_out.send(cpu_seconds() - start)

    trio.run(main)


async def fetch(addr: str, hashes: list[bytes], workers: int, config: str) -> tuple[float, float]:
    import multiaddr
    from libp2p.crypto.ed25519 import create_new_key_pair
    from libp2p.peer.peerinfo import info_from_p2p_addr

    from node.host import open_swarm
    from node.rpc import request
    from protocols import weights as w

    configure(config)
    async with open_swarm(create_new_key_pair(), multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")) as swarm:
        target = info_from_p2p_addr(multiaddr.Multiaddr(addr))
        await swarm.connect(target)
        todo = [hashes[i : i + 4] for i in range(0, len(hashes), 4)]
        got = 0

        async def worker() -> None:
            nonlocal got
            while todo:
                batch = todo.pop()
                reply = await request(
                    swarm.host,
                    target.peer_id,
                    w.PROTOCOL_ID,
                    w.get_chunks(batch),
                    max_request=w.MAX_REQUEST_FRAME,
                    max_reply=w.MAX_REPLY_FRAME,
                    timeout=60,
                )
                found, _ = w.parse_chunks_reply(reply, batch, CHUNK)
                got += sum(len(d) for d in found.values())

        cpu0, t0 = cpu_seconds(), time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(workers):
                nursery.start_soon(worker)
        elapsed, cpu = time.perf_counter() - t0, cpu_seconds() - cpu0
        assert got == len(hashes) * CHUNK
        return elapsed, cpu


def one_run(root: Path, hashes: list[bytes], workers: int, config: str) -> dict:
    ctx = mp.get_context("spawn")
    ready_r, ready_w = ctx.Pipe(False)
    done_r, done_w = ctx.Pipe(False)
    cpu_r, cpu_w = ctx.Pipe(False)
    proc = ctx.Process(target=serve, args=(str(root), config, ready_w, done_r, cpu_w))
    proc.start()
    addr = ready_r.recv()
    elapsed, recv_cpu = trio.run(fetch, addr, hashes, workers, config)
    done_w.send(True)
    send_cpu = cpu_r.recv()
    proc.join(30)
    mb = len(hashes) * CHUNK / 1e6
    return {"mb_s": mb / elapsed, "send_mb_per_cpu_s": mb / send_cpu, "recv_mb_per_cpu_s": mb / recv_cpu}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--workers", type=int, default=4)
    args = ap.parse_args()
    from node.weights.hashes import digest
    from node.weights.store import ChunkStore

    with TemporaryDirectory() as tmp:
        store = ChunkStore(Path(tmp) / "store")
        hashes = []
        for _ in range(args.mb):
            data = os.urandom(CHUNK)
            h = digest(data)
            store.put_hashed(h, data)
            hashes.append(h)
        rows: dict[str, list[dict]] = {name: [] for name in CONFIGS}
        for _ in range(2):
            for name in CONFIGS:
                rows[name].append(one_run(Path(tmp), hashes, args.workers, name))
                print(name, {k: round(v, 1) for k, v in rows[name][-1].items()}, flush=True)
    lines = [
        f"bench/transport ({time.strftime('%Y-%m-%d')}, 2 processes on loopback, {args.mb} MiB in 4 MiB requests, "
        f"{args.workers} in flight; mean of 2 runs)"
    ]
    means = {}
    for name, runs in rows.items():
        m = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}
        means[name] = m
        lines.append(
            f"{name}: {m['mb_s']:.0f} MB/s; sender {m['send_mb_per_cpu_s']:.0f} MB per CPU-s, "
            f"receiver {m['recv_mb_per_cpu_s']:.0f} MB per CPU-s"
        )
    base = means[STOCK]
    for name in (FITTED, PATCHED):
        m = means[name]
        lines.append(
            f"{name} / py-libp2p: throughput {m['mb_s'] / base['mb_s']:.2f}, receiver CPU per byte "
            f"{base['recv_mb_per_cpu_s'] / m['recv_mb_per_cpu_s']:.2f}, sender CPU per byte "
            f"{base['send_mb_per_cpu_s'] / m['send_mb_per_cpu_s']:.2f}"
        )
    print("\n".join(lines))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "transport.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
