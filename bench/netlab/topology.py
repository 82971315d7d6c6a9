"""A WAN on one machine: every node in its own network namespace, all wired by veth to one router namespace.

    node ns (eth0 10.77.<i>.2) --veth-- router ns (10.77.<i>.1) --tun0-- wanem (delay/jitter/loss/partitions)

Each node's access link is capped both ways with ``tbf`` (uplink on the node's eth0, downlink on the router's
end of its veth). Packets between nodes go veth -> policy route -> tun0 -> wanem -> tun0 -> veth, so every
byte crosses the emulated path. Everything is created by ``Lab.start`` and removed by ``Lab.close`` (also
on error); names carry a random tag so a lab never touches anything it did not create. Needs root, ``ip``,
``tc`` and /dev/net/tun.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

MTU = 9000  # jumbo frames keep the packet rate (and so the userspace emulator's CPU) low
ROUTE_TABLE = 177
REPO = Path(__file__).resolve().parents[2]


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(list(args), capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed: {result.stderr.strip()}")
    return result


def lab_unavailable() -> str | None:
    """Why a lab cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not (shutil.which("ip") and shutil.which("tc")):
        return "iproute2 (ip, tc) is not installed"
    if not os.path.exists("/dev/net/tun"):
        return "/dev/net/tun is missing"
    return None


@dataclass(frozen=True)
class Link:
    a: str
    b: str
    rtt_ms: float
    jitter_ms: float = 0.0
    loss: float = 0.0


@dataclass
class Host:
    name: str
    region: str
    index: int
    up_mbit: float
    down_mbit: float
    ns: str = ""
    veth: str = ""

    @property
    def ip(self) -> str:
        return f"10.77.{self.index}.2"


