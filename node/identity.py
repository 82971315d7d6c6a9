"""The node's persistent ed25519 identity: one key file, so the peer id survives restarts."""

from __future__ import annotations

import os
from pathlib import Path

from libp2p.crypto.ed25519 import Ed25519PrivateKey
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID

from node.errors import UserError

KEY_MAGIC = b"swarmrl-ed25519-v1\n"


def load_or_create_key(path: Path) -> KeyPair:
    """Load the key at ``path``, or create it (mode 0600) if the file does not exist yet."""
    if path.exists():
        return load_key(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    private = Ed25519PrivateKey.new()
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(KEY_MAGIC + private.to_bytes())
    os.replace(tmp, path)
    return KeyPair(private, private.get_public_key())


def load_key(path: Path) -> KeyPair:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise UserError(f"cannot read key file {path}: {exc.strerror}") from None
    if not raw.startswith(KEY_MAGIC):
        raise UserError(f"{path} is not a swarmrl identity key (expected header {KEY_MAGIC!r})")
    try:
        private = Ed25519PrivateKey.from_bytes(raw[len(KEY_MAGIC) :])
    except Exception as exc:
        raise UserError(f"{path} holds a damaged ed25519 key: {exc}") from None
    return KeyPair(private, private.get_public_key())


def peer_id_of(key_pair: KeyPair) -> ID:
    return ID.from_pubkey(key_pair.public_key)
