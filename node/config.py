"""Node configuration: bootstrap.toml's [swarm] table (swarm name, bootstrap peers, trusted trainer id, private
swarm key, allow-list) and the node-level flags. The [trainer], [sampler] and [weights] tables are read by
node/settings.py. Flags override the file."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import multiaddr
from libp2p.peer.id import ID

from node.errors import UserError

ROLES = ("trainer", "sampler", "bootstrap")
DEFAULT_LISTEN = "/ip4/0.0.0.0/tcp/0"


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


@dataclass(frozen=True)
class NodeConfig:
    role: str
    swarm: str = "swarmrl"
    bootstrap: tuple[multiaddr.Multiaddr, ...] = ()
    trainer_id: ID | None = None
    listen: multiaddr.Multiaddr = field(default_factory=lambda: multiaddr.Multiaddr(DEFAULT_LISTEN))
    data_dir: Path = Path(".swarmrl")
    key_path: Path | None = None
    provide_interval: float = 30.0
    discover_interval: float = 2.0
    bootstrap_timeout: float = 20.0
    status_interval: float = 5.0
    rollout_timeout: float = 120.0  # one limit for a rollout submission, on both sides of the stream
    psk: str | None = None  # private swarm key (64 hex digits), from swarm.psk_file / --psk-file
    allow: frozenset[ID] | None = None  # only these peers may connect (None: anyone)
    relay: bool | None = None  # offer circuit relay reservations when public (None: trainer and bootstrap do)
    relay_slots: int = 64  # reservations a relay holds at once
    relay_circuit_bytes: int = 4 << 20  # bytes one relayed circuit may carry before the relay resets it
    relay_circuit_seconds: int = 300  # seconds one relayed circuit may live
    reachability_interval: float = 60.0  # seconds between dial-back checks of this node's reachability
    extra: dict[str, Any] = field(default_factory=dict)

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

    def with_overrides(self, **changes: Any) -> NodeConfig:
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


TABLES = ("swarm", "trainer", "sampler", "weights")


def read_config_file(path: Path) -> dict[str, Any]:
    """bootstrap.toml as parsed TOML; every problem names the file."""
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"config file {path} is not valid TOML: {exc}") from None
    unknown = set(data) - set(TABLES)
    if unknown:
        raise UserError(f"{path}: unknown tables or keys {', '.join(sorted(unknown))} (known: {', '.join(TABLES)})")
    return data


def load_config_file(path: Path) -> dict[str, Any]:
    """bootstrap.toml's [swarm] table as NodeConfig values; every problem names the file and the key."""
    return swarm_values(read_config_file(path), path)


def swarm_values(data: dict[str, Any], path: Path) -> dict[str, Any]:
    swarm = data.get("swarm", {})
    if not isinstance(swarm, dict):
        raise UserError(f"{path}: [swarm] must be a table")
    relay_keys = {"relay": bool, "relay_slots": int, "relay_circuit_bytes": int, "relay_circuit_seconds": int}
    unknown = set(swarm) - {"name", "bootstrap", "trainer", "psk_file", "allow", *relay_keys}
    if unknown:
        raise UserError(f"{path}: unknown keys in [swarm]: {', '.join(sorted(unknown))}")
    out: dict[str, Any] = {}
    if "name" in swarm:
        if not isinstance(swarm["name"], str) or not swarm["name"].replace("-", "").replace("_", "").isalnum():
            raise UserError(f"{path}: swarm.name must be a string of letters, digits, '-' or '_'")
        out["swarm"] = swarm["name"]
    if "bootstrap" in swarm:
        if not isinstance(swarm["bootstrap"], list) or not all(isinstance(x, str) for x in swarm["bootstrap"]):
            raise UserError(f"{path}: swarm.bootstrap must be a list of multiaddr strings")
        out["bootstrap"] = tuple(
            parse_multiaddr(a, f"{path} swarm.bootstrap", need_peer_id=True) for a in swarm["bootstrap"]
        )
    if swarm.get("trainer"):
        if not isinstance(swarm["trainer"], str):
            raise UserError(f"{path}: swarm.trainer must be a peer id string")
        out["trainer_id"] = parse_peer_id(swarm["trainer"], f"{path} swarm.trainer")
    if "psk_file" in swarm:
        from node.private import load_swarm_key

        if not isinstance(swarm["psk_file"], str):
            raise UserError(f"{path}: swarm.psk_file must be a path string")
        out["psk"] = load_swarm_key(path.parent / swarm["psk_file"])
    if "allow" in swarm:
        if not isinstance(swarm["allow"], list) or not all(isinstance(x, str) for x in swarm["allow"]):
            raise UserError(f"{path}: swarm.allow must be a list of peer id strings")
        out["allow"] = frozenset(parse_peer_id(x, f"{path} swarm.allow") for x in swarm["allow"])
    for key, kind in relay_keys.items():  # what a relay operator sets (README: "Behind a NAT")
        if key in swarm:
            if not isinstance(swarm[key], kind) or (kind is int and (isinstance(swarm[key], bool) or swarm[key] < 0)):
                what = "boolean" if kind is bool else "non-negative integer"
                raise UserError(f"{path}: swarm.{key} must be a {what}")
            out[key] = swarm[key]
    return out


def write_config_file(path: Path, swarm: str, bootstrap: list[str], trainer: str | None) -> None:
    lines = ["[swarm]", f'name = "{swarm}"', "bootstrap = ["]
    lines += [f'  "{a}",' for a in bootstrap]
    lines.append("]")
    if trainer:
        lines.append(f'trainer = "{trainer}"')
    path.write_text("\n".join(lines) + "\n")
