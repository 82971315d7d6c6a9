"""Many source addresses for one lab host: what an attacker with a botnet (or a few cloud /16s) dials from.

The trainer caps inbound connections per IPv4 address (8), /24 (32) and /16 (64) (node/connmgr.py), and every
lab host sits in 10.77.0.0/16: an attacker with one address holds 8 connections, which tests the caps and
nothing else. ``source_ips`` spreads n addresses one per identity over /24s and /16s outside the lab's (32 per
/24, 2 /24s per /16, from 10.<first>.0.0), so the caps never bind and the idle pruning and reserved slots are
what is measured. ``add_sources`` puts them on the host's interface and routes their /16s back to it through
the router (give two attackers different ``first`` /16s); the WAN emulator gives addresses it does not know no
delay (only the host's access link shapes them).
"""

from __future__ import annotations

import ipaddress
import subprocess

from bench.netlab.topology import Lab

SOURCE_NET = ipaddress.ip_network("10.88.0.0/13")  # 10.88-10.95: never a lab host's (10.77.0.0/16)
PER_SUBNET = 32  # addresses per /24 (the trainer's /24 cap: one connection each)
SUBNETS_PER_WIDE = 2  # /24s per /16 (the /16 cap is 64 = 2 x 32)


def source_ips(n: int, first: int = 88) -> list[str]:
    """``n`` distinct addresses, ``PER_SUBNET`` per /24 and ``SUBNETS_PER_WIDE`` /24s per /16, from
    10.<first>.0.10."""
    out = []
    for k in range(n):
        wide, rest = divmod(k, PER_SUBNET * SUBNETS_PER_WIDE)
        subnet, host = divmod(rest, PER_SUBNET)
        out.append(f"10.{first + wide}.{subnet}.{10 + host}")
    if any(ipaddress.ip_address(ip) not in SOURCE_NET for ip in out[:1] + out[-1:]):
        raise ValueError(f"{n} sources from 10.{first} do not fit in {SOURCE_NET}")
    return out


def wide_subnets(ips: list[str]) -> list[str]:
    """The /16s ``ips`` fall in, in order."""
    return list(dict.fromkeys(str(ipaddress.ip_network(f"{ip}/16", strict=False)) for ip in ips))


def add_sources(lab: Lab, name: str, ips: list[str]) -> None:
    """Give lab host ``name`` the addresses ``ips`` (on eth0) and route their /16s back to it."""
    host = lab.hosts[name]
    batch = "".join(f"addr add {ip}/32 dev eth0\n" for ip in ips)
    subprocess.run(["ip", "-n", host.ns, "-batch", "-"], input=batch, text=True, check=True, capture_output=True)
    for net in wide_subnets(ips):
        subprocess.run(
            ["ip", "-n", lab.router, "route", "replace", net, "via", host.ip, "dev", host.veth],
            check=True,
            capture_output=True,
        )
