"""Weights protocol: signed manifests, chunk requests, have-bitfields, and the gossip announcements.

A policy version is a checkpoint directory cut into content-addressed chunks (blake3, 32 bytes each).
The manifest lists every file's chunks in order and the weight file's tensor layout; the trainer signs
its msgpack body with its libp2p key. Bulk bytes never ride on gossip (gossipsub drops >1 MiB silently):
gossip carries only announcements and have-bitfields, chunks move over the direct request protocol.

A signed manifest travels (and is stored) as ``{v, t: "manifest", zbody, sig, key}``: ``sig`` signs the msgpack
body (node/weights/hashes.py; its blake3 is the manifest's id) and ``zbody`` is that body zlib-compressed (RFC 1950,
one complete stream, at most ``MAX_MANIFEST_BODY`` bytes inflated). Names, dtypes and shapes repeat from tensor to
tensor: a 1.5B int8-grid patch manifest is ~100 KB raw and ~36 KB compressed (a full version's, mostly chunk hashes,
153 -> 123 KB), what the trainer uploads once per version per sampler. ``body`` (uncompressed, as before) is still
read.

Manifest body, format 2 (format 1, without ``format``, tensor hashes or ``patch``, is still read):

- ``tensors[i].hash``: blake3 of tensor i's bytes in the version's ``model.safetensors`` (every tensor).
- ``encoding``: ``native`` (the learner's dtypes), ``int8`` (rowwise), ``int8-grid`` (MLX's 8-bit affine group
  codes, U8, with bf16 ``.scales``/``.biases`` per 64 elements, each group's grid frozen from its anchor:
  node/weights/grid.py) or ``int4-grid`` (the same at 4 bits, two codes a byte as MLX packs them). ``native`` and
  the grid encodings may carry a patch.
- ``patch`` (optional): the version as a sparse patch of its parent's weights file. A version reaches a node by
  one of two *routes*: ``full`` (every chunk of ``files``; only when ``files`` holds ``model.safetensors``: an
  *anchor*) or ``patch`` (the parent's weights file, rebuilt bit-exactly, plus ``patch.chunks`` and the other
  files' chunks). Its fields:
    ``parent_id``   the parent's manifest id (``parent`` is its version); the parent's weights file has the same
                    layout (tensor names, dtypes, shapes, offsets) and the same header bytes
    ``anchor``      the newest anchor version at or below this one
    ``codec``       how each stream is compressed: ``zlib`` (RFC 1950) or ``lzma`` (.xz container)
    ``size``        bytes of the patch blob, cut into ``chunks`` of ``chunk_size`` (content-addressed as any chunk)
    ``weights_size`` size of the rebuilt ``model.safetensors``; ``header_hash`` blake3 of its first
                    ``tensors[0].offset`` bytes (the safetensors header; the tensors tile the rest exactly)
    ``deltas``      one ``[tensor, changed, index_mode, index_len, value_len]`` per tensor whose bits changed,
                    in increasing tensor order; the blob is, for each in turn, its compressed index stream
                    (``index_len`` bytes) then its compressed value stream (``value_len`` bytes):
      index stream  ``index_mode`` 0: the changed element positions (flat, ascending) as LEB128 varints of the gaps
                    (first position, then each position minus the previous minus one); 1: a bitmap, one bit per
                    element, least significant bit first (when that is shorter)
      value stream  per changed position, LEB128 of zigzag(d), d = new bits - old bits of the element taken as
                    unsigned integers of the element's width modulo 2^width, as a signed integer of that width
  A rebuilt weights file is used only if its header and every tensor match their blake3 hashes.

Push (``PUSH_PROTOCOL_ID``, one stream carrying one message after another, each answered in order): the origin
sends the first copies of a small new version's chunks (its update route: the patch, or the whole version; at most
``MAX_PUSH_VERSION`` bytes) to its connected samplers as it announces the version, so no manifest, have or chunk
request round trip precedes them; each receiver relays the chunks the origin gave it to the others at once.

- ``push`` ``{id, chunks: [[hash, bytes], ...]}``: at most ``MAX_PUSH_CHUNKS`` chunks of manifest ``id``, at most
  ``MAX_PUSH_BYTES`` in all, each at most the manifest's ``chunk_size``. The origin's first push to a peer also
  carries ``manifest`` (the signed manifest, as a ``get_manifest`` reply) and ``plan``: ``peers`` (at most
  ``MAX_PUSH_PEERS`` peer ids, as bytes) and ``pieces`` (at most ``MAX_PUSH_PIECES`` indices into the manifest's
  ``all_chunks()``): piece ``k`` goes first to ``peers[k % len(peers)]``, who relays it to the other peers; an
  optional ``copies`` c (1 to ``len(peers)``, default 1): the origin, whose uplink is faster than the samplers',
  also sends piece ``k`` itself to ``peers[(k - j) % len(peers)]`` for j < c, and its relayer skips those.
- reply ``pushed`` ``{took}``: how many of the message's chunks were new here and stored.

A receiver takes a chunk only of a version it chases, checked against its blake3 (a bad one is a strike), and
only from the origin or from the peer the origin's plan names for that chunk: every other push is refused unread.

Encodings a node receives (``RECEIVED_ENCODINGS``): the trainer may publish each version in several encodings, each
its own signed manifest and chain (anchors, patches). A sampler says which one it runs with the optional
``encoding`` field (text, at most ``MAX_ENCODING_NAME`` characters, one of ``RECEIVED_ENCODINGS``) of its
``get_manifest`` requests for the newest version: the trainer answers the newest manifest in that encoding (the
newest ``native`` one until it has published one), and publishes that encoding while a connected sampler asks for
it (node/weights/encodings.py). It is a choice of what to receive, nothing else: no limit or trust depends on it.
An ``announce`` may carry its manifest's ``encoding`` too, so that nodes skip versions they do not run unfetched.

Polls for the newest manifest are conditional: a ``get_manifest`` for the newest may carry ``have`` (a 32-byte
manifest id: the newest this node already holds or chases); a peer whose answer would be that very manifest replies
``same`` (``{v, t: "same"}``, no other field) instead. Every sampler polls the trainer every few seconds as gossip's
backstop, and a manifest lists every chunk hash: ~130 KB at 1.5B parameters, ~450 KB at 7B, which 500 samplers
polling every 5 s would make 45 MB/s of the trainer's upload. A peer that does not know ``have`` answers the
manifest, as before.
"""

