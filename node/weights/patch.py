"""Versions as sparse patches of their parent's weights file: which element bits changed, and how they changed.

numpy and the stdlib only (samplers import no torch). Every tensor is compared as unsigned integers of its element
width (a bf16 weight is its 16 bits), so a patch is exact by construction, whatever the dtype. The wire format is
specified in protocols/weights.py; in short, per changed tensor:

- index stream: the changed positions as LEB128 varints of the gaps between them, or a bitmap when that is shorter
  (dense changes, e.g. a high learning rate);
- value stream: LEB128 of zigzag(new bits - old bits), signed modulo 2^width. An RL step moves a bf16 weight by one
  or two units in the last place, so most values are one byte with a handful of distinct values;
- each stream compressed on its own (zlib by default, lzma optional), so the compressor sees like with like.

``build_patch`` runs on the trainer (parent file vs new file, read a block at a time, the patch spooled to disk);
``apply_patch`` on a sampler: copy the parent's file, write the changed elements in place, then check the header
and EVERY tensor against the manifest's blake3 hashes before anything uses the result.
"""

from __future__ import annotations

import lzma
import shutil
import tempfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from node.weights.hashes import digest, hash_weights, hasher
from protocols.errors import ProtocolError, SchemaError
from protocols.weights import (
    INDEX_BITMAP,
    INDEX_GAPS,
    PATCH_CODECS,
    Manifest,
    TensorDelta,
    inflate,
)
from protocols.weights_file import LayoutError, TensorEntry, element_width, read_layout, read_span

BLOCK = 1 << 16  # elements diffed at a time (a multiple of 8): a dense block costs ~90 bytes each in temporaries
COMPRESS_PIECE = 1 << 20  # raw bytes fed to a compressor at a time
UINTS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
INTS = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
ZLIB_LEVEL = 6
PROJECTION_MARGIN = 1.25  # give up on a patch whose first tenth, extrapolated, is this far over the budget
LZMA_PRESET = 6


class PatchError(ProtocolError):
    """A patch that cannot be applied: its parent's bits are not the ones it was made against, or its data is
    malformed. Nothing built from it is used."""

    code = "bad_patch"


class TensorMismatch(PatchError):
    """The rebuilt file does not hash to what the signed manifest says (a wrong parent, or a corrupted file)."""

    code = "tensor_mismatch"


@dataclass
class WeightChanges:
    """What changed from version ``base`` to ``version``: flat element positions per tensor name (ascending)."""

    base: int
    version: int
    indices: dict[str, np.ndarray] = field(default_factory=dict)

    def count(self) -> int:
        return sum(len(v) for v in self.indices.values())

    def then(self, later: WeightChanges) -> WeightChanges:
        """These changes followed by ``later`` (which must start where these end)."""
        if later.base != self.version:
            raise ValueError("changes do not chain")
        merged = dict(self.indices)
        for name, idx in later.indices.items():
            merged[name] = np.union1d(merged[name], idx) if name in merged else idx
        return WeightChanges(self.base, later.version, merged)


@dataclass
class BuiltPatch:
    """A patch built by ``build_patch``: its blob lives in an unnamed temporary file (``close`` drops it)."""

    spool: BinaryIO  # the patch blob: indices and values of every changed tensor, in layout order
    size: int
    deltas: list[TensorDelta]
    header_hash: bytes
    weights_size: int
    hashes: list[bytes]  # blake3 of every tensor of the new file, in layout order
    changed: int  # elements changed in all
    elements: int  # elements in all

    @property
    def blob(self) -> bytes:
        self.spool.seek(0)
        return self.spool.read(self.size)

    def pieces(self, ranges: list[tuple[int, int]]) -> Iterator[bytes]:
        """The blob's bytes in each of ``ranges``, read one range at a time."""
        for a, b in ranges:
            self.spool.seek(a)
            piece = self.spool.read(b - a)
            if len(piece) != b - a:
                raise PatchError("the patch's spool file is shorter than the patch")
            yield piece

    def close(self) -> None:
        self.spool.close()


