"""On-disk content-addressed store: chunks by blake3 hash, signed manifests, reassembled version model dirs.

Chunks are shared across versions (a chunk is stored once, whatever references it), every write is
verified and atomic (tmp + rename), so a node killed mid-download resumes with what it already has.

A version reaches a node by one of two routes (protocols/weights.py): ``full`` (all of its files' chunks) or
``patch`` (its parent's model dir, rebuilt already, plus the patch chunks and the other files' chunks). A
version *held* here is one whose chunks for some route are all present; a version *built* here has its model
dir in ``versions/v<N>`` (written only after every tensor of it matched its hash).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path

import msgpack
import numpy as np
from safetensors.numpy import load_file, save_file

from node.weights.encoding import decode_int8
from node.weights.hashes import digest, manifest_id
from node.weights.manifest import WEIGHTS_FILE, cut_ranges, weights_boundaries
from node.weights.patch import PatchError, TensorMismatch, WeightChanges, apply_patch
from protocols.errors import ProtocolError
from protocols.framing import unpack
from protocols.weights import ENCODINGS, MAX_MANIFEST_BODY, Manifest, SignedManifest

log = logging.getLogger(__name__)

ROUTES = ("full", "patch")
MAX_CHAIN = 1024  # links followed back to an anchor, at most


class BadChunk(ProtocolError):
    code = "bad_chunk"


class MissingChunk(FileNotFoundError):
    def __init__(self, h: bytes, what: str = "") -> None:
        super().__init__(f"chunk {h.hex()[:12]}{' of ' + what if what else ''} is not in the store")
        self.hash = h


class ChunkStore:
    def __init__(self, root: Path, observer: bool = False) -> None:
        """``observer``: another process looking at a live node's store (a test or a bench reading its progress):
        it must not sweep the node's writes in flight (a burner run's WAN test crashed a sampler that way)."""
        self.root = Path(root)
        self.chunk_dir = self.root / "chunks"
        self.manifest_dir = self.root / "manifests"
        self.versions_dir = self.root / "versions"
        for d in (self.chunk_dir, self.manifest_dir, self.versions_dir):
            d.mkdir(parents=True, exist_ok=True)
        if not observer:
            for stray in self.chunk_dir.glob("*/*.tmp"):  # a write cut short by a killed process
                stray.unlink(missing_ok=True)
        self._present: set[bytes] = {bytes.fromhex(p.name) for p in self.chunk_dir.glob("*/*") if len(p.name) == 64}
        self._manifests: dict[bytes, tuple[SignedManifest, Manifest]] = {}
        # bumped by every change of the chunks or manifests held: ``latest`` (every poll of a node asks it) is kept
        # for a generation, not recomputed over every chunk of every manifest
        self._generation = 0
        self._latest: dict[str | None, tuple[int, tuple[bytes, SignedManifest, Manifest] | None]] = {}
        for p in self.manifest_dir.glob("*.bin"):
            try:
                signed = SignedManifest.from_wire(unpack(p.read_bytes(), MAX_MANIFEST_BODY + 4096))
                self._manifests[manifest_id(signed)] = (signed, Manifest.from_body(signed.body))
            except ProtocolError:
                p.unlink()  # a damaged manifest file: forget it, it will be fetched again

    # -- chunks ------------------------------------------------------------------------------------------
    def _chunk_path(self, h: bytes) -> Path:
        hx = h.hex()
        return self.chunk_dir / hx[:2] / hx

    def has(self, h: bytes) -> bool:
        return h in self._present

    def size(self, h: bytes) -> int:
        """A held chunk's size in bytes (0 if it is not held)."""
        if h not in self._present:
            return 0
        try:
            return self._chunk_path(h).stat().st_size
        except FileNotFoundError:
            return 0

    def read(self, h: bytes) -> bytes | None:
        if h not in self._present:
            return None
        try:
            return self._chunk_path(h).read_bytes()
        except FileNotFoundError:
            self._present.discard(h)
            self._generation += 1
            return None

    def read_verified(self, h: bytes, what: str = "") -> bytes:
        """A chunk whose bytes still hash to ``h`` (one damaged on disk is dropped, to be fetched again)."""
        data = self.read(h)
        if data is None:
            raise MissingChunk(h, what)
        if digest(data) != h:
            self.drop(h)
            raise BadChunk(f"chunk {h.hex()[:12]} was damaged on disk; dropped, to be fetched again")
        return data

    def drop(self, h: bytes) -> None:
        self._present.discard(h)
        self._generation += 1
        self._chunk_path(h).unlink(missing_ok=True)

    def write(self, h: bytes, data: bytes) -> None:
        """Store a chunk after checking that its blake3 matches ``h``; a mismatch raises BadChunk."""
        if digest(data) != h:
            raise BadChunk(f"chunk {h.hex()[:12]} failed its blake3 check")
        self.put_hashed(h, data)

    def put_hashed(self, h: bytes, data: bytes) -> None:
        """Store a chunk whose hash this node computed itself (publishing); peers' chunks go through ``write``."""
        if h in self._present:
            return
        path = self._chunk_path(h)
        path.parent.mkdir(exist_ok=True)
        # a temporary name of its own: two threads may store the same chunk at once (an endgame duplicate arriving
        # beside the original); each rename then installs identical bytes
        tmp = path.with_name(f"{path.name}.{threading.get_ident()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        self._present.add(h)
        self._generation += 1

    def put_verified(self, chunks: dict[bytes, bytes]) -> None:
        for h, data in chunks.items():
            self.write(h, data)

    # -- manifests ---------------------------------------------------------------------------------------
    def add_manifest(self, signed: SignedManifest, manifest: Manifest) -> bytes:
        mid = manifest_id(signed)
        if mid not in self._manifests:
            tmp = self.manifest_dir / f"{mid.hex()}.tmp"
            tmp.write_bytes(msgpack.packb(signed.to_wire(), use_bin_type=True))
            os.replace(tmp, self.manifest_dir / f"{mid.hex()}.bin")
            self._manifests[mid] = (signed, manifest)
            self._generation += 1
        return mid

    def manifest(self, mid: bytes) -> tuple[SignedManifest, Manifest] | None:
        return self._manifests.get(mid)

    def manifests(self) -> list[tuple[bytes, Manifest]]:
        """Every manifest held, newest version first."""
        return sorted(((mid, m) for mid, (_, m) in self._manifests.items()), key=lambda x: -x[1].version)

    def latest(self, encoding: str | None = None) -> tuple[bytes, SignedManifest, Manifest] | None:
        """The newest version held (all chunks of one of its routes are here), in ``encoding`` if given; of a version
        held in several encodings, the most widely runnable (the first in ``ENCODINGS``: native before int8-grid)."""
        generation = self._generation  # taken first: a chunk stored meanwhile (a fetch thread) makes this one stale
        cached = self._latest.get(encoding)
        if cached is not None and cached[0] == generation:
            return cached[1]
        found = self._find_latest(encoding)
        self._latest[encoding] = (generation, found)
        return found

    def _find_latest(self, encoding: str | None) -> tuple[bytes, SignedManifest, Manifest] | None:
        complete = [
            (m.version, -ENCODINGS.index(m.encoding), mid)
            for mid, (_, m) in self._manifests.items()
            if (encoding is None or m.encoding == encoding) and self.complete(m)
        ]
        if not complete:
            return None
        mid = max(complete)[2]
        signed, m = self._manifests[mid]
        return mid, signed, m

    def route_chunks(self, manifest: Manifest, route: str) -> list[bytes]:
        """The chunks one route needs (empty if the version has no such route)."""
        if route == "full":
            return manifest.full_chunks()
        if route == "patch":
            return manifest.patch_chunks()
        raise ValueError(f"unknown route {route!r}")

    def missing(self, manifest: Manifest, route: str | None = None) -> list[bytes]:
        """Chunks not here: of one route, or (None) of every route."""
        chunks = manifest.all_chunks() if route is None else self.route_chunks(manifest, route)
        return [h for h in chunks if h not in self._present]

    def complete(self, manifest: Manifest) -> bool:
        """Whether every chunk of some route of this version is here."""
        return any(self.route_chunks(manifest, r) and not self.missing(manifest, r) for r in ROUTES)

    def bitfield(self, manifest: Manifest) -> bytes:
        chunks = manifest.all_chunks()
        bits = bytearray((len(chunks) + 7) // 8)
        for i, h in enumerate(chunks):
            if h in self._present:
                bits[i // 8] |= 0x80 >> (i % 8)
        return bytes(bits)

    # -- model dirs --------------------------------------------------------------------------------------
    def built(self, manifest: Manifest) -> Path | None:
        """The version's model dir, if it was built here (in the manifest's encoding)."""
        out = self.versions_dir / f"v{manifest.version}"
        return out if self._built_encoding(out) in ("", manifest.encoding) else None

    @staticmethod
    def _built_encoding(out: Path) -> str | None:
        """The encoding a model dir was built in ("": a dir from before encodings were recorded), None if unbuilt."""
        try:
            words = (out / ".complete").read_text().split()
        except FileNotFoundError:
            return None
        return words[1] if len(words) > 1 else ""

    def unbuild(self, version: int) -> None:
        """Forget a built model dir (its bits are suspect: a patch made against them did not verify)."""
        shutil.rmtree(self.versions_dir / f"v{version}", ignore_errors=True)

    def _write_files(self, manifest: Manifest, tmp: Path, skip: str | None = None) -> None:
        for f in manifest.files:
            if f.path == skip:
                continue
            with open(tmp / f.path, "wb") as fh:
                for h in f.chunks:
                    fh.write(self.read_verified(h, f.path))
            if (tmp / f.path).stat().st_size != f.size:
                raise BadChunk(f"{f.path} reassembled to the wrong size")

    def _finish(self, manifest: Manifest, tmp: Path) -> Path:
        out = self.versions_dir / f"v{manifest.version}"
        (tmp / ".complete").write_text(f"{manifest.version} {manifest.encoding}")
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
        return out

    def _staging(self, manifest: Manifest) -> Path:
        tmp = self.versions_dir / f"v{manifest.version}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        return tmp

    def assemble(self, manifest: Manifest) -> Path:
        """Write the version as an HF model directory (int8 weights are dequantized to fp32): from its full route,
        or, for a patch whose full route is not here, from its parent's model dir (built first if need be)."""
        out = self.built(manifest)
        if out is not None:
            return out
        if manifest.patch is not None and not (manifest.has_full and not self.missing(manifest, "full")):
            entry = self._manifests.get(manifest.patch.parent_id)
            if entry is None:
                raise FileNotFoundError(f"version {manifest.version}'s parent manifest is not in the store")
            self.assemble(entry[1])
            return self.build_patched(manifest, entry[1])[0]
        tmp = self._staging(manifest)
        self._write_files(manifest, tmp)
        if manifest.encoding == "int8":
            weights = load_file(str(tmp / WEIGHTS_FILE))
            save_file(
                {k: v.astype(np.float32) for k, v in decode_int8(weights).items()},
                str(tmp / WEIGHTS_FILE),
                metadata={"format": "pt"},
            )
        return self._finish(manifest, tmp)

    def build_patched(self, manifest: Manifest, parent: Manifest) -> tuple[Path, WeightChanges | None]:
        """Build the version from its built parent and its patch chunks: the other files from their chunks, the
        weights file by applying the patch to the parent's, every tensor checked against its hash. An anchor
        rebuilt this way also gets its full-route chunks stored (checked against the manifest), so this node can
        serve it whole to nodes that have no parent. Returns (model dir, changed positions)."""
        patch = manifest.patch
        if patch is None or parent.version != manifest.parent:
            raise PatchError(f"version {manifest.version} is not a patch of version {parent.version}")
        done = self.built(manifest)
        if done is not None:
            return done, None
        parent_dir = self.built(parent)
        if parent_dir is None:
            raise FileNotFoundError(f"version {parent.version} is not built here")
        blob = b"".join(self.read_verified(h, f"the patch of version {manifest.version}") for h in patch.chunks)
        tmp = self._staging(manifest)
        try:
            self._write_files(manifest, tmp, skip=WEIGHTS_FILE)
            changes = apply_patch(parent_dir / WEIGHTS_FILE, tmp / WEIGHTS_FILE, manifest, blob)
            if manifest.has_full:
                self._store_full_weights(manifest, tmp / WEIGHTS_FILE)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return self._finish(manifest, tmp), changes

    def _store_full_weights(self, manifest: Manifest, weights: Path) -> None:
        entry = next(f for f in manifest.files if f.path == WEIGHTS_FILE)
        start = min(t.offset for t in manifest.tensors)
        ranges = cut_ranges(entry.size, weights_boundaries(start, manifest.tensors), manifest.chunk_size)
        if len(ranges) != len(entry.chunks):
            return  # cut another way than this node cuts: it cannot re-serve the full route, nothing else lost
        with open(weights, "rb") as fh:
            for h, (a, b) in zip(entry.chunks, ranges, strict=True):
                fh.seek(a)
                piece = fh.read(b - a)
                if digest(piece) != h:
                    raise TensorMismatch(f"version {manifest.version}'s rebuilt weights differ from its full route")
                self.put_hashed(h, piece)

    # -- garbage collection ------------------------------------------------------------------------------------
    def chain_to_anchor(self, mid: bytes) -> list[bytes]:
        """The held versions from ``mid`` back to the newest anchor whose full route is here, newest first, or []
        when a link on the way is missing (then nothing older is needed to rebuild ``mid``'s successors)."""
        path = []
        for _ in range(MAX_CHAIN):
            entry = self._manifests.get(mid)
            if entry is None or not self.complete(entry[1]):
                return []
            m = entry[1]
            path.append(mid)
            if m.has_full and not self.missing(m, "full"):
                return path
            if m.patch is None:
                return []
            mid = m.patch.parent_id
        return []

    def gc(self, keep: int) -> int:
        """Keep the newest ``keep`` held versions, up to ``keep`` newer ones still arriving, and the chain of
        patches from the newest held version back to its anchor (what a node without a parent needs to reach
        the newest version: the anchor's full route and every patch after it); drop other manifests, every
        model dir but those of the newest ``keep`` held versions, and unreferenced chunks. (Counting incomplete
        versions against ``keep`` would let a burst of announcements delete the only version a restarted node
        could start from.) Each encoding's versions are a chain of their own, kept by these rules apart."""
        by_version = self.manifests()
        for encoding in {m.encoding for _, m in by_version}:
            self._gc_chain([(mid, m) for mid, m in by_version if m.encoding == encoding], keep)
        return self._drop_unreferenced()

    def _gc_chain(self, by_version: list[tuple[bytes, Manifest]], keep: int) -> None:
        complete = [mid for mid, m in by_version if self.complete(m)]
        newest_complete = self._manifests[complete[0]][1].version if complete else -1
        arriving = [mid for mid, m in by_version if m.version > newest_complete]
        window = set(complete[:keep])
        kept = window | set(arriving[:keep]) | set(self.chain_to_anchor(complete[0]) if complete else [])
        for mid, m in by_version:
            if mid in kept:
                if mid not in window and mid not in arriving:
                    self._unbuild_if_ours(m)
                continue
            (self.manifest_dir / f"{mid.hex()}.bin").unlink(missing_ok=True)
            self._unbuild_if_ours(m)
            del self._manifests[mid]
            self._generation += 1

    def _unbuild_if_ours(self, m: Manifest) -> None:
        """Drop version ``m.version``'s model dir, unless it holds that version in another encoding."""
        out = self.versions_dir / f"v{m.version}"
        if self._built_encoding(out) in (None, m.encoding):
            shutil.rmtree(out, ignore_errors=True)

    def _drop_unreferenced(self) -> int:
        referenced = {h for _, m in self._manifests.values() for h in m.all_chunks()}
        dropped = 0
        for h in list(self._present - referenced):
            self._chunk_path(h).unlink(missing_ok=True)
            self._present.discard(h)
            self._generation += 1
            dropped += 1
        return dropped
