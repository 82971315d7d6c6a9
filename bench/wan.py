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

``--delta``: versions are bf16 and rounds alternate a version shipped whole (``full``) and one shipped as a sparse
patch of its parent (``patch``, the product's default), both swarming; each version is one AdamW-sized step
(every fp32 master weight moved by ``--delta-lr``, as Adam's first step does) from the last. Prints time to all
samplers, full against patch, against the ideal and the ideal + 3 round trips of the slowest path, with the CPU
share beside it; appends a dated block to bench/results/wan.txt and plots bench/results/wan_delta.png. Two
uncounted ``warmup`` patches come first: the origin cuts pieces by the last patch's size, so the first gives it one
and the second is cut with it (its other files re-cut once). ``--patch-only`` skips the full rounds;
``--no-push`` runs the origin without push (announce, then requests only: the baseline); ``--compare-push``
alternates push rounds (``patch``) with baseline rounds (``nopush``: no push, configured chunk size) in one lab.
The origin knows its uplink (``--origin-mbps``), as in ``--replay``; ``--one-copy``: it does not.
bench/delta.py runs this mode on real trained versions and records it.

``--replay DIR``: the headline of issue 27. The origin (1 Gbit/s, ``--origin-mbps 1000``) sends the 1.5B-shaped
int8-grid versions bench/delta_shaped.py kept in DIR (``--keep``) to samplers that start holding version 0 and run
int8-grid, on the issue's home links (``--homes``: 100-300 Mbit/s down, 20-50 up); a version counts when a sampler
holds every chunk of it, each checked against its hash (bench/wan_node.py ``--deliver-only``: the 1.7 GB rebuild per
version is measured on one node by bench/delta_shaped.py, not repeated by 14 samplers on one box). Version 1 is
uncounted (the origin cuts pieces by the last patch's size). TCP starts from an internet path's initial window (2
jumbo segments, ~10 x 1448 B; ``--jumbo-window``: the kernel's 10 jumbo segments, 6x that; ``--warm``: no host
restarts slow start after an idle period, net.ipv4.tcp_slow_start_after_idle=0). The origin is told its uplink
(the trainer's ``origin_uplink_mbps``: it pushes each piece to several samplers, node/weights/policy.py
``push_copies``: here to all 14, its lanes to far samplers being in slow start longer than 14 copies take its
uplink; ``--one-copy``: it is not, and pushes one copy of each). Per version: time from publication to the last
sampler, against the ideal and 2 s, with the CPU share (the rounds start once the joined lab is at rest,
``SETTLED``), then raw TCP's time for the same bytes on the same paths (bench/netlab/tcpfloor.py, the nodes
stopped); appends to bench/results/wan.txt (the header names the commit that ran), plots
bench/results/wan_replay.png and, over every replay recorded, wan_replay_n.png.

    sudo .venv/bin/python bench/wan.py [--samplers 12] [--origin-mbps 100] [--rounds 2]
    sudo .venv/bin/python bench/wan.py --delta [--samplers 6] [--layers 10 --hidden 512] [--link-scale 1]
    sudo nice -n 19 .venv/bin/python bench/wan.py --delta --patch-only --rounds 3 [--no-push]
    sudo .venv/bin/python bench/wan.py --replay DIR --samplers 14 --origin-mbps 1000 --homes --link-scale 1
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from tempfile import TemporaryDirectory

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.netlab.swarm import ACCESS, HOMES, PORT, REGIONS, status_of, wan_links
from bench.netlab.topology import Lab, lab_unavailable, wait_for
from bench.swarm_scale import proc_cpu
from node.config import write_config_file
from node.identity import load_or_create_key, peer_id_of
from trainer.tiny_qwen2 import build_random_model

console = Console()
IDLE_WINDOW = 5.0  # seconds per window of the lab's idle CPU (--replay)
# --replay's rounds start once the joined lab is at rest: an idle window at most this share of the box, or after
# SETTLE_MAX s. Right after version 0 the 15 nodes' joining (DHT lookups, AutoNAT dial-backs, signed records)
# held 72%, 41%, 27% of the box in the first 5 s windows, ~7% after 40 s (with bursts to 25% at DHT refreshes):
# rounds started 10 s in measured the join, not a swarm whose samplers joined before the version came
SETTLED = 0.15
SETTLE_MAX = 90.0
INTERNET_WINDOW = 2  # --replay's initial TCP window, in the lab's jumbo segments: ~10 x 1448 B (netlab/topology.py)
RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Round:
    mode: str
    version: int
    size: int  # bytes a sampler holding the parent fetches for this version (the patch, or the whole version)
    uploaded: int  # bytes the origin served during the round
    arrivals: list[float]  # seconds from publish to each sampler holding the version, sorted
    cpu_share: float  # of the whole machine, during the round
    cpu_seconds: float = 0.0  # the node processes (/proc), from publication until the driver saw every sampler hold it
    phases: list[dict[str, float]] = field(default_factory=list)  # per sampler: heard, fetched, built, got (see below)
    origin_cpu: float = 0.0  # the origin's process alone, over the same span: one interpreter, one core at most

    @property
    def t_all(self) -> float:
        return self.arrivals[-1]


def status(root: Path, name: str) -> dict:
    return status_of(root / name)


Access = list[tuple[float, float]]


def access_links(n: int, link_scale: float, profile: Access = ACCESS) -> Access:
    """(down, up) Mbit/s of each sampler."""
    return [(profile[i % len(profile)][0] * link_scale, profile[i % len(profile)][1] * link_scale) for i in range(n)]


def slowest_rtt(n: int) -> float:
    """Seconds: the longest round trip between any two of the regions the origin (na) and ``n`` samplers sit in."""
    used = {"na", *(REGIONS[i % len(REGIONS)] for i in range(n))}
    return max(link.rtt_ms for link in wan_links() if link.a in used and link.b in used) / 1e3


def ideal_time(size: int, n: int, origin_mbps: float, link_scale: float, profile: Access = ACCESS) -> float:
    """T* for one version of ``size`` bytes: the origin's uplink, the slowest downlink, the swarm's total upload."""
    origin_bps = origin_mbps * 1e6 / 8
    links = access_links(n, link_scale, profile)
    downs, ups = [d * 1e6 / 8 for d, _ in links], [u * 1e6 / 8 for _, u in links]
    return max(size / origin_bps, size / min(downs), n * size / (origin_bps + sum(ups)))


def run_lab(
    root: Path,
    model: Path | None,
    samplers: int,
    origin_mbps: float,
    link_scale: float,
    modes: list[str],
    progress: Progress,
    origin_args: tuple[str, ...] = (),
    fetch_args: tuple[str, ...] = (),
    profile: Access = ACCESS,
    initcwnd: int | None = None,
    warm: bool = False,
    idle: list[float] | None = None,
    floor: list[dict] | None = None,
) -> tuple[int, list[Round]]:
    """Start the lab (the origin publishing ``model`` as version 0, then ``samplers`` fetchers), let every sampler
    fetch version 0, then publish one version per entry of ``modes`` (written to ``<root>/mode`` first: ``naive``
    makes the fetchers ask the origin alone; with ``--delta`` in ``origin_args``, ``full`` ships the version whole)
    and wait for every sampler to hold it. With ``floor`` (a list), the nodes then stop and raw TCP moves the
    counted rounds' median size through the same lab (``tcp_floor``), its rounds appended to ``floor``. Returns
    (version 0's size in bytes, the rounds)."""
    lab = Lab(root / "lab", wan_links(), initcwnd=initcwnd, slow_start_after_idle=not warm)
    lab.add_host("origin", "na", origin_mbps, origin_mbps)
    names = [f"s{i}" for i in range(samplers)]
    for i, (name, (down, up)) in enumerate(zip(names, access_links(samplers, link_scale, profile), strict=True)):
        lab.add_host(name, REGIONS[i % len(REGIONS)], up, down)
    origin_id = peer_id_of(load_or_create_key(root / "origin" / "identity.key"))
    config = root / "bootstrap.toml"
    write_config_file(config, "wanbench", [f"/ip4/{lab.hosts['origin'].ip}/tcp/{PORT}/p2p/{origin_id}"], str(origin_id))

    def argv(role: str, name: str) -> list[str]:
        return [
            sys.executable,
            "-P",
            str(Path(__file__).resolve().parent / "wan_node.py"),
            role,
            "--config",
            str(config),
            "--data-dir",
            str(root / name),
            "--listen",
            f"/ip4/{lab.hosts[name].ip}/tcp/{PORT}",
            "--root",
            str(root),
            *(("--model", str(model)) if model is not None else ()),
            *(origin_args if role == "origin" else fetch_args),
        ]

    procs: list[subprocess.Popen] = []

    def cpu_total() -> float:
        return sum(proc_cpu(p.pid) for p in procs)

    rounds: list[Round] = []
    published_at: list[float] = []
    with lab:
        procs.append(lab.popen("origin", argv("origin", "origin"), root / "origin.log"))
        wait_for(lambda: status(root, "origin").get("version") == 0, 300, what="the origin's first version")
        for name in names:
            procs.append(lab.popen(name, argv("fetch", name), root / f"{name}.log", nice=5))
        size = json.loads((root / "published.json").read_text())["0"]["bytes"]
        progress.console.print(
            f"{samplers} samplers in {len(REGIONS)} regions, origin uplink {origin_mbps:.0f} Mbit/s, access links "
            f"x{link_scale:g}, version size {size / 1e6:.1f} MB"
        )
        warm = progress.add_task("samplers join and fetch version 0", total=None)
        wait_for(lambda: all("0" in status(root, n).get("got", {}) for n in names), 900, what="version 0")
        progress.remove_task(warm)
        if idle is not None:  # what the lab costs with nothing to send: the share every round pays on top
            settle = progress.add_task("the joined lab settles", total=None)
            start = time.time()
            while not idle or (idle[-1] > SETTLED and time.time() - start < SETTLE_MAX):
                cpu0, t0 = cpu_total(), time.time()
                time.sleep(IDLE_WINDOW)
                idle.append((cpu_total() - cpu0) / ((time.time() - t0) * (os.cpu_count() or 1)))
            progress.remove_task(settle)
        bar = progress.add_task("rounds", total=len(modes))
        for version, mode in enumerate(modes, start=1):
            progress.update(bar, description=f"round {version}/{len(modes)}: {mode}")
            (root / "mode").write_text(mode)
            (root / "publish").touch()
            up0 = status(root, "origin").get("bytes_uploaded", 0)
            cpu0, t0, origin0 = cpu_total(), time.time(), proc_cpu(procs[0].pid)
            wait_for(
                lambda v=version: all(str(v) in status(root, n).get("got", {}) for n in names),
                900,
                what=f"version {version} ({mode})",
            )
            delivery_cpu, origin_cpu = cpu_total() - cpu0, proc_cpu(procs[0].pid) - origin0
            time.sleep(1.0)  # let the origin's status catch up with its upload counter
            cpu_share = (cpu_total() - cpu0) / ((time.time() - t0) * (os.cpu_count() or 1))
            published = json.loads((root / "published.json").read_text())[str(version)]
            published_at.append(published["time"])
            arrivals = sorted(status(root, n)["got"][str(version)] - published["time"] for n in names)
            uploaded = status(root, "origin").get("bytes_uploaded", 0) - up0
            phases = []
            for n in names:
                st = status(root, n)
                mine = {**st.get("phases", {}).get(str(version), {}), "got": st["got"][str(version)]}
                phases.append({k: t - published["time"] for k, t in mine.items()})
            size_v = published["update_bytes"]
            rounds.append(Round(mode, version, size_v, uploaded, arrivals, cpu_share, delivery_cpu, phases, origin_cpu))
            progress.console.print(
                f"version {version} ({mode}, {published['update_bytes'] / 1e6:.2f} MB): last sampler after "
                f"{arrivals[-1]:.2f} s, median {statistics.median(arrivals):.2f} s"
            )
            progress.advance(bar)
        if floor is not None:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait()
            gaps = [b - (a + r.t_all) for a, b, r in zip(published_at, published_at[1:], rounds, strict=False)]
            counted = [r.size for r in rounds if r.mode == "patch"] or [size]
            floor += tcp_floor(lab, root, names, int(statistics.median(counted)), statistics.median(gaps or [2.0]))
    return size, rounds


FLOOR_PORT = 4100
FLOOR_ROUNDS = 3  # per kind: every sampler at once, the farthest alone


def tcp_floor(lab: Lab, root: Path, names: list[str], size: int, gap: float) -> list[dict]:
    """Raw TCP in the lab (bench/netlab/tcpfloor.py): ``size`` bytes from the origin to every sampler at once, and to
    the farthest sampler (the first in asia) alone, each round after ``gap`` s idle as between the product's
    versions, one uncounted round first. Returns per round {"kind", "t_all" (s to the last receiver's last byte)}."""
    script = [sys.executable, "-P", str(Path(__file__).resolve().parent / "netlab" / "tcpfloor.py")]
    far = next((i for i, _ in enumerate(names) if REGIONS[i % len(REGIONS)] == "asia"), len(names) - 1)
    specs = [f"all:{size}"] + [f"all:{size}"] * FLOOR_ROUNDS + [f"one{far}:{size}"] * FLOOR_ROUNDS
    kinds = ["warmup"] + ["all"] * FLOOR_ROUNDS + ["farthest"] * FLOOR_ROUNDS
    for name in names:
        lab.popen(name, [*script, "recv", "--port", str(FLOOR_PORT)], root / f"floor-{name}.log")
    targets = [f"{lab.hosts[n].ip}:{FLOOR_PORT}" for n in names]
    sent = lab.run("origin", [*script, "send", "--to", *targets, "--rounds", *specs, "--gap", f"{gap:.3f}"], 600)
    if sent.returncode != 0:
        raise RuntimeError(f"tcpfloor send failed: {sent.stderr.strip()[-500:]}")
    starts = [json.loads(line) for line in sent.stdout.splitlines() if line.strip()]
    wait_for(lambda: all(len(_floor_lines(root, n)) >= sum(i in s["to"] for s in starts) for i, n in
                         enumerate(names)), 60, 0.2, what="raw TCP's last round")  # fmt: skip
    got = {i: {d["round"]: d["t"] for d in _floor_lines(root, n)} for i, n in enumerate(names)}
    out = []
    for s, kind in zip(starts, kinds, strict=True):
        # a receiver numbers the rounds it took part in; the sender's round k is its n-th
        arrivals = [got[i][sum(i in p["to"] for p in starts[: s["round"]])] for i in s["to"]]
        out.append({"kind": kind, "t_all": max(arrivals) - s["t0"]})
    return out


def _floor_lines(root: Path, name: str) -> list[dict]:
    try:
        text = (root / f"floor-{name}.log").read_text()
    except OSError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samplers", type=int, default=12)
    ap.add_argument("--origin-mbps", type=float, default=25.0, help="the trainer's uplink (and downlink)")
    ap.add_argument(
        "--link-scale",
        type=float,
        default=0.25,
        help="samplers' access links are the profile's times this: slow enough that links, not the CPU, bound it",
    )
    ap.add_argument("--rounds", type=int, default=3, help="versions per mode")
    ap.add_argument("--layers", type=int, default=4, help="size of the model shipped (tiny Qwen2)")
    ap.add_argument("--hidden", type=int, default=256, help="hidden size of the model shipped")
    ap.add_argument("--delta", action="store_true", help="bf16 versions, full against patch (see above)")
    ap.add_argument("--delta-lr", type=float, default=1e-6, help="with --delta: each version's step per weight")
    ap.add_argument("--chunk-kib", type=int, default=1024, help="the origin's largest chunk (the product's default)")
    ap.add_argument("--patch-only", action="store_true", help="with --delta: patch rounds only (no full rounds)")
    ap.add_argument("--no-push", action="store_true", help="with --delta: the origin announces only (the baseline)")
    ap.add_argument("--compare-push", action="store_true", help="with --delta --patch-only: push and baseline rounds")
    ap.add_argument("--replay", type=Path, help="send bench/delta_shaped.py --keep DIR's versions (see above)")
    ap.add_argument("--jumbo-window", action="store_true", help="--replay: the kernel's initial window (see above)")
    ap.add_argument("--one-copy", action="store_true", help="--replay, --delta: the origin pushes one copy of each")
    ap.add_argument("--warm", action="store_true", help="--replay: hosts keep TCP windows across idle periods")
    ap.add_argument("--homes", action="store_true", help="samplers on issue 27's home links (100-300 down, 20-50 up)")
    args = ap.parse_args()
    why = lab_unavailable()
    if why:
        console.print(f"[red]bench/wan needs a network lab: {why}")
        return 2
    if args.replay is not None:
        return replay(args)
    pair = ("full", "patch") if args.delta else ("swarm", "naive")
    if args.delta and args.patch_only:
        pair = ("patch", "nopush") if args.compare_push else ("patch",)
    modes = [m for _ in range(args.rounds) for m in pair]
    origin_args = ("--chunk-size", str(args.chunk_kib << 10))
    if args.delta:
        modes = ["warmup", "warmup", *modes]
        origin_args += ("--delta", "--delta-lr", str(args.delta_lr))
        origin_args += ("--no-push",) if args.no_push else ()
        origin_args += ("--uplink-mbps", str(0 if args.one_copy else args.origin_mbps))  # as --replay's origin
    with TemporaryDirectory(prefix="swarmrl-wan-") as tmp, Progress(console=console) as progress:
        root = Path(tmp)
        model = build_random_model(root / "model", layers=args.layers, hidden=args.hidden)
        idle: list[float] = []  # --delta: its rounds, like --replay's, start once the joined lab is at rest
        size, rounds = run_lab(
            root, model, args.samplers, args.origin_mbps, args.link_scale, modes, progress, origin_args,
            idle=idle if args.delta else None,
        )  # fmt: skip
    if args.delta:
        report_delta(rounds, args, idle)
        return 0
    n, s = args.samplers, size
    ideal = ideal_time(s, n, args.origin_mbps, args.link_scale)
    origin_bps = args.origin_mbps * 1e6 / 8
    downs = [d * 1e6 / 8 for d, _ in access_links(n, args.link_scale)]
    ups = [u * 1e6 / 8 for _, u in access_links(n, args.link_scale)]
    naive_ideal = max(n * s / origin_bps, s / min(downs))
    table = Table(title=f"bench/wan: one {s / 1e6:.1f} MB version to {n} samplers")
    for col in ("mode", "time to all (s)", "median (s)", "origin upload (x model)", "ratio to ideal"):
        table.add_column(col)
    lines = []
    for mode in pair:
        mine = [r for r in rounds if r.mode == mode]
        t_all = statistics.mean(r.t_all for r in mine)
        med = statistics.mean(statistics.median(r.arrivals) for r in mine)
        upload = statistics.mean(r.uploaded for r in mine) / s
        table.add_row(mode, f"{t_all:.2f}", f"{med:.2f}", f"{upload:.2f}", f"{t_all / ideal:.2f}")
        times = [r.t_all for r in mine]
        spread = (max(times) - min(times)) / statistics.mean(times)
        cpu = max(r.cpu_share for r in mine)
        lines.append(
            f"{mode}: time to all {t_all:.2f} s (rounds: {' '.join(f'{t:.2f}' for t in times)}; spread "
            f"{spread:.0%}), median {med:.2f} s, origin upload {upload:.2f}x, {t_all / ideal:.2f}x ideal; "
            f"CPU use at most {cpu:.0%} of the machine"
        )
    console.print(table)
    t_swarm = statistics.mean(r.t_all for r in rounds if r.mode == "swarm")
    t_naive = statistics.mean(r.t_all for r in rounds if r.mode == "naive")
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
        rounds,
        ideal,
        RESULTS / "wan.png",
        f"{n} samplers, {s / 1e6:.1f} MB version, origin {args.origin_mbps:.0f} Mbit/s",
    )
    console.print(f"wrote {RESULTS / 'wan.txt'} and {RESULTS / 'wan.png'}")
    return 0


def replay(args: argparse.Namespace) -> int:
    """``--replay``: the kept 1.5B-shaped int8-grid versions through the lab (see the module docstring)."""
    kept = json.loads((args.replay / "versions.json").read_text())
    modes = ["warmup"] + ["patch"] * (len(kept) - 2)
    profile = HOMES if args.homes else ACCESS
    with TemporaryDirectory(prefix="swarmrl-wan-") as tmp, Progress(console=console) as progress:
        root = Path(tmp)
        (root / "origin").mkdir()
        shutil.copy(args.replay / "origin.key", root / "origin" / "identity.key")  # the versions' signer
        fetch = ("--seed", str(args.replay), "--encoding", "int8-grid", "--deliver-only")
        idle: list[float] = []
        floor: list[dict] = []
        _, rounds = run_lab(
            root, None, args.samplers, args.origin_mbps, args.link_scale, modes, progress,
            ("--replay", str(args.replay), "--uplink-mbps", str(0 if args.one_copy else args.origin_mbps)), fetch,
            profile, None if args.jumbo_window else INTERNET_WINDOW, args.warm, idle, floor,
        )  # fmt: skip
    counted = [r for r in rounds if r.mode == "patch"]
    rtt = slowest_rtt(args.samplers)
    links = access_links(min(args.samplers, len(profile)), args.link_scale, profile)
    lines = [
        f"\n## {datetime.now(UTC):%Y-%m-%d %H:%M UTC}: bench/wan --replay: {kept[0]['full_bf16'] / 2e9:.2f}B-parameter "
        f"int8-grid versions (bench/delta_shaped.py), {args.samplers} samplers in {len(REGIONS)} regions, origin "
        f"{args.origin_mbps:g} Mbit/s, access {'homes' if args.homes else 'profile'} x{args.link_scale:g} "
        f"({', '.join(f'{d:g}/{u:g}' for d, u in links)} Mbit/s down/up), slowest RTT {rtt * 1e3:.0f} ms; "
        "delivery (every chunk here, hash-checked), not rebuild; "
        + ("the origin pushes one copy of each piece" if args.one_copy else "the origin knows its uplink")
        + ("; initial TCP window 10 jumbo segments" if args.jumbo_window else "; initial TCP window ~10 x 1448 B")
        + ("; no slow start after idle" if args.warm else "")
        + f"; code {code_version()}"
    ]
    ideals = [ideal_time(r.size, args.samplers, args.origin_mbps, args.link_scale, profile) for r in counted]
    for r, ideal in zip(counted, ideals, strict=True):
        lines.append(
            f"    v{r.version}: {r.size / 1e6:.2f} MB, last sampler {r.t_all:.2f} s, median "
            f"{statistics.median(r.arrivals):.2f} s; ideal {ideal:.2f} s ({r.t_all / ideal:.2f}x), ideal + 3 RTT "
            f"{ideal + 3 * rtt:.2f} s; origin upload {r.uploaded / r.size:.2f}x; CPU share {r.cpu_share:.0%}, "
            f"{r.cpu_seconds / (args.samplers + 1):.2f} CPU-s per node, the origin {r.origin_cpu:.2f}"
        )
    if counted:
        within2 = sum(r.t_all <= 2.0 for r in counted)
        within15 = sum(r.t_all <= 1.5 * i for r, i in zip(counted, ideals, strict=True))
        within3 = sum(r.t_all <= i + 3 * rtt for r, i in zip(counted, ideals, strict=True))
        lines += [
            f"time to the last sampler: median {statistics.median(r.t_all for r in counted):.2f} s, worst "
            f"{max(r.t_all for r in counted):.2f} s; within 2 s: {within2}/{len(counted)}; within 1.5x ideal: "
            f"{within15}/{len(counted)}; within ideal + 3 RTT: {within3}/{len(counted)}; CPU share median "
            f"{statistics.median(r.cpu_share for r in counted):.0%} (idle lab: {idle[-1]:.0%}, settled "
            f"{len(idle) * IDLE_WINDOW:.0f} s from {idle[0]:.0%}); CPU-s per node and "
            f"version median {statistics.median(r.cpu_seconds for r in counted) / (args.samplers + 1):.2f}, the "
            f"origin's {statistics.median(r.origin_cpu for r in counted):.2f} (one interpreter: a core at most; "
            f"{statistics.median(r.origin_cpu / r.t_all for r in counted):.0%} of the time to the last sampler)",
            f"  median over samplers and versions: {phase_line(counted)}",
            floor_line(floor, statistics.median(r.t_all for r in counted), statistics.median(ideals), rtt),
        ]
    for line in lines:
        console.print(line)
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "wan.txt", "a") as fh:
        fh.write("\n".join(lines) + "\n")
    if counted:
        size = int(statistics.mean(r.size for r in counted))
        ideal = ideal_time(size, args.samplers, args.origin_mbps, args.link_scale, profile)
        title = f"{args.samplers} samplers, 1.5B int8-grid patches of {size / 1e6:.1f} MB, origin {args.origin_mbps:g}"
        plot(counted, ideal, RESULTS / "wan_replay.png", title, target=ideal + 3 * rtt)
        summarize_replays(RESULTS / "wan.txt", RESULTS / "wan_replay_n.png", ideal, ideal + 3 * rtt)
    return 0


