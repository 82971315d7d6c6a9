"""Cutting a model directory into chunks, and signing / verifying the manifest that lists them.

Chunks never straddle two tensors of the weight file: a tensor that did not change between versions
yields the same chunks, so a new version costs only its changed tensors. (A version may also travel as a
sparse patch of its parent: node/weights/patch.py.)
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from libp2p.crypto.keys import KeyPair
from libp2p.crypto.serialization import deserialize_public_key
from libp2p.peer.id import ID

from node.weights.hashes import digest, manifest_id
from protocols.errors import ProtocolError
from protocols.weights import SIGN_DOMAIN, WEIGHTS_FILE, FileEntry, Manifest, SignedManifest
from protocols.weights_file import TensorEntry, read_layout

__all__ = ["WEIGHTS_FILE", "ForgedManifest", "chunk_sizes", "cut_model_dir"]


class ForgedManifest(ProtocolError):
    code = "forged_manifest"


def cut_ranges(size: int, boundaries: list[int], chunk_size: int) -> list[tuple[int, int]]:
    """Byte ranges covering ``size`` bytes: a new range at every boundary, and every ``chunk_size`` in between."""
    cuts = sorted({0, size, *[b for b in boundaries if 0 < b < size]})
    ranges = []
    for a, b in itertools.pairwise(cuts):
        ranges += [(x, min(x + chunk_size, b)) for x in range(a, b, chunk_size)]
    return ranges


@dataclass
class CutModelDir:
    files: list[FileEntry]
    tensors: list[TensorEntry]


def weights_boundaries(start: int, tensors: list[TensorEntry]) -> list[int]:
    """Where chunks of a weights file must start: its data region and every tensor."""
    return [start] + [t.offset for t in tensors]


def cut_model_dir(
    model_dir: Path, chunk_size: int, sink: Callable[[bytes, bytes], None], skip: frozenset[str] = frozenset()
) -> CutModelDir:
    """Cut every file of ``model_dir`` into chunks, handing each (hash, bytes) to ``sink`` as it is cut: a chunk
    at a time is read, so a multi-GB weights file is never held (or mapped) in memory whole. Files named in
    ``skip`` are not cut (nor listed), though the weights file's tensor layout is always read."""
    files: list[FileEntry] = []
    tensors: list[TensorEntry] = []
    for path in sorted(p for p in Path(model_dir).iterdir() if p.is_file()):
        size = path.stat().st_size
        boundaries: list[int] = []
        if path.name == WEIGHTS_FILE:
            head, tensors = read_layout(path)
            boundaries = weights_boundaries(len(head), tensors)
        if path.name in skip:
            continue
        with open(path, "rb") as fh:
            hashes = []
            for a, b in cut_ranges(size, boundaries, chunk_size):
                fh.seek(a)
                piece = fh.read(b - a)
                h = digest(piece)
                sink(h, piece)
                hashes.append(h)
        files.append(FileEntry(path.name, size, hashes))
    return CutModelDir(files, tensors)


def chunk_sizes(manifest: Manifest) -> dict[bytes, int]:
    """Every chunk's size in bytes, from the manifest alone (the cut is deterministic: tensor-aligned weights,
    ``chunk_size`` pieces elsewhere). What a route costs to fetch is the sum over its missing chunks."""
    out: dict[bytes, int] = {}

    def add(hashes: list[bytes], size: int, boundaries: list[int]) -> None:
        ranges = cut_ranges(size, boundaries, manifest.chunk_size)
        if len(ranges) == len(hashes):
            out.update((h, b - a) for h, (a, b) in zip(hashes, ranges, strict=True))
        else:  # not cut the way this node cuts: an even share is a fine estimate
            out.update((h, size // max(1, len(hashes))) for h in hashes)

    for f in manifest.files:
        boundaries = []
        if f.path == WEIGHTS_FILE and manifest.tensors:
            boundaries = weights_boundaries(min(t.offset for t in manifest.tensors), manifest.tensors)
        add(f.chunks, f.size, boundaries)
    if manifest.patch is not None:
        add(manifest.patch.chunks, manifest.patch.size, [])
    return out


def sign_manifest(manifest: Manifest, key_pair: KeyPair) -> SignedManifest:
    body = manifest.body()
    return SignedManifest(body, key_pair.private_key.sign(SIGN_DOMAIN + body), key_pair.public_key.serialize())


def verify_once(
    signed: SignedManifest,
    held: Callable[[bytes], tuple[SignedManifest, Manifest] | None],
    verify: Callable[[SignedManifest], Manifest],
) -> tuple[bytes, SignedManifest, Manifest]:
    """(id, signed, manifest) of ``signed``: the pair already ``held`` under its id (the blake3 of its body, so the
    same body: verified when it came first) or, for a new one, ``verify``'s. A version's manifest reached a sampler
    up to three times (its push, a poll that crossed it, an announcement: bench/wan --replay, 1.5B), each ~100 KB
    verified and parsed in ~3.5 ms of Python on this box, against 13 us for its id; the held pair is returned
    whole, so a copy with the same body and a bad signature is never stored or passed on in place of the good
    one."""
    mid = manifest_id(signed)
    known = held(mid)
    if known is not None:
        return mid, known[0], known[1]
    return mid, signed, verify(signed)


def verify_manifest(signed: SignedManifest, trusted: ID, swarm: str) -> Manifest:
    """The manifest, if and only if the trusted trainer signed it for this swarm."""
    try:
        key = deserialize_public_key(signed.public_key)
    except Exception:
        raise ForgedManifest("manifest carries an unreadable public key") from None
    if ID.from_pubkey(key) != trusted:
        raise ForgedManifest(f"manifest signed by {ID.from_pubkey(key)}, not the trusted trainer {trusted}")
    try:
        ok = key.verify(SIGN_DOMAIN + signed.body, signed.signature)
    except Exception:
        ok = False
    if not ok:
        raise ForgedManifest("manifest signature does not verify")
    manifest = Manifest.from_body(signed.body)
    if manifest.swarm != swarm:
        raise ForgedManifest(f"manifest is for swarm {manifest.swarm!r}, not {swarm!r}")
    return manifest