@dataclass
class Lab:
    workdir: Path
    links: list[Link]
    hosts: dict[str, Host] = field(default_factory=dict)
    tag: str = field(default_factory=lambda: secrets.token_hex(2))
    wanem: subprocess.Popen | None = None
    blocked: list[tuple[str, str]] = field(default_factory=list)
    _procs: list[subprocess.Popen] = field(default_factory=list)
    # TCP's initial window on the hosts' routes, in segments (None: the kernel's 10). The lab's jumbo frames make the
    # kernel's 10 segments 87 KB against the internet's 10 x 1448 B; 2 jumbo segments (17.9 KB) start slow start
    # where an internet path does, and it doubles per round trip from there either way.
    initcwnd: int | None = None
    # False: the hosts keep their TCP window across idle periods (net.ipv4.tcp_slow_start_after_idle=0, per
    # namespace); the kernel's default (True) restarts slow start after an idle RTO, as most internet hosts do
    slow_start_after_idle: bool = True

    @property
    def router(self) -> str:
        return f"srl{self.tag}r"

    @property
    def config_path(self) -> Path:
        return self.workdir / "wanem.json"

    def add_host(self, name: str, region: str, up_mbit: float, down_mbit: float) -> Host:
        host = Host(name, region, len(self.hosts) + 1, up_mbit, down_mbit)
        host.ns, host.veth = f"srl{self.tag}n{host.index}", f"s{self.tag}n{host.index}"
        self.hosts[name] = host
        return host

    # -- building and tearing down -------------------------------------------------------------------
    def start(self) -> Lab:
        why = lab_unavailable()
        if why:
            raise RuntimeError(f"cannot build a network lab: {why}")
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            r = self.router
            sh("ip", "netns", "add", r)
            sh("ip", "-n", r, "link", "set", "lo", "up")
            for key in ("net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.default.rp_filter=0"):
                sh("ip", "netns", "exec", r, "sysctl", "-q", "-w", key)
            for host in self.hosts.values():
                self._wire(host)
            self._write_config()
            sh("ip", "-n", r, "tuntap", "add", "dev", "tun0", "mode", "tun")
            self.wanem = subprocess.Popen(
                ["ip", "netns", "exec", r, sys.executable, "-m", "bench.netlab.wanem", str(self.config_path)],
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=open(self.workdir / "wanem.log", "w"),
                text=True,
            )
            assert self.wanem.stdout is not None
            if self.wanem.stdout.readline().strip() != "wanem ready":
                raise RuntimeError(f"wanem did not start: {(self.workdir / 'wanem.log').read_text()[-2000:]}")
            sh("ip", "-n", r, "link", "set", "tun0", "mtu", str(MTU), "up")
            sh("ip", "-n", r, "route", "add", "10.77.0.0/16", "dev", "tun0", "table", str(ROUTE_TABLE))
            sh("ip", "-n", r, "rule", "add", "iif", "tun0", "lookup", "main", "pref", "100")
            sh("ip", "-n", r, "rule", "add", "lookup", str(ROUTE_TABLE), "pref", "200")
        except BaseException:
            self.close()
            raise
        return self

    def _wire(self, host: Host) -> None:
        r, tmp = self.router, f"s{self.tag}p{host.index}"
        sh("ip", "netns", "add", host.ns)
        sh("ip", "link", "add", host.veth, "mtu", str(MTU), "type", "veth", "peer", "name", tmp, "mtu", str(MTU))
        sh("ip", "link", "set", host.veth, "netns", r)
        sh("ip", "link", "set", tmp, "netns", host.ns)
        sh("ip", "-n", host.ns, "link", "set", tmp, "name", "eth0")
        sh("ip", "-n", host.ns, "link", "set", "lo", "up")
        if not self.slow_start_after_idle:
            sh("ip", "netns", "exec", host.ns, "sysctl", "-q", "-w", "net.ipv4.tcp_slow_start_after_idle=0")
        sh("ip", "-n", host.ns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
        sh("ip", "-n", host.ns, "link", "set", "eth0", "up")
        window = ("initcwnd", str(self.initcwnd)) if self.initcwnd else ()
        sh("ip", "-n", host.ns, "route", "add", "default", "via", f"10.77.{host.index}.1", *window)
        sh("ip", "-n", r, "addr", "add", f"10.77.{host.index}.1/24", "dev", host.veth)
        sh("ip", "-n", r, "link", "set", host.veth, "up")
        self._shape(host.ns, "eth0", host.up_mbit)
        self._shape(r, host.veth, host.down_mbit)

    @staticmethod
    def _shape(ns: str, dev: str, mbit: float) -> None:
        rate_bytes = mbit * 1e6 / 8
        burst = int(max(4 * MTU, rate_bytes / 100))  # 10 ms worth, never less than a few jumbo frames
        sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit",
           "burst", str(burst), "latency", "100ms")  # fmt: skip

    def _write_config(self) -> None:
        config = {
            "nodes": {h.ip: h.region for h in self.hosts.values()},
            "links": [vars(link) for link in self.links],
            "blocked": self.blocked,
        }
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(config))
        os.replace(tmp, self.config_path)

    def close(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if self.wanem is not None and self.wanem.poll() is None:
            self.wanem.terminate()
            try:
                self.wanem.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.wanem.kill()
        for ns in [h.ns for h in self.hosts.values()] + [self.router]:
            for pid in sh("ip", "netns", "pids", ns, check=False).stdout.split():
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            sh("ip", "netns", "del", ns, check=False)

    def __enter__(self) -> Lab:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- using it ----------------------------------------------------------------------------------------
    def popen(self, host: str, argv: list[str], log: Path, nice: int = 0, **kw) -> subprocess.Popen:
        """Start a process inside a host's namespace (killed by ``close`` if still running)."""
        prefix = ["ip", "netns", "exec", self.hosts[host].ns]
        if nice:
            prefix += ["nice", "-n", str(nice)]
        proc = subprocess.Popen(
            prefix + argv, stdout=open(log, "a"), stderr=subprocess.STDOUT, cwd=kw.pop("cwd", REPO), **kw
        )
        self._procs.append(proc)
        return proc

    def run(self, host: str, argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["ip", "netns", "exec", self.hosts[host].ns, *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=REPO,
        )

    def partition(self, *sides: list[str]) -> None:
        """Cut every path between regions on different sides (applied within ~50 ms)."""
        self.blocked = [(a, b) for i, side in enumerate(sides) for other in sides[i + 1 :] for a in side for b in other]
        self._write_config()

    def heal(self) -> None:
        self.blocked = []
        self._write_config()

    def stats(self) -> dict:
        try:
            return json.loads(Path(f"{self.config_path}.stats.json").read_text())
        except (OSError, ValueError):
            return {}


def wait_for(predicate, timeout: float, interval: float = 0.5, what: str = "condition") -> None:
    deadline = time.time() + timeout
    while not predicate():
        if time.time() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)
