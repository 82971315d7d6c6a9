"""A swarmrl swarm on the emulated WAN: each node is a real ``swarmrl node`` process in its own namespace.

``wan_profile`` is four regions with 20-250 ms RTT (some jitter and loss) and access links of 20-200 Mbit/s;
the trainer sits in a datacenter with 200 Mbit/s each way. ``WanSwarm`` starts, kills and restarts nodes
and reads their status files; a timeline of every sampler's weights version is kept for the figures.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.netlab.topology import Lab, Link
from node.config import write_config_file
from node.identity import load_or_create_key, peer_id_of
from node.status import read_status

REGIONS = ("na", "eu", "asia", "sa")
_RTT = {
    ("na", "eu"): 90,
    ("na", "asia"): 170,
    ("na", "sa"): 130,
    ("eu", "asia"): 230,
    ("eu", "sa"): 200,
    ("asia", "sa"): 250,
}
# (down, up) Mbit/s of consumer links, cycled over the samplers
ACCESS = [(100, 40), (50, 20), (200, 100), (30, 20), (20, 20), (150, 50), (60, 30), (40, 20)]
# (down, up) Mbit/s of the homes issue 27's headline is set on: 100-300 down, 20-50 up
HOMES = [(100, 20), (300, 50), (200, 40), (150, 30), (250, 50), (100, 25), (200, 20)]
TRAINER_LINK = (200, 200)
PORT = 4001


def status_of(data_dir: Path) -> dict:
    """A node's status.json, or {} while it has not written one (or is mid-write)."""
    try:
        return read_status(data_dir)
    except (OSError, ValueError):
        return {}


def wan_links(jitter_frac: float = 0.05, loss: float = 0.001) -> list[Link]:
    links = [Link(r, r, 20, 2, 0.0) for r in REGIONS]
    links += [Link(a, b, rtt, rtt * jitter_frac, loss) for (a, b), rtt in _RTT.items()]
    return links


@dataclass
class WanSwarm:
    lab: Lab
    root: Path
    model_dir: Path
    swarm_name: str = "wan"
    trainer_args: list[str] = field(default_factory=list)
    # MLX int8 computing in bf16: what a Mac runs (the verification limits must hold for it in every scenario)
    sampler_args: list[str] = field(default_factory=lambda: ["--engine", "mlx", "--bits", "8", "--compute", "bf16"])
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    timeline: list[tuple[float, str, int]] = field(default_factory=list)  # (t, sampler, weights version)
    work: list[tuple[float, str, int]] = field(default_factory=list)  # (t, peer, rollouts accepted / flood refusals)
    events: list[tuple[float, str]] = field(default_factory=list)
    t0: float = field(default_factory=time.time)
    env: dict[str, str] = field(default_factory=dict)  # added to every node's environment (e.g. SWARMRL_DEBUG)

    @property
    def config(self) -> Path:
        return self.root / "bootstrap.toml"

    def plan(self, n_samplers: int, extra: dict[str, str] | None = None) -> None:
        """Place the hosts: bootstrap + trainer in 'na', samplers round-robin over the regions."""
        self.lab.add_host("boot", "na", 100, 100)
        self.lab.add_host("trainer", "na", *TRAINER_LINK)
        for i in range(n_samplers):
            down, up = ACCESS[i % len(ACCESS)]
            self.lab.add_host(f"s{i}", REGIONS[i % len(REGIONS)], up, down)
        for name, region in (extra or {}).items():
            self.lab.add_host(name, region, 50, 50)

    def write_config(self) -> None:
        boot_id = peer_id_of(load_or_create_key(self.root / "boot" / "identity.key"))
        self.trainer_id = peer_id_of(load_or_create_key(self.root / "trainer" / "identity.key"))
        boot = f"/ip4/{self.lab.hosts['boot'].ip}/tcp/{PORT}/p2p/{boot_id}"
        write_config_file(self.config, self.swarm_name, [boot], str(self.trainer_id))

    def node_argv(self, name: str, role: str, extra: list[str]) -> list[str]:
        return [
            sys.executable, "-P", "-m", "node.cli", "node", "--role", role, "--config", str(self.config),
            "--data-dir", str(self.root / name), "--listen", f"/ip4/{self.lab.hosts[name].ip}/tcp/{PORT}",
            "--provide-interval", "3", "--status-interval", "0.5",
            *(["--model", str(self.model_dir)] if role == "trainer" else []), *extra,
        ]  # fmt: skip

    def start(self, name: str) -> None:
        if name == "boot":
            argv, nice = self.node_argv(name, "bootstrap", []), 0
        elif name == "trainer":
            argv, nice = self.node_argv(name, "trainer", self.trainer_args), 0
        else:
            argv, nice = self.node_argv(name, "sampler", self.sampler_args), 5
        self.procs[name] = self.lab.popen(
            name, argv, self.root / f"{name}.log", nice=nice, env={**os.environ, **self.env}
        )
        self.event(f"start {name}")

    def start_hostile(self, name: str, mode: str, *extra: str) -> None:
        argv = [
            sys.executable, "-m", "bench.netlab.hostile", "--mode", mode, "--config", str(self.config),
            "--data-dir", str(self.root / name), "--listen", f"/ip4/{self.lab.hosts[name].ip}/tcp/{PORT}", *extra,
        ]  # fmt: skip
        self.procs[name] = self.lab.popen(name, argv, self.root / f"{name}.log", nice=5)
        self.event(f"start {name} ({mode})")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        proc.send_signal(sig)
        proc.wait(timeout=30)
        self.event(f"kill {name}")

    def event(self, what: str) -> None:
        self.events.append((time.time() - self.t0, what))

    def status(self, name: str) -> dict:
        return status_of(self.root / name)

    def alive(self, name: str) -> bool:
        return name in self.procs and self.procs[name].poll() is None

    def samplers(self) -> list[str]:
        return [n for n in self.lab.hosts if n.startswith("s") and n[1:].isdigit()]

    def sample_timeline(self) -> None:
        t = time.time() - self.t0
        trainer = self.status("trainer") if self.alive("trainer") else {}
        by_peer = trainer.get("accepted_by_peer", {})
        for name in self.samplers():
            if self.alive(name):
                state = self.status(name)
                self.timeline.append((t, name, int(state.get("weights_version", -1))))
                if state.get("peer_id") in by_peer:
                    self.work.append((t, name, int(by_peer[state["peer_id"]])))
        if "version" in trainer:
            self.timeline.append((t, "trainer", int(trainer["version"])))
        flood = self.status("flood") if self.alive("flood") else {}
        if flood.get("replies"):
            self.work.append((t, "flood (refused)", int(flood["replies"].get("rate_limited", 0))))
            self.work.append((t, "flood (let through)", int(flood["replies"].get("schema", 0))))

    def store_progress(self, name: str) -> tuple[int, int] | None:
        """(chunks held, chunks needed) for the newest manifest a node has, read from its store on disk."""
        from node.weights.store import ChunkStore

        root = self.root / name / "store"
        if not (root / "manifests").exists():
            return None
        store = ChunkStore(root, observer=True)  # the node is running: its writes in flight are its own
        manifests = [store.manifest(bytes.fromhex(p.stem)) for p in store.manifest_dir.glob("*.bin")]
        manifests = [m for m in manifests if m is not None]
        if not manifests:
            return None
        newest = max((m[1] for m in manifests), key=lambda m: m.version)
        total = len(newest.all_chunks())
        return total - len(store.missing(newest)), total

    def check_alive(self, *names: str) -> None:
        for name in names:
            if not self.alive(name):
                log = (self.root / f"{name}.log").read_text()[-3000:]
                raise AssertionError(f"{name} exited with {self.procs[name].returncode}:\n{log}")


