"""NATs in the WAN lab: a host behind a home router, built from network namespaces and the kernel's own NAT.

A NATed host is an ordinary lab host (``Lab.add_host``) whose namespace becomes its *router*: after the lab is
wired, a private namespace is added behind it on a LAN of its own::

    private ns (eth0 10.78.<i>.2) --veth-- NAT ns (lan0 10.78.<i>.1, eth0 10.77.<i>.2) --veth-- lab router

The NAT namespace keeps the host's public address (so the WAN emulator puts it in its region, and ``tbf`` still
caps its access link), forwards the LAN and rewrites it with nftables (the kernel here has nf_tables, NAT and
conntrack built in; the userspace ``nft`` comes from Debian's ``nftables`` package: ``nat_unavailable`` says when
it is missing). Processes of the host run in the private namespace (``Host.ns`` is switched to it), so
``Lab.popen``/``Lab.run`` work unchanged. Two kinds:

- ``cone``: ``masquerade`` (port-preserving: a socket keeps its source port on the outside whatever it talks to,
  an endpoint-independent mapping, as most home routers do), inbound packets admitted only for tracked
  connections (address-and-port-dependent filtering: a "port-restricted cone"). TCP hole punching works
  through it when both sides dial from their listen port at once (simultaneous open).
- ``symmetric``: ``masquerade fully-random``: every connection gets a fresh random outside port (an
  endpoint-dependent mapping, as carrier-grade NATs and some firewalls do), same filtering. The port a relay
  observes is useless to anyone else, so hole punching fails by design.

Unsolicited inbound connections are dropped silently at the NAT (no RST), as home routers do; a TCP hole punch
then survives a SYN that arrives a little early (it is retransmitted).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field

from bench.netlab.topology import MTU, Lab, sh

NAT_KINDS = ("cone", "symmetric")

_RULES = """
table ip swarmrl_nat {{
    chain postrouting {{
        type nat hook postrouting priority srcnat; policy accept;
        oifname "eth0" ip saddr 10.78.{index}.0/24 masquerade{random}
    }}
    chain input {{
        type filter hook input priority filter; policy accept;
        iifname "eth0" ct state new drop
    }}
    chain forward {{
        type filter hook forward priority filter; policy accept;
        iifname "eth0" ct state new drop
    }}
}}
"""


def nat_unavailable(install: bool = False) -> str | None:
    """Why NAT namespaces cannot be built here, or None when they can. ``install``: as root with apt-get, install
    Debian's nftables first when ``nft`` is missing (what a clean CI machine needs)."""
    if not shutil.which("nft") and install and os.geteuid() == 0 and shutil.which("apt-get"):
        for cmd in (["apt-get", "install", "-y", "-q", "nftables"], ["apt-get", "update", "-q"]):
            subprocess.run(cmd, capture_output=True, timeout=600)
            if shutil.which("nft"):
                break
        else:
            subprocess.run(["apt-get", "install", "-y", "-q", "nftables"], capture_output=True, timeout=600)
    if not shutil.which("nft"):
        return "nft (Debian package nftables) is not installed"
    return None


