"""bench/nat: samplers behind NATs on the emulated WAN: reachability, relays, hole punching, and who serves chunks.

A lab (bench/netlab) with the WAN profile of tests/test_wan.py: a bootstrap node and the trainer in a datacenter,
8 samplers over four regions, 4 of them behind NATs (bench/netlab/nat.py): 2 endpoint-independent ("cone") and 2
symmetric. Every node is a real ``swarmrl node`` process. The trainer runs a fixed number of GRPO steps and
publishes a version every 2 steps; the run ends when every sampler holds the last version.

Reported per sampler: its NAT, the reachability it found, the chunk bytes it served, how its connections to the
other samplers were made (direct, hole-punched, relayed), its hole punches; and the bytes the relays (trainer and
bootstrap) carried, against all chunk bytes served. Targets (issue 15): cone-NAT samplers serve at least half as
many chunk bytes as public ones, symmetric-NAT samplers converge, relays carry at most 5% of chunk bytes.
Writes bench/results/nat.txt and nat.png. Needs root and nftables (``apt-get install nftables``).

    .venv/bin/python bench/nat.py [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from tempfile import TemporaryDirectory

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.netlab.nat import NatLab, nat_swarm_class, nat_unavailable
from bench.netlab.swarm import wan_links
from bench.netlab.topology import lab_unavailable

RESULTS = Path(__file__).resolve().parent / "results"
# sampler i's NAT (None: public); regions follow bench/netlab/swarm.py's round-robin (s0/s4 na, s1/s5 eu, s2/s6 asia,
# s3/s7 sa), so every NATed sampler has a public one in its region to be compared with
KINDS: list[str | None] = [None, None, None, None, "cone", "cone", "symmetric", "symmetric"]


def trainer_args(max_steps: int) -> list[str]:
    return [
        "--task", "reverse", "--group-size", "4", "--max-tokens", "6", "--batch-groups", "4", "--publish-every", "2",
        "--max-steps", str(max_steps), "--eval-every", "100000", "--checkpoint-every", "4", "--weights-encoding",
        "int8", "--chunk-size", "262144", "--linger", "600", "--rollout-rate", "4", "--rollout-burst", "8",
        "--reachability-interval", "20",
    ]  # fmt: skip


def unavailable() -> str | None:
    return lab_unavailable() or nat_unavailable(install=True)


def run_scenario(
    root: Path,
    model_dir: Path,
    steps: int = 30,
    timeout: float = 480.0,
    punch_wait: float = 150.0,
    log=print,
    stretch: Callable[[], float] = lambda: 1.0,
) -> dict:
    """Run the swarm until the trainer has taken ``steps`` steps and every sampler holds its last version (then up
    to ``punch_wait`` seconds more, until the two cone-NAT samplers have punched a hole to each other). Both waits
    are multiplied by the largest ``stretch()`` seen while they run (a test's load factor: the load average lags
    the load at a session's start, when this scenario runs first)."""
    lab = NatLab(root / "lab", wan_links())
    swarm = nat_swarm_class()(
        lab,
        root,
        model_dir,
        swarm_name="nat",
        trainer_args=trainer_args(steps),
        sampler_args=["--engine", "mlx", "--bits", "none", "--reachability-interval", "20"],
        env={"SWARMRL_DEBUG": "libp2p.relay.circuit_v2.dcutr"},  # each punch's dials in the logs (punch_log)
    )
    swarm.plan_nat(KINDS)
    swarm.write_config()
    samplers = [f"s{i}" for i in range(len(KINDS))]
    t0 = time.time()
    with lab:
        swarm.start("boot")
        time.sleep(2)
        swarm.start("trainer")
        for name in samplers:
            swarm.start(name)
        final, last_print, factor = None, 0.0, stretch()
        while True:
            factor = max(factor, stretch())
            swarm.check_alive("boot", "trainer", *samplers)
            swarm.sample_timeline()
            trainer = swarm.status("trainer")
            if final is None and trainer.get("finished"):  # the final version is named after the last step
                final = trainer["version"]
                log(f"trainer finished at version {final} after {time.time() - t0:.0f} s")
            versions = {n: swarm.status(n).get("weights_version", -1) for n in samplers}
            if final is not None and all(v == final for v in versions.values()):
                break
            if time.time() - last_print > 20:
                last_print = time.time()
                log(f"{time.time() - t0:4.0f} s  trainer v{trainer.get('version')}  samplers {versions}")
            if time.time() - t0 > timeout * factor:
                raise AssertionError(f"no convergence within {timeout * factor:.0f} s: {versions}, trainer {trainer}")
            time.sleep(0.5)
        converged_s = time.time() - t0
        # the relays' share is taken here, while versions spread: waiting for the punch below adds control traffic
        # through them (polls, DHT) but no chunk bytes, so a late punch would inflate it
        at_convergence = {n: swarm.status(n) for n in ["boot", "trainer", *samplers]}
        # the cone-NAT pair punches a hole to each other; on a busy box an attempt can fail (an end too busy to dial
        # within the round) and the retry comes after a pause (node/reachability.py): give it time, the swarm runs on
        cones = [n for n, kind in zip(samplers, KINDS, strict=True) if kind == "cone"]
        punch_from = time.time()
        while not punched_pair(swarm, *cones) and time.time() < punch_from + punch_wait * factor:
            time.sleep(1.0)
            factor = max(factor, stretch())
        cone_punch_s = round(time.time() - t0, 1) if punched_pair(swarm, *cones) else None
        time.sleep(1.0)  # one more status write everywhere
        states = {n: swarm.status(n) for n in ["boot", "trainer", *samplers]}
    ids = {n: states[n].get("peer_id") for n in states}
    names = {pid: n for n, pid in ids.items()}
    trainer = states["trainer"]
    rows = []
    for i, name in enumerate(samplers):
        st = states[name]
        paths = {names.get(pid, pid[:8]): p for pid, p in st.get("peer_paths", {}).items()}
        rows.append(
            {
                "sampler": name,
                "nat": KINDS[i] or "public",
                "region": lab.hosts[name].region,
                "up_mbit": lab.hosts[name].up_mbit,
                "reachability": st.get("reachability"),
                "version": st.get("weights_version"),
                "chunk_bytes_served": st.get("bytes_uploaded", 0),
                "rollouts_accepted": trainer.get("accepted_by_peer", {}).get(ids[name], 0),
                "paths_to_samplers": {n: p for n, p in sorted(paths.items()) if n in samplers},
                "hole_punches": st.get("hole_punches", {}),
                "punched_samplers": sorted(
                    n for n in (names.get(pid) for pid in st.get("hole_punches", {}).get("peers", [])) if n in samplers
                ),
                "relay_dials": st.get("relay_dials", 0),
                "relay_reservations": st.get("relay_reservations", 0),
            }
        )

    def relay_service(of: dict[str, dict], key: str) -> int:
        return sum(of[n].get("relay_service", {}).get(key, 0) for n in ("boot", "trainer"))

    relayed, circuits = relay_service(at_convergence, "bytes_relayed"), relay_service(at_convergence, "circuits")
    chunk_total = trainer.get("bytes_uploaded", 0) + sum(r["chunk_bytes_served"] for r in rows)
    chunks_at_convergence = sum(at_convergence[n].get("bytes_uploaded", 0) for n in ["trainer", *samplers])

    def mean(kind: str, regions: set[str] | None = None, per_mbit: bool = False) -> float:
        served = [
            r["chunk_bytes_served"] / (r["up_mbit"] if per_mbit else 1)
            for r in rows
            if r["nat"] == kind and (regions is None or r["region"] in regions)
        ]
        return sum(served) / max(1, len(served))

    cone_regions = {r["region"] for r in rows if r["nat"] == "cone"}

    pair_paths: dict[str, int] = {"direct": 0, "hole_punched": 0, "relayed": 0}
    for r in rows:
        for p in r["paths_to_samplers"].values():
            pair_paths[p] = pair_paths.get(p, 0) + 1
    return {
        "steps": steps,
        "final_version": final,
        "converged_s": round(converged_s, 1),
        "cone_pair_punched_s": cone_punch_s,  # when the cone pair held a hole-punched connection (None: never)
        "samplers": rows,
        "trainer": {
            "chunk_bytes_served": trainer.get("bytes_uploaded", 0),
            "reachability": trainer.get("reachability"),
            "groups_accepted": trainer.get("groups_accepted"),
            "groups_trained": trainer.get("groups_trained"),
            "groups_stale": trainer.get("groups_stale"),
            "groups_no_signal": trainer.get("groups_no_signal"),
            "groups_buffered": trainer.get("groups_buffered"),
        },
        "boot_reachability": states["boot"].get("reachability"),
        "relay_bytes": relayed,
        "relay_circuits": circuits,
        "chunk_bytes_total": chunk_total,
        "relay_share": relayed / max(1, chunks_at_convergence),  # until every sampler held the final version
        "relay_bytes_end": relay_service(states, "bytes_relayed"),  # after the wait for the cone pair's punch
        "mean_served": {k: mean(k) for k in ("public", "cone", "symmetric")},
        # against the public samplers of the same regions (distance to the trainer decides who holds chunks first)
        "cone_vs_public": mean("cone") / max(1.0, mean("public", cone_regions)),
        "cone_vs_public_per_mbit": mean("cone", per_mbit=True) / max(1e-9, mean("public", cone_regions, True)),
        "sampler_pair_paths": pair_paths,  # each sampler's view of each other sampler (pairs counted twice)
        "timeline": swarm.timeline,
    }


def punched_pair(swarm, a: str, b: str) -> bool:
    """Whether a hole punch ever connected ``a`` and ``b`` (either end's record)."""
    sa, sb = swarm.status(a), swarm.status(b)
    return sb.get("peer_id") in sa.get("hole_punches", {}).get("peers", []) or sa.get("peer_id") in sb.get(
        "hole_punches", {}
    ).get("peers", [])


def punch_log(root: Path, name: str, lines: int = 40) -> str:
    """The last DCUtR lines of a node's log: what its hole punches dialed and how each ended."""
    try:
        text = (root / f"{name}.log").read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join([ln[:240] for ln in text if "dcutr" in ln or "hole punch" in ln][-lines:])


def report(result: dict) -> str:
    lines = [
        f"bench/nat: 8 samplers on the emulated WAN, 4 behind NATs (2 cone, 2 symmetric); {result['steps']} trainer "
        f"steps, last version {result['final_version']}, every sampler holding it after {result['converged_s']} s",
        "",
        f"{'sampler':8} {'nat':10} {'region':6} {'up':>5} {'reach':8} {'ver':>4} {'served MB':>10} {'rollouts':>9} "
        f"{'to samplers: direct/punched/relayed':>36} {'punches ok/tried':>17}",
    ]
    for r in result["samplers"]:
        paths = list(r["paths_to_samplers"].values())
        counts = "/".join(str(paths.count(k)) for k in ("direct", "hole_punched", "relayed"))
        hp = r["hole_punches"]
        lines.append(
            f"{r['sampler']:8} {r['nat']:10} {r['region']:6} {r['up_mbit']:5.0f} {r['reachability']!s:8} "
            f"{r['version']!s:>4} {r['chunk_bytes_served'] / 1e6:10.2f} {r['rollouts_accepted']:9d} {counts:>36} "
            f"{hp.get('punched', 0):>8}/{hp.get('tried', 0)}"
        )
    t = result["trainer"]
    m = result["mean_served"]
    punched = result.get("cone_pair_punched_s")
    lines += [
        "",
        "the two cone-NAT samplers: "
        + (f"hole-punched to each other by {punched} s" if punched is not None else "never hole-punched to each other"),
        f"trainer served {t['chunk_bytes_served'] / 1e6:.2f} MB of chunks; all chunk bytes served: "
        f"{result['chunk_bytes_total'] / 1e6:.2f} MB",
        f"mean chunk bytes served: public {m['public'] / 1e6:.2f} MB, cone {m['cone'] / 1e6:.2f} MB, symmetric "
        f"{m['symmetric'] / 1e6:.2f} MB; cone/public in the cones' regions = {result['cone_vs_public']:.2f}, "
        f"per Mbit/s of uplink {result['cone_vs_public_per_mbit']:.2f} (target >= 0.5)",
        f"relays (trainer + bootstrap) carried {result['relay_bytes'] / 1e6:.2f} MB in {result['relay_circuits']} "
        f"circuits until every sampler held the final version = {100 * result['relay_share']:.2f}% of the chunk "
        "bytes served by then (target <= 5%; this counts every relayed byte, control traffic included); "
        f"{result['relay_bytes_end'] / 1e6:.2f} MB by the end",
        f"sampler-to-sampler connections (each end's view): {result['sampler_pair_paths']}",
        f"ledger: accepted {t['groups_accepted']} = trained {t['groups_trained']} + stale {t['groups_stale']} + "
        f"no signal {t['groups_no_signal']} + buffered {t['groups_buffered']}",
    ]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["samplers"]
    colors = {"public": "#4c72b0", "cone": "#55a868", "symmetric": "#c44e52"}
    fig, (ax, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.8), width_ratios=[3, 2, 3])
    ax.bar(
        [r["sampler"] for r in rows],
        [r["chunk_bytes_served"] / 1e6 for r in rows],
        color=[colors[r["nat"]] for r in rows],
    )
    from matplotlib.patches import Patch

    ax.set_ylabel("chunk MB served")
    ax.set_title("chunk bytes each sampler served")
    ax.legend(handles=[Patch(color=c, label=k) for k, c in colors.items()], fontsize=8)
    kinds = ("direct", "hole_punched", "relayed")
    bottoms = [0] * len(rows)
    for k, c in zip(kinds, ("#4c72b0", "#55a868", "#dd8452"), strict=True):
        vals = [list(r["paths_to_samplers"].values()).count(k) for r in rows]
        ax2.bar([r["sampler"] for r in rows], vals, bottom=bottoms, color=c, label=k)
        bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
    ax2.set_title("connections to other samplers")
    ax2.legend(fontsize=8)
    for name in sorted({n for _, n, _ in result["timeline"]}, key=lambda n: (n != "trainer", n)):
        pts = [(t, v) for t, n, v in result["timeline"] if n == name]
        if name == "trainer":
            style = dict(color="black", linewidth=2.5, label="trainer")
        else:
            kind = next(r["nat"] for r in rows if r["sampler"] == name)
            style = dict(color=colors[kind], linewidth=1, alpha=0.8)
        ax3.step([p[0] for p in pts], [p[1] for p in pts], where="post", **style)
    ax3.set_xlabel("seconds")
    ax3.set_ylabel("version held")
    ax3.set_title(
        f"versions (relays carried {100 * result['relay_share']:.1f}% of chunk bytes; "
        f"cone/public {result['cone_vs_public']:.2f})",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save(result: dict, results: Path = RESULTS) -> None:
    results.mkdir(parents=True, exist_ok=True)
    (results / "nat.txt").write_text(report(result))
    slim = {k: v for k, v in result.items() if k != "timeline"}
    (results / "nat.json").write_text(json.dumps(slim, indent=1, sort_keys=True))
    plot(result, results / "nat.png")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    why = unavailable()
    if why:
        print(f"bench/nat needs a network lab with NAT: {why}")
        return 2
    from trainer.tiny_qwen2 import build_random_model

    with TemporaryDirectory(prefix="swarmrl-nat-") as tmp:
        root = Path(tmp)
        result = run_scenario(root, build_random_model(root / "model"), steps=args.steps)
    save(result)
    print(report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