# -- layouts ---------------------------------------------------------------------------------------------------
def same_layout(a: list[TensorEntry], b: list[TensorEntry]) -> bool:
    key = lambda t: (t.name, t.dtype, list(t.shape), t.offset, t.nbytes)  # noqa: E731
    return len(a) == len(b) and all(key(x) == key(y) for x, y in zip(a, b, strict=True))


# -- varints --------------------------------------------------------------------------------------------------
LEB128_BLOCK = 1 << 18  # values encoded at once: the vectorised encoder's temporaries are ~50 bytes per value


def leb128_encode(values: np.ndarray) -> bytes:
    """Unsigned LEB128 of every value (uint64), concatenated; vectorised, a block of values at a time (one pass
    over a 3M-element tensor held ~160 MB of temporaries at once: at the trainer's peak, beside training)."""
    v = np.ascontiguousarray(values, dtype=np.uint64)
    if v.size <= LEB128_BLOCK:
        return _leb128_block(v)
    return b"".join(_leb128_block(v[a : a + LEB128_BLOCK]) for a in range(0, v.size, LEB128_BLOCK))


def _leb128_block(v: np.ndarray) -> bytes:
    if v.size == 0:
        return b""
    top = int(v.max())
    if top < 0x80:
        return v.astype(np.uint8).tobytes()
    nbytes = np.ones(v.size, dtype=np.int8)
    for k in range(1, (top.bit_length() + 6) // 7):
        nbytes += v >= np.uint64(1) << np.uint64(7 * k)
    nbytes = nbytes.astype(np.int64)
    ends = np.cumsum(nbytes)
    starts = ends - nbytes
    out = np.empty(int(ends[-1]), dtype=np.uint8)
    for k in range(int(nbytes.max())):
        sel = nbytes > k
        part = (v[sel] >> np.uint64(7 * k)) & np.uint64(0x7F)
        more = (nbytes[sel] > k + 1).astype(np.uint64) << np.uint64(7)
        out[starts[sel] + k] = (part | more).astype(np.uint8)
    return out.tobytes()


def leb128_decode(data: bytes, count: int, max_bytes: int = 10) -> np.ndarray:
    """Exactly ``count`` LEB128 values (uint64) filling ``data``; each at most ``max_bytes`` long."""
    b = np.frombuffer(data, dtype=np.uint8)
    if count == 0:
        if b.size:
            raise PatchError("trailing bytes after the varints")
        return np.zeros(0, dtype=np.uint64)
    if b.size == 0 or b[-1] >= 0x80:
        raise PatchError("truncated varint stream")
    if b.size == count:  # all single bytes (then all are < 0x80, as there are ``count`` ends at most)
        if b.max() >= 0x80:
            raise PatchError(f"expected {count} varints")
        return b.astype(np.uint64)
    ends = np.flatnonzero(b < 0x80)
    if ends.size != count:
        raise PatchError(f"expected {count} varints, found {ends.size}")
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lengths = ends - starts + 1
    if lengths.max() > max_bytes:
        raise PatchError("varint too long")
    group = np.repeat(np.arange(count), lengths)
    k = np.arange(b.size) - starts[group]
    if max_bytes == 10 and np.any((lengths == 10) & (b[ends] > 1)):
        raise PatchError("varint overflows 64 bits")
    parts = (b & 0x7F).astype(np.uint64) << (7 * k).astype(np.uint64)
    return np.bitwise_or.reduceat(parts, starts)


def encode_values(d: np.ndarray) -> bytes:
    """The value stream's raw bytes: LEB128 of zigzag(d), a block at a time (the same bytes as in one pass)."""
    return b"".join(leb128_encode(zigzag(d[a : a + LEB128_BLOCK])) for a in range(0, d.size, LEB128_BLOCK))


def zigzag(d: np.ndarray) -> np.ndarray:
    d = d.astype(np.int64)
    return ((d << np.int64(1)) ^ (d >> np.int64(63))).view(np.uint64)


def unzigzag(u: np.ndarray) -> np.ndarray:
    u = u.astype(np.uint64)
    return ((u >> np.uint64(1)) ^ (np.uint64(0) - (u & np.uint64(1)))).view(np.int64)


# -- compression ------------------------------------------------------------------------------------------------
def compressor(codec: str) -> Any:
    """A streaming compressor (``compress`` then ``flush``) for one patch stream."""
    if codec == "zlib":
        return zlib.compressobj(ZLIB_LEVEL)
    if codec == "lzma":
        return lzma.LZMACompressor(preset=LZMA_PRESET)
    raise ValueError(f"unknown patch codec {codec!r}")


def decompress(codec: str, data: bytes, limit: int) -> bytes:
    """At most ``limit`` bytes out of ``data`` (a bomb stops there), which must be one complete stream."""
    if codec not in PATCH_CODECS:
        raise PatchError(f"unknown patch codec {codec!r}")
    try:
        return inflate(data, limit, codec)
    except SchemaError as exc:  # a patch's stream: what its delta allows, or truncated
        raise PatchError(str(exc)) from None


# -- one tensor -----------------------------------------------------------------------------------------------------
def decode_indices(mode: int, raw: bytes, changed: int, numel: int) -> np.ndarray:
    if mode == INDEX_GAPS:
        gaps = leb128_decode(raw, changed, 6)  # positions below 2^42
        idx = np.cumsum(gaps.astype(np.int64) + 1) - 1
    elif mode == INDEX_BITMAP:
        bm = np.frombuffer(raw, dtype=np.uint8)
        if bm.size != (numel + 7) // 8:
            raise PatchError("bitmap length does not match the tensor")
        nz = np.flatnonzero(bm)
        bits = np.unpackbits(bm[nz][:, None], axis=1, bitorder="little").astype(bool)
        idx = (nz[:, None] * 8 + np.arange(8))[bits]
        if idx.size != changed:
            raise PatchError("bitmap does not hold the announced number of changes")
    else:
        raise PatchError(f"unknown index mode {mode}")
    if idx.size and (idx[0] < 0 or idx[-1] >= numel):
        raise PatchError("changed position outside the tensor")
    return idx


def index_limit(mode: int, changed: int, numel: int) -> int:
    return 6 * changed if mode == INDEX_GAPS else (numel + 7) // 8


def value_limit(width: int, changed: int) -> int:
    return -(-8 * width // 7) * changed


# -- whole files ----------------------------------------------------------------------------------------------------
class OverBudget(Exception):
    """The patch grew past the size it was allowed (it would travel as an anchor anyway): building stopped early."""


class _Spools:
    """Where a patch is built, off the heap (it runs beside training: a dense patch near its budget held in memory
    was ~0.3 bytes per parameter of an fp32 model at the trainer's peak). ``out`` is the blob; one tensor's raw
    streams go to ``gaps``, ``bitmap`` and ``values`` before the shorter index form and the values are compressed,
    one stream at a time, into ``out``. Unnamed temporary files: the OS drops them however building ends."""

    def __init__(self, where: Path) -> None:
        self.out, self.gaps, self.bitmap, self.values = (tempfile.TemporaryFile(dir=where) for _ in range(4))

    def reset(self) -> None:
        for f in (self.gaps, self.bitmap, self.values):
            f.seek(0)
            f.truncate()

    def close(self, keep_out: bool = False) -> None:
        for f in (self.gaps, self.bitmap, self.values) if keep_out else (self.out, self.gaps, self.bitmap, self.values):
            f.close()


def _compress_into(codec: str, src: BinaryIO, out: BinaryIO, room: int | None) -> int:
    """Compress all of ``src`` (read from its start, a piece at a time) onto ``out``; the compressed length. Raises
    OverBudget as soon as the output passes ``room`` bytes."""
    c = compressor(codec)
    src.seek(0)
    written = 0
    while piece := src.read(COMPRESS_PIECE):
        written += out.write(c.compress(piece))
        if room is not None and written > room:
            raise OverBudget(f"over the budget within a stream of {src.tell()} raw bytes")
    return written + out.write(c.flush())


def _blocks(old_f: BinaryIO, new_f: BinaryIO, t: TensorEntry, width: int, bufs: tuple[np.ndarray, np.ndarray]):
    """(first element, old, new) of each block of ``BLOCK`` elements of tensor ``t``: views of two reused buffers,
    read from the two files (each tensor once; never a whole tensor in memory)."""
    step = BLOCK * width
    for a in range(0, t.nbytes, step):
        n = min(step, t.nbytes - a)
        views = []
        for f, buf in zip((old_f, new_f), bufs, strict=True):
            views.append(read_span(f, t.offset + a, n, buf[:n]))
        yield a // width, views[0], views[1]


def _diff_tensor(
    old_f: BinaryIO, new_f: BinaryIO, t: TensorEntry, width: int | None, bufs, spools: _Spools
) -> tuple[bytes, int] | None:
    """One tensor, a block at a time: (blake3 of its new bytes, elements changed), its raw gap, bitmap and value
    streams written to ``spools``; None if a tensor that cannot be patched (no element width) changed."""
    h = hasher(t.nbytes)
    if width is None:
        for _, o, n in _blocks(old_f, new_f, t, 1, bufs):
            h.update(n)
            if not np.array_equal(o, n):
                return None
        return h.digest(), 0
    u, signed = UINTS[width], INTS[width]
    changed, last = 0, -1  # the last changed position so far (gaps run across blocks)
    for first, o_bytes, n_bytes in _blocks(old_f, new_f, t, width, bufs):
        h.update(n_bytes)
        o, n = o_bytes.view(u), n_bytes.view(u)
        differs = o != n
        spools.bitmap.write(np.packbits(differs, bitorder="little").tobytes())  # BLOCK is a multiple of 8
        hit = np.flatnonzero(differs)
        del differs
        if hit.size == 0:
            continue
        d = (n[hit] - o[hit]).view(signed).astype(np.int64)  # wraps modulo 2^width: exact both ways
        spools.values.write(encode_values(d))
        del d
        hit += first
        gaps = np.diff(hit, prepend=last) - 1
        last = int(hit[-1])
        changed += hit.size
        del hit
        spools.gaps.write(leb128_encode(gaps.astype(np.uint64)))
    return h.digest(), changed


def build_patch(old_path: Path, new_path: Path, codec: str = "zlib", budget: int | None = None) -> BuiltPatch | None:
    """The patch from ``old_path`` to ``new_path`` (safetensors files), or None when they cannot be patched one into
    the other (another layout or header, a malformed weights file, or a changed tensor of an unsupported element
    width). Raises OverBudget as soon as the patch exceeds ``budget`` bytes (dense changes, e.g. fp32 weights: no need
    to diff the rest), or once a tenth of the weights is diffed and the patch so far, extrapolated to the whole file,
    would exceed 1.25 x ``budget`` (diffing and compressing a dense 300M-parameter fp32 version took ~100 s on this
    2-core box).

    It runs beside training, so it holds little: both files are read a block at a time into two reused buffers, and
    the patch is built in temporary files next to ``new_path`` (a few block-sized arrays on the heap, whatever the
    model's size or the patch's)."""
    if BLOCK % 8:
        raise ValueError("BLOCK must be a multiple of 8 (each block's bitmap is whole bytes)")
    try:  # each checked to tile its file exactly (header + tensors = every byte)
        old_head, old_tensors = read_layout(old_path)
        new_head, new_tensors = read_layout(new_path)
    except LayoutError:
        return None
    old_size, new_size = Path(old_path).stat().st_size, Path(new_path).stat().st_size
    if old_head != new_head or not same_layout(old_tensors, new_tensors) or old_size != new_size or not new_tensors:
        return None
    most = max(w or 1 for w in map(element_width, new_tensors))
    bufs = (np.empty(BLOCK * most, dtype=np.uint8), np.empty(BLOCK * most, dtype=np.uint8))
    spools = _Spools(Path(new_path).parent)
    done = False
    try:
        with open(old_path, "rb") as old_f, open(new_path, "rb") as new_f:
            deltas: list[TensorDelta] = []
            hashes: list[bytes] = []
            changed = elements = size = diffed = 0
            total = sum(t.nbytes for t in new_tensors)
            for i, t in enumerate(new_tensors):
                spools.reset()
                width = element_width(t)
                result = _diff_tensor(old_f, new_f, t, width, bufs, spools)
                if result is None:
                    return None
                hashes.append(result[0])
                n_changed = result[1]
                diffed += t.nbytes
                elements += t.numel
                if n_changed:
                    room = None if budget is None else budget - size
                    # the index stream: gap varints, or the bitmap when that is shorter (dense changes)
                    mode = INDEX_GAPS if spools.gaps.tell() <= spools.bitmap.tell() else INDEX_BITMAP
                    index = spools.gaps if mode == INDEX_GAPS else spools.bitmap
                    idx_len = _compress_into(codec, index, spools.out, room)
                    val_len = _compress_into(codec, spools.values, spools.out, None if room is None else room - idx_len)
                    deltas.append(TensorDelta(i, n_changed, mode, idx_len, val_len))
                    changed += n_changed
                    size += idx_len + val_len
                if budget is not None and size > budget:
                    raise OverBudget(f"over {budget} bytes after {i + 1} of {len(new_tensors)} tensors")
                if budget is not None and diffed >= total / 10 and size * total / diffed > PROJECTION_MARGIN * budget:
                    share = f"{100 * diffed / total:.0f}%"
                    raise OverBudget(f"{size} bytes for {share} of the weights: ~{size * total // diffed} in all")
        built = BuiltPatch(spools.out, size, deltas, digest(new_head), new_size, hashes, changed, elements)
        done = True
        return built
    finally:
        spools.close(keep_out=done)


def apply_patch(parent_path: Path, out_path: Path, manifest: Manifest, blob: bytes) -> WeightChanges:
    """Write ``manifest``'s weights file to ``out_path``: ``parent_path`` (its parent's) with the patch ``blob``
    applied, then check the header and every tensor against the manifest's hashes (TensorMismatch if any differs).
    Returns the changed positions per tensor."""
    patch = manifest.patch
    if patch is None:
        raise PatchError(f"version {manifest.version} is not a patch")
    if len(blob) != patch.size:
        raise PatchError("patch blob has the wrong size")
    if Path(parent_path).stat().st_size != patch.weights_size:
        raise TensorMismatch("the parent's weights file has another size than the patch expects")
    try:
        head, layout = read_layout(parent_path)
    except LayoutError as exc:  # its bits are not the ones the patch was made against
        raise TensorMismatch(f"the parent's weights file is unreadable: {exc}") from None
    if not same_layout(layout, manifest.tensors):
        raise TensorMismatch("the parent's weights file has another layout than the patch expects")
    if digest(head) != patch.header_hash:
        raise TensorMismatch("the parent's safetensors header differs from the patch's")
    out_path = Path(out_path)
    tmp = out_path.with_name(out_path.name + ".tmp")
    shutil.copyfile(parent_path, tmp)
    changes = WeightChanges(manifest.parent, manifest.version)
    mm = np.memmap(tmp, dtype=np.uint8, mode="r+")
    try:
        pos = 0
        for delta in patch.deltas:
            t = manifest.tensors[delta.tensor]
            width = element_width(t)
            if width is None:  # the schema refuses these; never trust that alone
                raise PatchError(f"tensor {t.name!r} cannot be patched")
            a, b = pos, pos + delta.index_len
            c = b + delta.value_len
            pos = c
            raw_idx = decompress(patch.codec, blob[a:b], index_limit(delta.index_mode, delta.changed, t.numel))
            idx = decode_indices(delta.index_mode, raw_idx, delta.changed, t.numel)
            raw_val = decompress(patch.codec, blob[b:c], value_limit(width, delta.changed))
            d = unzigzag(leb128_decode(raw_val, delta.changed, -(-8 * width // 7)))
            u = UINTS[width]
            view = mm[t.offset : t.offset + t.nbytes].view(u)
            view[idx] = view[idx] + d.astype(INTS[width]).view(u)  # unsigned: wraps modulo 2^width
            changes.indices[t.name] = idx
        mm.flush()
        header_hash, hashes = hash_weights(tmp, manifest.tensors)
    finally:
        del mm
    bad = [t.name for t, h in zip(manifest.tensors, hashes, strict=True) if h != t.hash]
    if header_hash != patch.header_hash or bad:
        tmp.unlink(missing_ok=True)
        raise TensorMismatch(
            f"version {manifest.version} rebuilt from {manifest.parent} fails its hashes "
            f"({len(bad)} tensors: {bad[:3]})"
        )
    tmp.replace(out_path)
    return changes