@dataclass
class NatLab(Lab):
    """A ``Lab`` in which some hosts sit behind a NAT (``add_nat_host``)."""

    nats: dict[str, str] = field(default_factory=dict)  # host name -> kind
    nat_ns: dict[str, str] = field(default_factory=dict)  # host name -> its NAT (router) namespace

    def add_nat_host(self, name: str, region: str, up_mbit: float, down_mbit: float, kind: str = "cone"):
        if kind not in NAT_KINDS:
            raise ValueError(f"NAT kind must be one of {NAT_KINDS}, not {kind!r}")
        host = self.add_host(name, region, up_mbit, down_mbit)
        self.nats[name] = kind
        return host

    def private_ip(self, name: str) -> str:
        """The address a host's processes bind: its LAN address behind a NAT, else its public one."""
        host = self.hosts[name]
        return f"10.78.{host.index}.2" if name in self.nats else host.ip

    def start(self) -> NatLab:
        if self.nats:
            why = nat_unavailable()
            if why:
                raise RuntimeError(f"cannot build NAT namespaces: {why}")
        super().start()
        try:
            for name, kind in self.nats.items():
                self._put_behind_nat(name, kind)
        except BaseException:
            self.close()
            raise
        return self

    def _put_behind_nat(self, name: str, kind: str) -> None:
        host = self.hosts[name]
        outer, inner, i = host.ns, f"{host.ns}p", host.index
        lan, tmp = f"s{self.tag}l{i}", f"s{self.tag}q{i}"
        sh("ip", "netns", "add", inner)
        self.nat_ns[name] = outer
        host.ns = inner  # the host's processes live behind the NAT from now on
        sh("ip", "link", "add", lan, "mtu", str(MTU), "type", "veth", "peer", "name", tmp, "mtu", str(MTU))
        sh("ip", "link", "set", lan, "netns", outer)
        sh("ip", "link", "set", tmp, "netns", inner)
        sh("ip", "-n", outer, "link", "set", lan, "name", "lan0")
        sh("ip", "-n", inner, "link", "set", tmp, "name", "eth0")
        sh("ip", "-n", inner, "link", "set", "lo", "up")
        sh("ip", "-n", inner, "addr", "add", f"10.78.{i}.2/24", "dev", "eth0")
        sh("ip", "-n", inner, "link", "set", "eth0", "up")
        sh("ip", "-n", inner, "route", "add", "default", "via", f"10.78.{i}.1")
        sh("ip", "-n", outer, "addr", "add", f"10.78.{i}.1/24", "dev", "lan0")
        sh("ip", "-n", outer, "link", "set", "lan0", "up")
        sh("ip", "netns", "exec", outer, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        rules = _RULES.format(index=i, random=" fully-random" if kind == "symmetric" else "")
        result = subprocess.run(["ip", "netns", "exec", outer, "nft", "-f", "-"], input=rules, text=True,
                                capture_output=True)  # fmt: skip
        if result.returncode != 0:
            raise RuntimeError(f"nft rules for {name} ({kind}) failed: {result.stderr.strip()}")

    def conntrack_mappings(self, name: str) -> list[str]:
        """The NAT's translation table as the kernel lists it (for debugging a lab)."""
        out = sh("ip", "netns", "exec", self.nat_ns[name], "cat", "/proc/net/nf_conntrack", check=False).stdout
        return out.splitlines()

    def close(self) -> None:
        super().close()
        for ns in self.nat_ns.values():
            for pid in sh("ip", "netns", "pids", ns, check=False).stdout.split():
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            sh("ip", "netns", "del", ns, check=False)


def nat_swarm_class():
    """``WanSwarm`` for a ``NatLab``: NATed samplers listen on their LAN address (imported lazily: bench.netlab.swarm
    pulls in the node package)."""
    from bench.netlab.swarm import ACCESS, REGIONS, TRAINER_LINK, WanSwarm

    class NatSwarm(WanSwarm):
        def plan_nat(self, kinds: list[str | None]) -> None:
            """bootstrap + trainer in 'na' (public), then one sampler per entry of ``kinds``: None (public),
            "cone" or "symmetric"; regions and access links round-robin as in ``WanSwarm.plan``."""
            lab: NatLab = self.lab  # type: ignore[assignment]
            lab.add_host("boot", "na", 100, 100)
            lab.add_host("trainer", "na", *TRAINER_LINK)
            for i, kind in enumerate(kinds):
                down, up = ACCESS[i % len(ACCESS)]
                if kind is None:
                    lab.add_host(f"s{i}", REGIONS[i % len(REGIONS)], up, down)
                else:
                    lab.add_nat_host(f"s{i}", REGIONS[i % len(REGIONS)], up, down, kind)

        def node_argv(self, name: str, role: str, extra: list[str]) -> list[str]:
            argv = super().node_argv(name, role, extra)
            lab: NatLab = self.lab  # type: ignore[assignment]
            i = argv.index("--listen") + 1
            argv[i] = argv[i].replace(f"/ip4/{lab.hosts[name].ip}/", f"/ip4/{lab.private_ip(name)}/")
            return argv

    return NatSwarm
