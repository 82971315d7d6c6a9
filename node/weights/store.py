"""On-disk content-addressed store: chunks by blake3 hash, signed manifests, reassembled version model dirs.

Chunks are shared across versions (a chunk is stored once, whatever references it), every write is
verified and atomic (tmp + rename), so a node killed mid-download resumes with what it already has.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import msgpack
import numpy as np
from safetensors.numpy import load_file, save_file

from node.weights.encoding import decode_int8
from node.weights.manifest import WEIGHTS_FILE, chunk_hash, manifest_id
from protocols.errors import ProtocolError
from protocols.framing import unpack
from protocols.weights import MAX_MANIFEST_BODY, Manifest, SignedManifest


class BadChunk(ProtocolError):
    code = "bad_chunk"


class ChunkStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.chunk_dir = self.root / "chunks"
        self.manifest_dir = self.root / "manifests"
        self.versions_dir = self.root / "versions"
        for d in (self.chunk_dir, self.manifest_dir, self.versions_dir):
            d.mkdir(parents=True, exist_ok=True)
        self._present: set[bytes] = {bytes.fromhex(p.name) for p in self.chunk_dir.glob("*/*") if len(p.name) == 64}
        self._manifests: dict[bytes, tuple[SignedManifest, Manifest]] = {}
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
            return None

    def write(self, h: bytes, data: bytes) -> None:
        """Store a chunk after checking that its blake3 matches ``h``; a mismatch raises BadChunk."""
        if chunk_hash(data) != h:
            raise BadChunk(f"chunk {h.hex()[:12]} failed its blake3 check")
        self.put_hashed(h, data)

    def put_hashed(self, h: bytes, data: bytes) -> None:
        """Store a chunk whose hash this node computed itself (publishing); peers' chunks go through ``write``."""
        if h in self._present:
            return
        path = self._chunk_path(h)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        self._present.add(h)

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
        return mid

    def manifest(self, mid: bytes) -> tuple[SignedManifest, Manifest] | None:
        return self._manifests.get(mid)

    def latest(self) -> tuple[bytes, SignedManifest, Manifest] | None:
        """The newest version whose chunks are all here."""
        complete = [(m.version, mid) for mid, (_, m) in self._manifests.items() if not self.missing(m)]
        if not complete:
            return None
        mid = max(complete)[1]
        signed, m = self._manifests[mid]
        return mid, signed, m

    def missing(self, manifest: Manifest) -> list[bytes]:
        return [h for h in manifest.all_chunks() if h not in self._present]

    def bitfield(self, manifest: Manifest) -> bytes:
        chunks = manifest.all_chunks()
        bits = bytearray((len(chunks) + 7) // 8)
        for i, h in enumerate(chunks):
            if h in self._present:
                bits[i // 8] |= 0x80 >> (i % 8)
        return bytes(bits)

    # -- model dirs --------------------------------------------------------------------------------------
    def assemble(self, manifest: Manifest) -> Path:
        """Write the version as an HF model directory (int8 weights are dequantized to fp32)."""
        out = self.versions_dir / f"v{manifest.version}"
        if (out / ".complete").exists():
            return out
        tmp = self.versions_dir / f"v{manifest.version}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        for f in manifest.files:
            with open(tmp / f.path, "wb") as fh:
                for h in f.chunks:
                    data = self.read(h)
                    if data is None:
                        raise FileNotFoundError(f"chunk {h.hex()[:12]} of {f.path} is not in the store")
                    fh.write(data)
            if (tmp / f.path).stat().st_size != f.size:
                raise BadChunk(f"{f.path} reassembled to the wrong size")
        if manifest.encoding == "int8":
            weights = load_file(str(tmp / WEIGHTS_FILE))
            save_file(
                {k: v.astype(np.float32) for k, v in decode_int8(weights).items()},
                str(tmp / WEIGHTS_FILE),
                metadata={"format": "pt"},
            )
        (tmp / ".complete").write_text(str(manifest.version))
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
        return out

    def gc(self, keep: int) -> int:
        """Keep the newest ``keep`` complete versions, and up to ``keep`` newer ones still arriving; drop other
        manifests, their model dirs and unreferenced chunks. (Counting incomplete versions against ``keep``
        would let a burst of announcements delete the only version a restarted node could start from.)"""
        by_version = sorted(self._manifests.items(), key=lambda kv: kv[1][1].version, reverse=True)
        complete = [mid for mid, (_, m) in by_version if not self.missing(m)]
        newest_complete = self._manifests[complete[0]][1].version if complete else -1
        arriving = [mid for mid, (_, m) in by_version if m.version > newest_complete]
        kept = set(complete[:keep]) | set(arriving[:keep])
        for mid, (_, m) in by_version:
            if mid in kept:
                continue
            (self.manifest_dir / f"{mid.hex()}.bin").unlink(missing_ok=True)
            shutil.rmtree(self.versions_dir / f"v{m.version}", ignore_errors=True)
            del self._manifests[mid]
        return self._drop_unreferenced()

    def _drop_unreferenced(self) -> int:
        referenced = {h for _, m in self._manifests.values() for h in m.all_chunks()}
        dropped = 0
        for h in list(self._present - referenced):
            self._chunk_path(h).unlink(missing_ok=True)
            self._present.discard(h)
            dropped += 1
        return dropped