from __future__ import annotations

import lzma
import zlib
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import msgpack

from protocols import WIRE_VERSION
from protocols import schema as s
from protocols.errors import MalformedMessage
from protocols.weights_file import TensorEntry, element_width, tiling_problem

PROTOCOL_ID = "/swarmrl/weights/1.0.0"
HASH_LEN = 32
MAX_CHUNK_SIZE = 8 << 20
MAX_CHUNKS_PER_REQUEST = 8
MAX_MANIFEST_BODY = 8 << 20  # ~250k chunk hashes
MAX_REQUEST_FRAME = 1 << 16
MAX_REPLY_FRAME = MAX_CHUNKS_PER_REQUEST * MAX_CHUNK_SIZE + (1 << 16)
MAX_FILES = 64
MAX_TENSORS = 1 << 16
ENCODINGS = ("native", "int8", "fp32", "int8-grid", "int4-grid")  # "fp32": what "native" was called before bf16
PATCHED_ENCODINGS = ("native", "int8-grid", "int4-grid")  # MLX int8/int4 codes on a frozen grid (node/weights/grid.py)
GOSSIP_MAX = 1 << 16
# a map and a list per file and per tensor, and a list per patched tensor
MANIFEST_CONTAINERS = 2 * MAX_FILES + 3 * MAX_TENSORS + 32
SIGN_DOMAIN = b"swarmrl-manifest-v1:"
MANIFEST_ZLIB_LEVEL = 6  # a 1.5B int8-grid patch manifest: 100 KB -> 36 KB, 1.2 ms once; level 9: 35.9 KB, 2.9 ms
MANIFEST_FORMAT = 2
WEIGHTS_FILE = "model.safetensors"
PATCH_CODECS = ("zlib", "lzma")
PUSH_PROTOCOL_ID = "/swarmrl/weights/push/1.0.0"
MAX_PUSH_CHUNKS = 64  # chunks in one push message
MAX_PUSH_BYTES = 1 << 20  # chunk bytes in one push message (a chunk bigger than this is never pushed)
MAX_PUSH_PEERS = 64  # peers a plan names
MAX_PUSH_PIECES = 4096  # chunks a plan assigns
MAX_PUSH_VERSION = 32 << 20  # update bytes of the largest version pushed (larger ones are only requested)
MAX_PUSH_FRAME = MAX_MANIFEST_BODY + MAX_PUSH_BYTES + (1 << 17)  # the manifest, the chunks, the plan and framing
MAX_PUSH_REPLY = 1 << 10
PUSH_CONTAINERS = 2 * MAX_PUSH_CHUNKS + 16
INDEX_GAPS, INDEX_BITMAP = 0, 1
DEFAULT_ENCODING = "native"  # what every sampler can run and the trainer always publishes
RECEIVED_ENCODINGS = ("native", "int8-grid", "int4-grid")  # what a sampler may ask for (the trainer publishes no other)
MAX_ENCODING_NAME = 16


