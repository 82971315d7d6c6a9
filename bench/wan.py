"""bench/wan: how long a new policy version takes to reach every sampler across an emulated WAN.

A lab of network namespaces (bench/netlab): the trainer (the origin) in a datacenter with a capped uplink, N
samplers over four regions (20-250 ms RTT, jitter, 0.1% loss between regions; 20-200 Mbit/s access links).
Every node is a separate process running the product's weight stack (bench/wan_node.py). Each round the
origin publishes a version in which every weight chunk is new; rounds alternate between swarming (samplers
fetch rarest-first from everyone) and the naive baseline (each sampler fetches from the origin alone).

Prints, per mode, the time from publish to the last sampler holding the version, against the ideal
T* = max(S/U_origin, S/min(D_i), N*S/(U_origin + sum u_i)) (no protocol can beat the slowest downlink, the origin's
uplink, or the swarm's total upload), as ratios; writes bench/results/wan.txt and wan.png. Needs root.
On a 2-core machine the 13 processes keep both cores busy during a swarm round (Noise and yamux run in
Python), so part of the swarm's gap to the ideal is CPU time, not link time.

    sudo .venv/bin/python bench/wan.py [--samplers 12] [--origin-mbps 100] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.netlab.swarm import ACCESS, PORT, REGIONS, status_of, wan_links
from bench.netlab.topology import Lab, lab_unavailable, wait_for
from node.config import write_config_file
from node.identity import load_or_create_key, peer_id_of
from trainer.tiny_qwen2 import build_random_model

console = Console()
RESULTS = Path(__file__).resolve().parent / "results"


def status(root: Path, name: str) -> dict:
    return status_of(root / name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samplers", type=int, default=12)
    ap.add_argument("--origin-mbps", type=float, default=100.0, help="the trainer's uplink (and downlink)")
    ap.add_argument("--rounds", type=int, default=2, help="versions per mode")
    ap.add_argument("--layers", type=int, default=4, help="size of the model shipped (tiny Qwen2, hidden 256)")
    args = ap.parse_args()
    why = lab_unavailable()
    if why:
        console.print(f"[red]bench/wan needs a network lab: {why}")
        return 2
    with TemporaryDirectory(prefix="swarmrl-wan-") as tmp:
        root = Path(tmp)
        model = build_random_model(root / "model", layers=args.layers, hidden=256)
        lab = Lab(root / "lab", wan_links())
        lab.add_host("origin", "na", args.origin_mbps, args.origin_mbps)
        names = [f"s{i}" for i in range(args.samplers)]
        for i, name in enumerate(names):
            down, up = ACCESS[i % len(ACCESS)]
            lab.add_host(name, REGIONS[i % len(REGIONS)], up, down)
        origin_id = peer_id_of(load_or_create_key(root / "origin" / "identity.key"))
        config = root / "bootstrap.toml"
        write_config_file(
            config, "wanbench", [f"/ip4/{lab.hosts['origin'].ip}/tcp/{PORT}/p2p/{origin_id}"], str(origin_id)
        )

        def argv(role: str, name: str) -> list[str]:
            return [
                sys.executable, "-P", str(Path(__file__).resolve().parent / "wan_node.py"), role, "--config",
                str(config), "--data-dir", str(root / name), "--listen", f"/ip4/{lab.hosts[name].ip}/tcp/{PORT}",
                "--root", str(root), "--model", str(model),
            ]  # fmt: skip

        rows: list[tuple[str, int, float, list[float]]] = []
        with lab:
            lab.popen("origin", argv("origin", "origin"), root / "origin.log")
            wait_for(lambda: status(root, "origin").get("version") == 0, 120, what="the origin's first version")
            for name in names:
                lab.popen(name, argv("fetch", name), root / f"{name}.log", nice=5)
            size = json.loads((root / "published.json").read_text())["0"]["bytes"]
            console.print(
                f"{args.samplers} samplers in {len(REGIONS)} regions, origin uplink {args.origin_mbps:.0f} Mbit/s, "
                f"version size {size / 1e6:.1f} MB"
            )
            with console.status("samplers join and fetch version 0 (warm-up)"):
                wait_for(lambda: all("0" in status(root, n).get("got", {}) for n in names), 300, what="version 0")
            modes = [m for _ in range(args.rounds) for m in ("swarm", "naive")]
            with Progress(console=console) as progress:
                bar = progress.add_task("rounds", total=len(modes))
                for version, mode in enumerate(modes, start=1):
                    (root / "mode").write_text(mode)
                    (root / "publish").touch()
                    up0 = status(root, "origin").get("bytes_uploaded", 0)
                    wait_for(
                        lambda v=version: all(str(v) in status(root, n).get("got", {}) for n in names),
                        600,
                        what=f"version {version} ({mode})",
                    )
                    time.sleep(1.0)  # let the origin's status catch up with its upload counter
                    published = json.loads((root / "published.json").read_text())[str(version)]
                    arrivals = sorted(status(root, n)["got"][str(version)] - published["time"] for n in names)
                    uploaded = status(root, "origin").get("bytes_uploaded", 0) - up0
                    rows.append((mode, uploaded, arrivals[-1], arrivals))
                    progress.advance(bar)
    n, s = args.samplers, size
    origin_bps = args.origin_mbps * 1e6 / 8
    downs = [ACCESS[i % len(ACCESS)][0] * 1e6 / 8 for i in range(n)]
    ups = [ACCESS[i % len(ACCESS)][1] * 1e6 / 8 for i in range(n)]
    ideal = max(s / origin_bps, s / min(downs), n * s / (origin_bps + sum(ups)))
    naive_ideal = max(n * s / origin_bps, s / min(downs))
    table = Table(title=f"bench/wan: one {s / 1e6:.1f} MB version to {n} samplers")
    for col in ("mode", "time to all (s)", "median (s)", "origin upload (x model)", "ratio to ideal"):
        table.add_column(col)
    lines = []
    for mode in ("swarm", "naive"):
        mine = [r for r in rows if r[0] == mode]
        t_all = statistics.mean(r[2] for r in mine)
        med = statistics.mean(statistics.median(r[3]) for r in mine)
        upload = statistics.mean(r[1] for r in mine) / s
        table.add_row(mode, f"{t_all:.2f}", f"{med:.2f}", f"{upload:.2f}", f"{t_all / ideal:.2f}")
        lines.append(f"{mode}: time to all {t_all:.2f} s, median {med:.2f} s, origin upload {upload:.2f}x, "
                     f"{t_all / ideal:.2f}x ideal")  # fmt: skip
    console.print(table)
    t_swarm = statistics.mean(r[2] for r in rows if r[0] == "swarm")
    t_naive = statistics.mean(r[2] for r in rows if r[0] == "naive")
    summary = (
        f"ideal T* = {ideal:.2f} s (S/U_origin {s / origin_bps:.2f}, S/min D {s / min(downs):.2f}, "
        f"NS/(U+sum u) {n * s / (origin_bps + sum(ups)):.2f}); naive bound {naive_ideal:.2f} s\n"
        f"swarm / ideal = {t_swarm / ideal:.2f}    naive / swarm = {t_naive / t_swarm:.2f}"
    )
    console.print(summary)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "wan.txt").write_text(
        f"bench/wan: {n} samplers, origin {args.origin_mbps:.0f} Mbit/s, version {s / 1e6:.1f} MB, "
        f"{args.rounds} rounds per mode\n" + "\n".join(lines) + "\n" + summary + "\n"
    )
    plot(
        rows,
        ideal,
        RESULTS / "wan.png",
        f"{n} samplers, {s / 1e6:.1f} MB version, origin {args.origin_mbps:.0f} Mbit/s",
    )
    console.print(f"wrote {RESULTS / 'wan.txt'} and {RESULTS / 'wan.png'}")
    return 0


def plot(rows, ideal: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = {"swarm": "tab:blue", "naive": "tab:red"}
    seen = set()
    for mode, _, _, arrivals in rows:
        ys = [(i + 1) / len(arrivals) for i in range(len(arrivals))]
        ax.step(arrivals, ys, where="post", color=colors[mode], label=mode if mode not in seen else None)
        seen.add(mode)
    ax.axvline(ideal, color="black", linestyle="--", label=f"ideal {ideal:.1f} s")
    ax.set_xlabel("seconds after publish")
    ax.set_ylabel("fraction of samplers holding the version")
    ax.set_title(f"bench/wan: {title}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
