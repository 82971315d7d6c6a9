"""Weights protocol: signed manifests, chunk requests, have-bitfields, and the gossip announcements.

A policy version is a checkpoint directory cut into content-addressed chunks (blake3, 32 bytes each).
The manifest lists every file's chunks in order and the weight file's tensor layout; the trainer signs
its msgpack body with its libp2p key. Bulk bytes never ride on gossip (gossipsub drops >1 MiB silently):
gossip carries only announcements and have-bitfields, chunks move over the direct request protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from protocols import WIRE_VERSION
from protocols import schema as s
from protocols.errors import MalformedMessage

PROTOCOL_ID = "/swarmrl/weights/1.0.0"
HASH_LEN = 32
MAX_CHUNK_SIZE = 8 << 20
MAX_CHUNKS_PER_REQUEST = 8
MAX_MANIFEST_BODY = 8 << 20  # ~250k chunk hashes
MAX_REQUEST_FRAME = 1 << 16
MAX_REPLY_FRAME = MAX_CHUNKS_PER_REQUEST * MAX_CHUNK_SIZE + (1 << 16)
MAX_FILES = 64
MAX_TENSORS = 1 << 16
ENCODINGS = ("native", "int8", "fp32")  # "fp32": what "native" was called before bf16 versions
GOSSIP_MAX = 1 << 16
MANIFEST_CONTAINERS = 2 * (MAX_FILES + MAX_TENSORS) + 16  # a map and a list per file and per tensor
SIGN_DOMAIN = b"swarmrl-manifest-v1:"


@dataclass(frozen=True)
class FileEntry:
    path: str
    size: int
    chunks: list[bytes]


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: list[int]
    offset: int  # byte offset of the tensor's data inside its file
    nbytes: int


@dataclass(frozen=True)
class Manifest:
    swarm: str
    version: int
    parent: int  # -1 for the first version
    encoding: str  # how model.safetensors is stored: "native" (as published: bf16 or fp32) or "int8" (rowwise)
    chunk_size: int
    files: list[FileEntry]
    tensors: list[TensorEntry]

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    def all_chunks(self) -> list[bytes]:
        """Every distinct chunk hash, in first-appearance order."""
        return list(dict.fromkeys(h for f in self.files for h in f.chunks))

    def body(self) -> bytes:
        return msgpack.packb(
            {
                "v": WIRE_VERSION,
                "t": "manifest_body",
                "swarm": self.swarm,
                "version": self.version,
                "parent": self.parent,
                "encoding": self.encoding,
                "chunk_size": self.chunk_size,
                "total_size": self.total_size,
                "files": [{"path": f.path, "size": f.size, "chunks": f.chunks} for f in self.files],
                "tensors": [
                    {"name": t.name, "dtype": t.dtype, "shape": t.shape, "offset": t.offset, "nbytes": t.nbytes}
                    for t in self.tensors
                ],
            },
            use_bin_type=True,
        )

    @classmethod
    def from_body(cls, body: bytes) -> Manifest:
        from protocols.framing import unpack

        m = unpack(body, MAX_MANIFEST_BODY, MANIFEST_CONTAINERS)
        s.expect_type(m, "manifest_body")
        chunk_size = s.integer(m, "chunk_size", 1024, MAX_CHUNK_SIZE)
        files = []
        for f in s.items(m, "files", MAX_FILES, min_len=1):
            f = f if isinstance(f, dict) else {}
            path = s.text(f, "path", 128)
            if "/" in path or "\\" in path or path.startswith(".") or not path:
                raise s.SchemaError(f"unsafe file name {path!r} in manifest")
            size = s.integer(f, "size", 0, 1 << 42)
            chunks = s.items(f, "chunks", MAX_MANIFEST_BODY // HASH_LEN)
            if not all(isinstance(h, bytes) and len(h) == HASH_LEN for h in chunks):
                raise s.SchemaError("chunk hashes must be 32-byte blake3 digests")
            if len(chunks) < -(-size // chunk_size):
                raise s.SchemaError(f"file {path!r} has too few chunks for its size")
            files.append(FileEntry(path, size, chunks))
        if len({f.path for f in files}) != len(files):
            raise s.SchemaError("file names repeat in manifest")
        tensors = []
        for t in s.items(m, "tensors", MAX_TENSORS):
            t = t if isinstance(t, dict) else {}
            tensors.append(
                TensorEntry(
                    s.text(t, "name", 256),
                    s.text(t, "dtype", 16),
                    s.int_list(t, "shape", 8, 0, 1 << 40),
                    s.integer(t, "offset", 0, 1 << 42),
                    s.integer(t, "nbytes", 0, 1 << 42),
                )
            )
        encoding = s.text(m, "encoding", 16)
        if encoding not in ENCODINGS:
            raise s.SchemaError(f"unknown weight encoding {encoding!r}")
        manifest = cls(
            swarm=s.text(m, "swarm", 64),
            version=s.integer(m, "version", 0, 1 << 40),
            parent=s.integer(m, "parent", -1, 1 << 40),
            encoding=encoding,
            chunk_size=chunk_size,
            files=files,
            tensors=tensors,
        )
        if s.integer(m, "total_size", 0, 1 << 44) != manifest.total_size:
            raise s.SchemaError("total_size does not match the files")
        return manifest


@dataclass(frozen=True)
class SignedManifest:
    body: bytes
    signature: bytes
    public_key: bytes  # libp2p protobuf-serialized public key of the signer

    def to_wire(self) -> dict[str, Any]:
        return {"v": WIRE_VERSION, "t": "manifest", "body": self.body, "sig": self.signature, "key": self.public_key}

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> SignedManifest:
        s.expect_type(m, "manifest")
        return cls(s.blob(m, "body", MAX_MANIFEST_BODY), s.blob(m, "sig", 256), s.blob(m, "key", 256))


# -- requests (one request, one reply per stream) -------------------------------------------------------
def get_manifest(manifest_id: bytes | None) -> dict[str, Any]:
    """Ask for a manifest by id, or (None) for the newest one the peer holds."""
    return {"v": WIRE_VERSION, "t": "get_manifest", "id": manifest_id or b""}


def get_chunks(hashes: list[bytes], manifest_id: bytes | None = None) -> dict[str, Any]:
    """Ask for chunks; naming the manifest they belong to asks for the peer's have-bitfield in the reply too (so a
    peer being downloaded from need not also be polled for what it holds)."""
    out: dict[str, Any] = {"v": WIRE_VERSION, "t": "get_chunks", "hashes": hashes}
    if manifest_id is not None:
        out["id"] = manifest_id
    return out


def chunks_request_manifest(m: dict[str, Any]) -> bytes | None:
    """The manifest id a get_chunks request names (for the bitfield in the reply), if any."""
    return s.blob(m, "id", HASH_LEN, exact=HASH_LEN) if "id" in m else None


def get_have(manifest_id: bytes) -> dict[str, Any]:
    return {"v": WIRE_VERSION, "t": "get_have", "id": manifest_id}


def parse_request(m: dict[str, Any]) -> tuple[str, Any]:
    kind = m.get("t")
    if kind == "get_manifest":
        mid = s.blob(m, "id", HASH_LEN)
        if mid and len(mid) != HASH_LEN:
            raise s.SchemaError("manifest id must be 32 bytes or empty")
        return kind, mid or None
    if kind == "get_chunks":
        hashes = s.items(m, "hashes", MAX_CHUNKS_PER_REQUEST, min_len=1)
        if not all(isinstance(h, bytes) and len(h) == HASH_LEN for h in hashes):
            raise s.SchemaError("chunk hashes must be 32-byte digests")
        return kind, hashes
    if kind == "get_have":
        return kind, s.blob(m, "id", HASH_LEN, exact=HASH_LEN)
    raise MalformedMessage(f"unknown weights request {kind!r}")


def chunks_reply(found: list[tuple[bytes, bytes]], missing: list[bytes], bits: bytes | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"v": WIRE_VERSION, "t": "chunks", "found": [[h, d] for h, d in found], "missing": missing}
    if bits is not None:
        out["bits"] = bits
    return out


def parse_reply_bits(m: dict[str, Any], n_chunks: int) -> bytes | None:
    """The have-bitfield a chunks reply carries (None if it carries none)."""
    if "bits" not in m:
        return None
    bits = s.blob(m, "bits", MAX_MANIFEST_BODY // HASH_LEN // 8 + 1)
    if len(bits) != (n_chunks + 7) // 8:
        raise s.SchemaError("bitfield length does not match the manifest")
    return bits


def parse_chunks_reply(
    m: dict[str, Any], asked: list[bytes], chunk_size: int
) -> tuple[dict[bytes, bytes], list[bytes]]:
    s.expect_type(m, "chunks")
    found: dict[bytes, bytes] = {}
    for item in s.items(m, "found", MAX_CHUNKS_PER_REQUEST):
        if not (
            isinstance(item, list) and len(item) == 2 and isinstance(item[0], bytes) and isinstance(item[1], bytes)
        ):
            raise s.SchemaError("found entries must be [hash, data]")
        if item[0] not in asked or len(item[1]) > chunk_size:
            raise s.SchemaError("peer sent a chunk we did not ask for, or an oversized one")
        found[item[0]] = item[1]
    missing = [h for h in s.items(m, "missing", MAX_CHUNKS_PER_REQUEST) if isinstance(h, bytes)]
    return found, missing


def have_reply(manifest_id: bytes, bits: bytes) -> dict[str, Any]:
    return {"v": WIRE_VERSION, "t": "have", "id": manifest_id, "bits": bits}


def parse_have(m: dict[str, Any], n_chunks: int | None = None) -> tuple[bytes, bytes]:
    s.expect_type(m, "have")
    mid = s.blob(m, "id", HASH_LEN, exact=HASH_LEN)
    bits = s.blob(m, "bits", MAX_MANIFEST_BODY // HASH_LEN // 8 + 1)
    if n_chunks is not None and len(bits) != (n_chunks + 7) // 8:
        raise s.SchemaError("bitfield length does not match the manifest")
    return mid, bits


# -- gossip -----------------------------------------------------------------------------------------------
def announce(version: int, manifest_id: bytes) -> dict[str, Any]:
    return {"v": WIRE_VERSION, "t": "announce", "version": version, "id": manifest_id}


def parse_announce(m: dict[str, Any]) -> tuple[int, bytes]:
    s.expect_type(m, "announce")
    return s.integer(m, "version", 0, 1 << 40), s.blob(m, "id", HASH_LEN, exact=HASH_LEN)
