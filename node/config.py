"""A node's own settings: the knobs of bootstrap.toml's ``[swarm]`` table (``SwarmSettings``: swarm name, bootstrap
peers, trusted trainer id, listen address, private swarm key, allow-list, intervals, relay limits) and, in
``NodeConfig``, what is this process's alone (role, data directory, key). Each knob is declared once, here, with
its default and help; node/settings.py turns it into a flag and a file key, parsed by the ``parse`` function it
names. Flags override the file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import multiaddr
from libp2p.peer.id import ID

from node.errors import UserError
from node.private import load_swarm_key
from trainer.settings import knob

ROLES = ("trainer", "sampler", "bootstrap")


def parse_multiaddr(text: str, where: str, *, need_peer_id: bool) -> multiaddr.Multiaddr:
    try:
        addr = multiaddr.Multiaddr(text)
    except Exception as exc:
        raise UserError(f"bad multiaddr {text!r} in {where}: {exc}") from None
    if need_peer_id and addr.get_peer_id() is None:
        raise UserError(f"multiaddr {text!r} in {where} must end with /p2p/<peer id>")
    if not any(p.name == "tcp" for p in addr.protocols()):
        raise UserError(f"multiaddr {text!r} in {where} is not a TCP address (only TCP is supported)")
    return addr


def parse_peer_id(text: str, where: str) -> ID:
    try:
        pid = ID.from_base58(text)
        raw = pid.to_bytes()
    except Exception:
        raise UserError(f"bad peer id {text!r} in {where}") from None
    # a peer id is a multihash: identity (inline public key, '12D3Koo...') or sha2-256 ('Qm...')
    identity = len(raw) > 2 and raw[0] == 0x00 and raw[1] == len(raw) - 2
    sha256 = len(raw) == 34 and raw[0] == 0x12 and raw[1] == 0x20
    if not (identity or sha256):
        raise UserError(f"bad peer id {text!r} in {where}: not a libp2p peer id multihash")
    return pid


def swarm_name(text: str, where: str) -> str:
    """Names go into DHT keys and gossip topics: keep them to what a path segment holds."""
    if not text.replace("-", "").replace("_", "").isalnum():
        raise UserError(f"{where}: a swarm name is a string of letters, digits, '-' or '_' (got {text!r})")
    return text


def bootstrap_addr(text: str, where: str) -> multiaddr.Multiaddr:
    return parse_multiaddr(text, where, need_peer_id=True)


def listen_addr(text: str, where: str) -> multiaddr.Multiaddr:
    return parse_multiaddr(text, where, need_peer_id=False)


def optional_peer_id(text: str, where: str) -> ID | None:
    """An empty trainer id is no trainer id (a bootstrap.toml template leaves it blank)."""
    return parse_peer_id(text, where) if text else None


def swarm_key(path: Path, where: str) -> str:
    return load_swarm_key(path)


def non_negative(value: int, where: str) -> int:
    if value < 0:
        raise UserError(f"{where} must be a non-negative integer, got {value}")
    return value


@dataclass(frozen=True)
class SwarmSettings:
    """The ``[swarm]`` knobs, for every role. ``key`` names a knob's bootstrap.toml key where it is not the
    field's name; ``type`` is what the flag or the file gives, ``parse`` turns it into the field's value."""

    swarm: str = knob(
        "swarmrl", "swarm name: scopes the DHT keys and gossip topics", key="name", type=str, parse=swarm_name
    )
    bootstrap: tuple[multiaddr.Multiaddr, ...] = knob(
        (),
        "a bootstrap peer, a multiaddr ending in /p2p/<peer id> (repeatable; default: none, a swarm's first node)",
        many=tuple,
        type=str,
        parse=bootstrap_addr,
        metavar="MULTIADDR",
    )
    trainer_id: ID | None = knob(
        None,
        "the trusted trainer's peer id: samplers work only for it and take only weights it signed (default: none)",
        key="trainer",
        flag="trainer",
        type=str,
        parse=optional_peer_id,
        metavar="PEER_ID",
    )
    listen: multiaddr.Multiaddr = knob(
        multiaddr.Multiaddr("/ip4/0.0.0.0/tcp/0"), "listen multiaddr", type=str, parse=listen_addr, metavar="MULTIADDR"
    )
    psk: str | None = knob(
        None,
        "private swarm key file (see `swarmrl swarm-key`; in the file, relative to it; default: a public swarm)",
        key="psk_file",
        flag="psk-file",
        type=Path,
        parse=swarm_key,
        metavar="PATH",
    )
    allow: frozenset[ID] | None = knob(
        None,
        "admit only these peer ids, plus the trainer and the bootstrap peers (repeatable; default: anyone)",
        many=frozenset,
        type=str,
        parse=parse_peer_id,
        metavar="PEER_ID",
    )
    provide_interval: float = knob(
        30.0, "seconds between DHT re-provides at first (doubling while they succeed, up to 20x)"
    )
    discover_interval: float = knob(
        2.0,
        "seconds between a sampler's DHT lookups of the trainer and of other samplers (4x once it has the trainer, "
        "doubling while lookups find no one new, up to 30x)",
    )
    bootstrap_timeout: float = knob(20.0, "seconds a trainer or sampler tries to reach a bootstrap peer before exiting")
    status_interval: float = knob(5.0, "seconds between status.json writes")
    rollout_timeout: float = knob(120.0, "seconds for one rollout submission (one limit, on both sides of the stream)")
    relay: bool | None = knob(
        None,
        "offer circuit relay reservations to peers behind NATs when this node is public "
        "(default: on for trainer and bootstrap, off for samplers)",
        type=bool,
    )
    relay_slots: int = knob(64, "relay reservations held at once", parse=non_negative)
    relay_circuit_bytes: int = knob(
        4 << 20, "bytes one relayed circuit may carry before the relay resets it", parse=non_negative
    )
    relay_circuit_seconds: int = knob(300, "seconds one relayed circuit may live", parse=non_negative)
    reachability_interval: float = knob(60.0, "seconds between dial-back checks of this node's reachability")
    max_inbound: int = knob(
        250,
        "inbound connections held at once; when all are taken the idlest one is closed for a newcomer",
        parse=non_negative,
    )
    reserved_inbound: int = knob(
        16,
        "of those, slots only the bootstrap peers, the trainer and peers with accepted work may take",
        parse=non_negative,
    )
    inbound_per_ip: int = knob(
        8,
        "inbound connections from one IP address (/64 for IPv6; 4x per /24, 8x per /16; loopback exempt; 0: no cap)",
        parse=non_negative,
    )


@dataclass(frozen=True, kw_only=True)
class NodeConfig(SwarmSettings):
    """The swarm's knobs and what belongs to this process alone, from the command line only."""

    role: str
    data_dir: Path
    key_path: Path | None = None

    @property
    def identity_path(self) -> Path:
        return self.key_path or self.data_dir / "identity.key"

    def allowed_peers(self, me: ID) -> frozenset[ID] | None:
        """The allow-list plus the peers this node was told to trust or dial (and itself)."""
        if self.allow is None:
            return None
        known = {me, *([self.trainer_id] if self.trainer_id else [])}
        known |= {ID.from_base58(a.get_peer_id()) for a in self.bootstrap if a.get_peer_id()}
        return self.allow | known


def write_config_file(path: Path, swarm: str, bootstrap: list[str], trainer: str | None) -> None:
    lines = ["[swarm]", f'name = "{swarm}"', "bootstrap = ["]
    lines += [f'  "{a}",' for a in bootstrap]
    lines.append("]")
    if trainer:
        lines.append(f'trainer = "{trainer}"')
    path.write_text("\n".join(lines) + "\n")