@dataclass(frozen=True)
class FileEntry:
    path: str
    size: int
    chunks: list[bytes]


@dataclass(frozen=True)
class TensorDelta:
    """One tensor's part of a patch: ``changed`` elements, their index stream (``index_mode``) and value stream."""

    tensor: int  # index into Manifest.tensors
    changed: int
    index_mode: int  # INDEX_GAPS or INDEX_BITMAP
    index_len: int  # compressed bytes
    value_len: int


@dataclass(frozen=True)
class PatchInfo:
    parent_id: bytes
    anchor: int
    codec: str
    size: int
    chunks: list[bytes]
    weights_size: int
    header_hash: bytes
    deltas: list[TensorDelta]


@dataclass(frozen=True)
class Manifest:
    swarm: str
    version: int
    parent: int  # -1 for the first version
    encoding: str  # how model.safetensors is stored: "native" (as published: bf16 or fp32), "int8" (rowwise) or
    # "int8-grid"/"int4-grid" (MLX's 8-/4-bit group codes on a grid frozen at the anchor: node/weights/grid.py)
    chunk_size: int
    files: list[FileEntry]
    tensors: list[TensorEntry]
    patch: PatchInfo | None = None  # the version as a sparse patch of its parent (format 2)

    @property
    def has_full(self) -> bool:
        """Whether the full route exists: the weights file's own chunks are listed (an anchor, or any version
        without a patch)."""
        return self.patch is None or any(f.path == WEIGHTS_FILE for f in self.files)

    @property
    def total_size(self) -> int:
        """Bytes of the whole version (its model dir), whichever route it travels by."""
        size = sum(f.size for f in self.files)
        return size if self.has_full or self.patch is None else size + self.patch.weights_size

    @property
    def update_size(self) -> int:
        """Bytes a node holding the parent fetches for this version (the patch, or everything)."""
        return self.patch.size if self.patch is not None else self.total_size

    def full_chunks(self) -> list[bytes]:
        """The full route's chunks: every file, in first-appearance order (empty when there is no full route)."""
        return list(dict.fromkeys(h for f in self.files for h in f.chunks)) if self.has_full else []

    def patch_chunks(self) -> list[bytes]:
        """The patch route's chunks: the patch blob and every file but the weights (empty without a patch)."""
        if self.patch is None:
            return []
        others = [h for f in self.files if f.path != WEIGHTS_FILE for h in f.chunks]
        return list(dict.fromkeys([*others, *self.patch.chunks]))

    def all_chunks(self) -> list[bytes]:
        """Every distinct chunk hash of every route, in first-appearance order (the have-bitfield's domain)."""
        patch = self.patch.chunks if self.patch is not None else []
        return list(dict.fromkeys([*(h for f in self.files for h in f.chunks), *patch]))

    def body(self) -> bytes:
        tensors = []
        for t in self.tensors:
            entry: dict[str, Any] = {
                "name": t.name,
                "dtype": t.dtype,
                "shape": t.shape,
                "offset": t.offset,
                "nbytes": t.nbytes,
            }
            if t.hash:
                entry["hash"] = t.hash
            tensors.append(entry)
        body: dict[str, Any] = {
            "v": WIRE_VERSION,
            "t": "manifest_body",
            "swarm": self.swarm,
            "version": self.version,
            "parent": self.parent,
            "encoding": self.encoding,
            "chunk_size": self.chunk_size,
            "total_size": self.total_size,
            "files": [{"path": f.path, "size": f.size, "chunks": f.chunks} for f in self.files],
            "tensors": tensors,
        }
        if self.patch is not None or any(t.hash for t in self.tensors):
            body["format"] = MANIFEST_FORMAT
        if self.patch is not None:
            p = self.patch
            body["patch"] = {
                "parent_id": p.parent_id,
                "anchor": p.anchor,
                "codec": p.codec,
                "size": p.size,
                "chunks": p.chunks,
                "weights_size": p.weights_size,
                "header_hash": p.header_hash,
                "deltas": [[d.tensor, d.changed, d.index_mode, d.index_len, d.value_len] for d in p.deltas],
            }
        return msgpack.packb(body, use_bin_type=True)

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
        fmt = s.integer(m, "format", 1, MANIFEST_FORMAT) if "format" in m else 1
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
                    s.blob(t, "hash", HASH_LEN, exact=HASH_LEN) if fmt >= 2 and "hash" in t else b"",
                )
            )
        encoding = s.text(m, "encoding", 16)
        if encoding not in ENCODINGS:
            raise s.SchemaError(f"unknown weight encoding {encoding!r}")
        version = s.integer(m, "version", 0, 1 << 40)
        parent = s.integer(m, "parent", -1, 1 << 40)
        patch = None
        if fmt >= 2 and "patch" in m:
            patch = _parse_patch(s.mapping(m, "patch"), version, parent, encoding, chunk_size, files, tensors)
        manifest = cls(
            swarm=s.text(m, "swarm", 64),
            version=version,
            parent=parent,
            encoding=encoding,
            chunk_size=chunk_size,
            files=files,
            tensors=tensors,
            patch=patch,
        )
        if s.integer(m, "total_size", 0, 1 << 44) != manifest.total_size:
            raise s.SchemaError("total_size does not match the files")
        return manifest


