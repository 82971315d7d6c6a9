"""Every blake3 hash of the weights protocol, in one place: chunks, manifest ids, and a weights file's header and
tensor hashes (what a manifest lists and a rebuilt file is checked against)."""

from __future__ import annotations

from pathlib import Path

import blake3

from protocols.weights import SignedManifest
from protocols.weights_file import LayoutError, TensorEntry

THREADED = 4 << 20  # bytes from which hashing on every core pays
HASH_PIECE = 8 << 20  # bytes read at a time when hashing a file


def hasher(length: int) -> blake3.blake3:
    """A blake3 hasher for ``length`` bytes: multithreaded above 4 MiB, where it pays."""
    return blake3.blake3(max_threads=blake3.blake3.AUTO) if length > THREADED else blake3.blake3()


def digest(data: bytes | bytearray | memoryview) -> bytes:
    """blake3 of ``data``: a chunk's content address, or a header's hash."""
    h = hasher(len(data))
    h.update(data)
    return h.digest()


def manifest_id(signed: SignedManifest) -> bytes:
    """A manifest's id: the blake3 of its signed body."""
    return digest(signed.body)


def hash_weights(path: Path, tensors: list[TensorEntry]) -> tuple[bytes, list[bytes]]:
    """(blake3 of the header region, blake3 of every tensor) of a weights file with this layout. Read a piece at a
    time into one buffer: a memory map would count every page of a multi-GB file in the trainer's resident set."""
    if not tensors:
        return digest(Path(path).read_bytes()), []
    buf = bytearray(HASH_PIECE)
    view = memoryview(buf)

    def hash_range(fh, start: int, length: int) -> bytes:
        h = hasher(length)
        fh.seek(start)
        while length > 0:
            got = fh.readinto(view[: min(length, HASH_PIECE)])
            if not got:
                raise LayoutError(f"{path} is shorter than its layout")
            h.update(view[:got])
            length -= got
        return h.digest()

    with open(path, "rb") as fh:
        return hash_range(fh, 0, tensors[0].offset), [hash_range(fh, t.offset, t.nbytes) for t in tensors]