def floor_line(floor: list[dict], ours: float, ideal: float, rtt: float) -> str:
    """Raw TCP's rounds in the same lab against ours and the targets: the floor the links and TCP set."""
    every = sorted(f["t_all"] for f in floor if f["kind"] == "all")
    far = sorted(f["t_all"] for f in floor if f["kind"] == "farthest")
    if not every:
        return "raw TCP floor: not measured"
    return (
        f"raw TCP in the same lab (nodes stopped, idle connections, the same gap): the median version's bytes to every "
        f"sampler at once {statistics.median(every):.2f} s (rounds {' '.join(f'{t:.2f}' for t in every)}), to the "
        f"first asia sampler alone {statistics.median(far):.2f} s ({' '.join(f'{t:.2f}' for t in far)}); ours / raw "
        f"TCP to all = {ours / statistics.median(every):.2f}x; ideal + 3 RTT {ideal + 3 * rtt:.2f} s is "
        f"{(ideal + 3 * rtt) / statistics.median(every):.2f}x raw TCP's"
    )


def code_version() -> str:
    """The product's commit (short), with "+" when node/, protocols/ or trainer/ differ from it: what a run ran."""
    repo = Path(__file__).resolve().parents[1]
    git = ["git", "-C", str(repo)]
    try:
        sha = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run([*git, "status", "--porcelain", "node", "protocols", "trainer"], capture_output=True,
                               text=True, check=True)  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha.stdout.strip() + ("+" if dirty.stdout.strip() else "")