def _parse_patch(
    p: dict[str, Any],
    version: int,
    parent: int,
    encoding: str,
    chunk_size: int,
    files: list[FileEntry],
    tensors: list[TensorEntry],
) -> PatchInfo:
    """A manifest's patch section, checked against the manifest it belongs to."""
    if encoding not in PATCHED_ENCODINGS:
        raise s.SchemaError(f"{encoding} weights do not travel as patches")
    if not 0 <= parent < version:
        raise s.SchemaError("a patch needs an older parent version")
    codec = s.text(p, "codec", 16)
    if codec not in PATCH_CODECS:
        raise s.SchemaError(f"unknown patch codec {codec!r}")
    size = s.integer(p, "size", 0, 1 << 42)
    chunks = s.items(p, "chunks", MAX_MANIFEST_BODY // HASH_LEN)
    if not all(isinstance(h, bytes) and len(h) == HASH_LEN for h in chunks):
        raise s.SchemaError("patch chunk hashes must be 32-byte blake3 digests")
    if len(chunks) != -(-size // chunk_size):
        raise s.SchemaError("the patch's chunk count does not match its size")
    anchor = s.integer(p, "anchor", 0, version)
    weights_size = s.integer(p, "weights_size", 8, 1 << 42)
    full = next((f for f in files if f.path == WEIGHTS_FILE), None)
    if full is not None and full.size != weights_size:
        raise s.SchemaError("weights_size does not match the weights file")
    if full is not None and anchor != version:
        raise s.SchemaError("a version with a full route is its own anchor")
    if not tensors or not all(t.hash for t in tensors):
        raise s.SchemaError("a patched version needs a hash for every tensor")
    if tensors[0].offset < 8:
        raise s.SchemaError("tensors overlap the safetensors header")
    problem = tiling_problem(tensors, tensors[0].offset, weights_size)
    if problem is not None:
        raise s.SchemaError(f"tensors must tile the weights file in order: {problem}")
    deltas = []
    last, total = -1, 0
    for d in s.items(p, "deltas", len(tensors)):
        if not (isinstance(d, list) and len(d) == 5 and all(isinstance(x, int) and not isinstance(x, bool) for x in d)):
            raise s.SchemaError("a delta is [tensor, changed, index_mode, index_len, value_len]")
        delta = TensorDelta(*d)
        if not last < delta.tensor < len(tensors):
            raise s.SchemaError("deltas must name tensors in increasing order")
        t = tensors[delta.tensor]
        if element_width(t) is None:
            raise s.SchemaError(f"tensor {t.name!r} cannot be patched (element width)")
        if not 1 <= delta.changed <= t.numel or delta.index_mode not in (INDEX_GAPS, INDEX_BITMAP):
            raise s.SchemaError(f"bad delta for tensor {t.name!r}")
        if delta.index_len < 0 or delta.value_len < 0:
            raise s.SchemaError("negative stream length")
        total += delta.index_len + delta.value_len
        last = delta.tensor
        deltas.append(delta)
    if total != size:
        raise s.SchemaError("the deltas' streams do not add up to the patch size")
    return PatchInfo(
        parent_id=s.blob(p, "parent_id", HASH_LEN, exact=HASH_LEN),
        anchor=anchor,
        codec=codec,
        size=size,
        chunks=chunks,
        weights_size=weights_size,
        header_hash=s.blob(p, "header_hash", HASH_LEN, exact=HASH_LEN),
        deltas=deltas,
    )


@dataclass(frozen=True)
class SignedManifest:
    body: bytes
    signature: bytes
    public_key: bytes  # libp2p protobuf-serialized public key of the signer

    @cached_property
    def zbody(self) -> bytes:
        """The body as it travels: zlib (RFC 1950), computed once per manifest however many peers it goes to."""
        return zlib.compress(self.body, MANIFEST_ZLIB_LEVEL)

    def to_wire(self) -> dict[str, Any]:
        return {"v": WIRE_VERSION, "t": "manifest", "zbody": self.zbody, "sig": self.signature, "key": self.public_key}

    @classmethod
    def from_wire(cls, m: dict[str, Any]) -> SignedManifest:
        s.expect_type(m, "manifest")
        if "zbody" in m:
            body = inflate(s.blob(m, "zbody", MAX_MANIFEST_BODY), MAX_MANIFEST_BODY)
        else:  # as manifests travelled before zbody
            body = s.blob(m, "body", MAX_MANIFEST_BODY)
        return cls(body, s.blob(m, "sig", 256), s.blob(m, "key", 256))


def inflate(data: bytes, limit: int, codec: str = "zlib") -> bytes:
    """One complete ``codec`` stream (``zlib``: RFC 1950; ``lzma``: the .xz container) of at most ``limit`` bytes
    out (a bomb stops there): a manifest's ``zbody``, or a patch's streams (node/weights/patch.py)."""
    d = zlib.decompressobj() if codec == "zlib" else lzma.LZMADecompressor()
    try:
        out = d.decompress(data, limit + 1)
    except (zlib.error, lzma.LZMAError) as exc:
        raise s.SchemaError(f"undecodable {codec} stream: {exc}") from None
    if len(out) > limit or not d.eof or getattr(d, "unconsumed_tail", b"") or d.unused_data:
        raise s.SchemaError(f"{codec} stream inflates past {limit} bytes, or is truncated")
    return out


# -- requests (one request, one reply per stream) -------------------------------------------------------
def get_manifest(manifest_id: bytes | None, encoding: str | None = None, have: bytes | None = None) -> dict[str, Any]:
    """Ask for a manifest by id, or (None) for the newest one the peer holds, in ``encoding`` if given (the one the
    asking sampler runs), answered ``same`` if it is ``have``."""
    out: dict[str, Any] = {"v": WIRE_VERSION, "t": "get_manifest", "id": manifest_id or b""}
    if encoding is not None:
        out["encoding"] = encoding
    if have is not None and manifest_id is None:
        out["have"] = have
    return out


def parse_have_id(m: dict[str, Any]) -> bytes | None:
    """The manifest id a poll for the newest says it holds already (None: it names none)."""
    return s.blob(m, "have", HASH_LEN, exact=HASH_LEN) if "have" in m else None


def same_reply() -> dict[str, Any]:
    """The answer to a poll whose ``have`` is the newest manifest here."""
    return {"v": WIRE_VERSION, "t": "same"}


def is_same(m: dict[str, Any]) -> bool:
    return m.get("t") == "same"


def parse_encoding(m: dict[str, Any], allowed: tuple[str, ...] = RECEIVED_ENCODINGS) -> str | None:
    """The optional ``encoding`` a message names (None: none named); one outside ``allowed`` is an error (a
    request may name ``RECEIVED_ENCODINGS``, an announcement any manifest's ``ENCODINGS``)."""
    if "encoding" not in m:
        return None
    encoding = s.text(m, "encoding", MAX_ENCODING_NAME)
    if encoding not in allowed:
        raise s.SchemaError(f"unknown encoding {encoding!r} (known: {', '.join(allowed)})")
    return encoding


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
def announce(version: int, manifest_id: bytes, encoding: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"v": WIRE_VERSION, "t": "announce", "version": version, "id": manifest_id}
    if encoding is not None:
        out["encoding"] = encoding
    return out


def parse_announce(m: dict[str, Any]) -> tuple[int, bytes]:
    s.expect_type(m, "announce")
    return s.integer(m, "version", 0, 1 << 40), s.blob(m, "id", HASH_LEN, exact=HASH_LEN)


# -- push (see the module docstring) ----------------------------------------------------------------------
@dataclass(frozen=True)
class PushPlan:
    """Who gets each pushed chunk first from the origin: ``pieces[k]`` (an index into ``all_chunks()``) goes to
    ``peers[k % len(peers)]``, which relays it to the others; with ``copies`` c > 1 the origin also sends it itself
    to the c - 1 peers before that one in ``peers`` (cyclically), and its relayer skips them."""

    peers: list[bytes]
    pieces: list[int]
    copies: int = 1

    def first_holder(self) -> dict[int, bytes]:
        """Chunk index -> the peer (id bytes) the origin sends it to first."""
        return {i: self.peers[k % len(self.peers)] for k, i in enumerate(self.pieces)}

    def from_origin(self) -> dict[int, frozenset[bytes]]:
        """Chunk index -> every peer (id bytes) the origin sends it to itself (its first holder among them)."""
        n = len(self.peers)
        return {
            i: frozenset(self.peers[(k - j) % n] for j in range(min(self.copies, n))) for k, i in enumerate(self.pieces)
        }


@dataclass(frozen=True)
class Push:
    mid: bytes
    chunks: list[tuple[bytes, bytes]]
    manifest: SignedManifest | None = None  # the origin's first push to a peer
    plan: PushPlan | None = None


def push(
    mid: bytes,
    chunks: list[tuple[bytes, bytes]],
    manifest: SignedManifest | None = None,
    plan: PushPlan | None = None,
) -> dict[str, Any]:
    out: dict[str, Any] = {"v": WIRE_VERSION, "t": "push", "id": mid, "chunks": [[h, d] for h, d in chunks]}
    if manifest is not None:
        out["manifest"] = manifest.to_wire()
    if plan is not None:
        out["plan"] = {"peers": plan.peers, "pieces": plan.pieces}
        if plan.copies != 1:
            out["plan"]["copies"] = plan.copies
    return out


def parse_push(m: dict[str, Any]) -> Push:
    """A push message, bounded (its chunks are checked against the manifest and their hashes by the receiver)."""
    s.expect_type(m, "push")
    chunks: list[tuple[bytes, bytes]] = []
    total = 0
    for item in s.items(m, "chunks", MAX_PUSH_CHUNKS):
        if not (isinstance(item, list) and len(item) == 2 and all(isinstance(x, bytes) for x in item)):
            raise s.SchemaError("pushed chunks must be [hash, data]")
        if len(item[0]) != HASH_LEN:
            raise s.SchemaError("chunk hashes must be 32-byte digests")
        total += len(item[1])
        chunks.append((item[0], item[1]))
    if total > MAX_PUSH_BYTES:
        raise s.SchemaError(f"a push carries at most {MAX_PUSH_BYTES} chunk bytes")
    manifest = SignedManifest.from_wire(s.mapping(m, "manifest")) if "manifest" in m else None
    plan = None
    if "plan" in m:
        p = s.mapping(m, "plan")
        peers = s.items(p, "peers", MAX_PUSH_PEERS, min_len=1)
        if not all(isinstance(x, bytes) and 0 < len(x) <= 128 for x in peers):
            raise s.SchemaError("plan peers must be peer ids")
        copies = s.integer(p, "copies", 1, len(peers)) if "copies" in p else 1
        plan = PushPlan(peers, s.int_list(p, "pieces", MAX_PUSH_PIECES, 0, MAX_MANIFEST_BODY // HASH_LEN), copies)
    return Push(s.blob(m, "id", HASH_LEN, exact=HASH_LEN), chunks, manifest, plan)


def pushed_reply(took: int) -> dict[str, Any]:
    return {"v": WIRE_VERSION, "t": "pushed", "took": took}


def parse_pushed(m: dict[str, Any]) -> int:
    s.expect_type(m, "pushed")
    return s.integer(m, "took", 0, MAX_PUSH_CHUNKS)
