"""Private swarms: a pre-shared key (libp2p pnet) and an allow-list of peer ids.

The swarm key encrypts every connection before Noise, so a node without it cannot even finish a handshake
(the file uses the go-ipfs ``swarm.key`` format, so the same key works with other libp2p implementations).
The allow-list admits only the listed peer ids: a connection from anyone else is closed as soon as it is
up, and any stream it manages to open first is reset before protocol negotiation.
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

from libp2p.abc import IHost, INetConn, INetStream, INetwork
from libp2p.peer.id import ID

from node.errors import UserError
from node.libp2p import inbound_stream_entry
from node.libp2p.conns import Notifee

log = logging.getLogger(__name__)

PSK_HEADER = "/key/swarm/psk/1.0.0/"
PSK_ENCODING = "/base16/"


def write_swarm_key(path: Path) -> None:
    """Create a new random swarm key file (mode 0600); refuse to overwrite one."""
    if path.exists():
        raise UserError(f"{path} already exists; a new key would lock out every node that has the old one")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"{PSK_HEADER}\n{PSK_ENCODING}\n{secrets.token_hex(32)}\n")


def load_swarm_key(path: Path) -> str:
    """The 32-byte key as 64 hex digits, from a go-ipfs style swarm.key (or a file holding just the hex)."""
    try:
        lines = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read swarm key {path}: {exc}") from None
    if lines[:1] == [PSK_HEADER]:
        if lines[1:2] != [PSK_ENCODING]:
            raise UserError(f"{path}: only the {PSK_ENCODING} swarm key encoding is supported")
        lines = lines[2:]
    key = lines[0] if len(lines) == 1 else ""
    try:
        ok = len(bytes.fromhex(key)) == 32
    except ValueError:
        ok = False
    if not ok:
        raise UserError(f"{path} is not a swarm key: expected 64 hex digits (make one with `swarmrl swarm-key`)")
    return key.lower()


class PeerGate(Notifee):
    """Closes connections and resets streams from peers outside the allow-list (None: everyone is allowed)."""

    def __init__(self, allowed: frozenset[ID] | None) -> None:
        self.allowed = allowed
        self.refused: dict[str, int] = {}

    def allows(self, peer: ID) -> bool:
        return self.allowed is None or peer in self.allowed

    def _refuse(self, peer: ID) -> None:
        self.refused[str(peer)] = self.refused.get(str(peer), 0) + 1
        if self.refused[str(peer)] == 1:
            log.warning("refusing %s: not on this swarm's allow-list", peer)

    def install(self, host: IHost) -> None:
        """Gate every inbound stream (all protocols, ours and py-libp2p's) and every new connection."""
        if self.allowed is None:
            return
        network = host.get_network()
        negotiate = inbound_stream_entry(host)  # the host's own entry point

        async def gated(stream: INetStream) -> None:
            peer = stream.muxed_conn.peer_id
            if not self.allows(peer):
                self._refuse(peer)
                try:
                    await stream.reset()
                except Exception:
                    pass
                return
            await negotiate(stream)

        network.set_stream_handler(gated)
        network.register_notifee(self)

    async def connected(self, network: INetwork, conn: INetConn) -> None:
        peer = conn.muxed_conn.peer_id
        if not self.allows(peer):
            self._refuse(peer)
            try:
                await conn.close()
            except Exception as exc:
                log.debug("closing %s failed: %s", peer, exc)