REPLAY_HEAD = re.compile(
    r"^## (\d{4}-\d{2}-\d{2}) .*bench/wan --replay: .*?, (\d+) samplers in .*?access homes x1 .*?; "
    r"(the origin knows its uplink|the origin pushes one copy of each piece); initial TCP window ~10 x 1448 B"
    r"(?:; code (\S+))?$"
)
REPLAY_TIME = re.compile(r"^time to the last sampler: median ([\d.]+) s, .*\(idle lab: (\d+)%[,)]")


def summarize_replays(results: Path, png: Path, ideal: float, target: float) -> None:
    """Every --replay run in ``results`` (default windows, no --warm): the median time to the last sampler against
    the number of samplers, copies or one copy, coloured by the code it ran (the day, for runs before the header
    named the commit), with the idle lab's CPU share beside each point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs: list[tuple[str, int, bool, float, int]] = []  # (day and code, samplers, copies, median s, idle %)
    head = None
    for line in results.read_text().splitlines():
        if m := REPLAY_HEAD.match(line):
            when = m.group(1) + (f" ({m.group(4)})" if m.group(4) else "")
            head = (when, int(m.group(2)), m.group(3).endswith("uplink"))
        elif head is not None and (m := REPLAY_TIME.match(line)):
            runs.append((*head, float(m.group(1)), int(m.group(2))))
            head = None
    if not runs:
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for k, day in enumerate(dict.fromkeys(r[0] for r in runs)):  # in the order they ran
        for copies, marker, how in ((True, "o", "the origin knows its uplink"), (False, "x", "one copy")):
            mine = [r for r in runs if r[0] == day and r[2] == copies]
            if not mine:
                continue
            ax.scatter([r[1] for r in mine], [r[3] for r in mine], color=f"C{k}", marker=marker, label=f"{day}: {how}")
            for _, n, _, t, idle in mine:
                ax.annotate(f"idle {idle}%", (n, t), textcoords="offset points", xytext=(6, -3), fontsize=7)
    ax.set_xlim(0, max(r[1] for r in runs) + 3)
    ax.axhline(ideal, color="black", linestyle="--", label=f"ideal {ideal:.2f} s")
    ax.axhline(target, color="gray", linestyle=":", label=f"ideal + 3 RTT {target:.2f} s")
    ax.axhline(2.0, color="tab:green", linestyle="-.", label="target 2 s")
    ax.set_xlabel("samplers (15 Python nodes share this 2-core box at 14; 'idle': the lab's CPU share at rest)")
    ax.set_ylabel("median time to the last sampler (s)")
    ax.set_title("bench/wan --replay: 1.5B int8-grid versions, origin 1 Gbit/s, home links")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def delta_lines(rounds: list[Round], samplers: int, origin_mbps: float, link_scale: float) -> list[str]:
    """Full against patch rounds: per mode, bytes fetched, time to all, median, ideal; then the ratio."""
    lines = []
    means = {}
    rtt = slowest_rtt(samplers)
    for mode in ("full", "patch", "nopush"):
        mine = [r for r in rounds if r.mode == mode]
        if not mine:
            continue
        size = statistics.mean(r.size for r in mine)
        means[mode] = t_all = statistics.mean(r.t_all for r in mine)
        ideal = ideal_time(int(size), samplers, origin_mbps, link_scale)
        median = statistics.mean(statistics.median(r.arrivals) for r in mine)
        target = ideal + 3 * rtt
        lines.append(
            f"{mode}: {size / 1e6:.3f} MB per version, time to all {t_all:.2f} s (rounds: "
            f"{' '.join(f'{r.t_all:.2f}' for r in mine)}), median {median:.2f} s, "
            f"ideal {ideal:.2f} s, ideal + 3 RTT ({rtt * 1e3:.0f} ms) {target:.2f} s: "
            f"{'within' if t_all <= target else 'over'} by {abs(t_all - target):.2f} s, "
            f"origin upload {statistics.mean(r.uploaded for r in mine) / size:.2f}x, "
            f"CPU share of the machine per round {' '.join(f'{r.cpu_share:.0%}' for r in mine)}"
        )
        lines.append(f"  {mode}, median over samplers and rounds: {phase_line(mine)}")
    if "full" in means and "patch" in means:
        lines.append(f"time to all samplers, full / patch = {means['full'] / means['patch']:.1f}x")
    if "nopush" in means and "patch" in means:
        lines.append(f"time to all samplers, no push / push = {means['nopush'] / means['patch']:.2f}x")
    return lines


def phase_line(rounds: list[Round]) -> str:
    """Where a sampler's time went: publish -> manifest accepted (gossip, manifest fetch), -> every chunk here
    (planning, have-polls, transfer), -> built and verified (reassembly or patch rebuild), -> usable."""
    cuts: dict[str, list[float]] = {"announce+manifest": [], "download": [], "build": [], "install": []}
    for p in (p for r in rounds for p in r.phases):
        if not {"heard", "fetched", "built", "got"} <= p.keys():
            continue
        cuts["announce+manifest"].append(p["heard"])
        cuts["download"].append(p["fetched"] - p["heard"])
        cuts["build"].append(p["built"] - p["fetched"])
        cuts["install"].append(p["got"] - p["built"])
    return ", ".join(f"{k} {statistics.median(v):.2f} s" for k, v in cuts.items() if v) or "no phases recorded"


def report_delta(rounds: list[Round], args: argparse.Namespace, idle: list[float]) -> None:
    lines = delta_lines(rounds, args.samplers, args.origin_mbps, args.link_scale)
    for line in lines:
        console.print(line)
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    flag = " --no-push" if args.no_push else " --compare-push" if args.compare_push else " (push)"
    head = (
        f"\n## {when}: bench/wan --delta{' --patch-only' if args.patch_only else ''}"
        f"{flag}: {args.samplers} samplers, origin {args.origin_mbps:g} "
        f"Mbit/s, access links x{args.link_scale:g}, lr {args.delta_lr:g}, {args.layers} layers x {args.hidden}, "
        f"{args.rounds} rounds per mode (nice 19 on a shared 2-core box: see the CPU share); "
        + ("the origin pushes one copy of each piece" if args.one_copy else "the origin knows its uplink")
        + (f"; rounds after the lab settled ({len(idle) * IDLE_WINDOW:.0f} s, idle {idle[0]:.0%} -> {idle[-1]:.0%})"
           if idle else "")
        + f"; code {code_version()}\n"
    )  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / "wan.txt", "a") as fh:
        fh.write(head + "\n".join(lines) + "\n")
    patch = [r for r in rounds if r.mode in ("patch", "nopush")]
    if patch:
        size = int(statistics.mean(r.size for r in patch))
        ideal = ideal_time(size, args.samplers, args.origin_mbps, args.link_scale)
        name = "wan_delta_nopush.png" if args.no_push else "wan_delta.png"
        plot(
            patch,
            ideal,
            RESULTS / name,
            f"{args.samplers} samplers, {size / 1e6:.2f} MB patch{', no push' if args.no_push else ', push'}",
            target=ideal + 3 * slowest_rtt(args.samplers),
        )
        console.print(f"appended to {RESULTS / 'wan.txt'}, plotted {RESULTS / name}")


def plot(rounds: list[Round], ideal: float, path: Path, title: str, target: float | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = {"swarm": "tab:blue", "naive": "tab:red", "patch": "tab:blue", "full": "tab:red", "nopush": "tab:orange"}
    seen = set()
    for r in rounds:
        ys = [(i + 1) / len(r.arrivals) for i in range(len(r.arrivals))]
        ax.step(r.arrivals, ys, where="post", color=colors[r.mode], label=r.mode if r.mode not in seen else None)
        seen.add(r.mode)
    ax.axvline(ideal, color="black", linestyle="--", label=f"ideal {ideal:.2f} s")
    if target is not None:
        ax.axvline(target, color="gray", linestyle=":", label=f"ideal + 3 RTT {target:.2f} s")
    ax.set_xlabel("seconds after publish")
    ax.set_ylabel("fraction of samplers holding the version")
    ax.set_title(f"bench/wan: {title}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