def plot_timeline(swarm: WanSwarm, path: Path, title: str) -> None:
    """Top: every sampler's weights version over time (the trainer's published version in black), events marked.
    Bottom: rollouts the trainer accepted from each sampler, and the flooder's requests refused / let through."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(11, 9), sharex=True, height_ratios=[3, 2])
    names = sorted({n for _, n, _ in swarm.timeline}, key=lambda n: (n != "trainer", len(n), n))
    peers = [n for n in names if n != "trainer"]
    palette = plt.get_cmap("tab10" if len(peers) <= 10 else "tab20")
    colors = {n: palette(i % palette.N) for i, n in enumerate(peers)}
    for name in names:
        pts = [(t, v) for t, n, v in swarm.timeline if n == name]
        style = (
            dict(color="black", linewidth=2.5, label="trainer (published)")
            if name == "trainer"
            else dict(color=colors[name], linewidth=1.2, alpha=0.85, label=f"{name} ({swarm.lab.hosts[name].region})")
        )
        ax.step([p[0] for p in pts], [p[1] for p in pts], where="post", **style)
    for t, what in swarm.events:
        if what.startswith("start s") and "(" not in what:
            continue
        for a in (ax, ax2):
            a.axvline(t, color="grey", linestyle=":", linewidth=0.8)
        ax.text(t, ax.get_ylim()[1], what, rotation=90, fontsize=7, va="top", ha="right")
    ax.set_ylabel("policy version held")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=2, loc="lower right")
    for name in sorted({n for _, n, _ in swarm.work}, key=lambda n: (n.startswith("flood"), len(n), n)):
        pts = [(t, v) for t, n, v in swarm.work if n == name]
        if name.startswith("flood"):
            style = dict(color="red", linestyle="--" if "refused" in name else "-", linewidth=2, label=name)
        else:
            style = dict(color=colors.get(name), linewidth=1.2, label=name)
        ax2.step([p[0] for p in pts], [p[1] for p in pts], where="post", **style)
    ax2.set_yscale("symlog", linthresh=10)
    ax2.set_xlabel("seconds")
    ax2.set_ylabel("rollouts accepted / flood requests")
    ax2.legend(fontsize=7, ncol=3, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
