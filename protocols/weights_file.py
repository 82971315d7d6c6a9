"""The weights file, ``model.safetensors``: one reader and one writer of its header for the trainer, the publisher,
patches and the engines. numpy and the stdlib only (a sampler imports no torch; trainer/ may import protocols/).

The format: an 8-byte little-endian length N, N bytes of JSON (an object: per tensor ``{"dtype", "shape",
"data_offsets": [begin, end]}``, relative to the data section, and an optional ``"__metadata__"`` object of strings)
padded with spaces, then the data section. A file read here is checked whole before anything uses it: the header is
bounded, every dtype known, every span exactly its dtype's width times its shape, and the spans tile the data
section to the file's last byte with no gap or overlap. So every byte is the header's or exactly one tensor's,
which is what a manifest's header and tensor hashes (protocols/weights.py) rely on.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import numpy as np

from protocols.errors import ProtocolError

MAX_HEADER = 100 << 20  # bytes of JSON; what the safetensors library itself accepts
METADATA = "__metadata__"
PT_METADATA: Mapping[str, str] = {"format": "pt"}  # what transformers' save_pretrained writes
# bytes per element of every byte-aligned safetensors dtype (the sub-byte F4 / F6 ones are refused)
DTYPE_WIDTHS = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
    "C64": 8,
}
# how elements are viewed in numpy: numpy has no bfloat16 or fp8, so those are their bits (bf16_to_f32 widens bf16)
NUMPY_DTYPES = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype("u1"),
    "I8": np.dtype("i1"),
    "F8_E5M2": np.dtype("u1"),
    "F8_E4M3": np.dtype("u1"),
    "F8_E8M0": np.dtype("u1"),
    "I16": np.dtype("<i2"),
    "U16": np.dtype("<u2"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "I32": np.dtype("<i4"),
    "U32": np.dtype("<u4"),
    "F32": np.dtype("<f4"),
    "I64": np.dtype("<i8"),
    "U64": np.dtype("<u8"),
    "F64": np.dtype("<f8"),
    "C64": np.dtype("<c8"),
}
ELEMENT_WIDTHS = (1, 2, 4, 8)  # bytes per element of a tensor a patch may touch


class LayoutError(ProtocolError):
    """A weights file (or its header) that is not a well-formed safetensors file: nothing of it is used."""

    code = "bad_weights_file"


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a weights file: where its bytes lie (absolute offsets), and in a manifest their blake3 hash."""

    name: str
    dtype: str
    shape: list[int]
    offset: int  # byte offset of the tensor's data inside its file
    nbytes: int
    hash: bytes = b""  # blake3 of the tensor's bytes (format 2; empty in format 1)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


class Layout(NamedTuple):
    """A weights file's header bytes (length prefix included: everything before the data) and its tensors, sorted
    by offset. A tuple, so ``head, tensors = read_layout(path)`` reads as it always did."""

    head: bytes
    tensors: list[TensorEntry]

    @property
    def data_start(self) -> int:
        return len(self.head)

    @property
    def end(self) -> int:
        """Where the file ends: after its last tensor."""
        return self.tensors[-1].end if self.tensors else len(self.head)

    def by_name(self) -> dict[str, TensorEntry]:
        return {t.name: t for t in self.tensors}


# -- checks shared with the manifest (protocols/weights.py) ----------------------------------------------------------
def tiling_problem(tensors: Sequence[TensorEntry], start: int, end: int | None) -> str | None:
    """Why ``tensors`` (in order) do not cover ``start``..``end`` exactly, back to back; None when they do (``end``
    None: wherever they end)."""
    pos = start
    for t in tensors:
        if t.offset < pos:
            return f"tensor {t.name!r} at byte {t.offset} overlaps what precedes it (up to byte {pos})"
        if t.offset > pos:
            return f"a gap of {t.offset - pos} bytes before tensor {t.name!r} (at byte {t.offset})"
        pos += t.nbytes
    if end is not None and pos != end:
        return f"the tensors end at byte {pos}, the file at byte {end}"
    return None


def element_width(t: TensorEntry) -> int | None:
    """Bytes per element of a tensor a patch may touch (its span over its element count), None for any other."""
    n = t.numel
    if n == 0 or t.nbytes % n or t.nbytes // n not in ELEMENT_WIDTHS:
        return None
    return t.nbytes // n


# -- reading -------------------------------------------------------------------------------------------------------
def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise LayoutError(f"the header names {k!r} twice")
        out[k] = v
    return out


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entry(name: str, meta: Any, start: int, source: str) -> TensorEntry:
    """One tensor's header entry, checked: a known dtype, a shape of counts, a span of exactly its elements."""
    if not isinstance(meta, dict):
        raise LayoutError(f"{source}: tensor {name!r} is not described by an object")
    dtype, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
    if dtype not in DTYPE_WIDTHS:
        raise LayoutError(f"{source}: tensor {name!r} has an unknown or unsupported dtype {dtype!r}")
    if not isinstance(shape, list) or not all(map(_count, shape)):
        raise LayoutError(f"{source}: tensor {name!r} has a malformed shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_count, offsets)) and offsets[0] <= offsets[1]):
        raise LayoutError(f"{source}: tensor {name!r} has malformed data_offsets {offsets!r}")
    t = TensorEntry(name, dtype, list(shape), start + offsets[0], offsets[1] - offsets[0])
    need = t.numel * DTYPE_WIDTHS[dtype]
    if t.nbytes != need:
        raise LayoutError(f"{source}: tensor {name!r} spans {t.nbytes} bytes, but {dtype} x {shape} is {need}")
    return t


def parse_header(data: bytes, size: int | None = None, source: str = "weights file") -> Layout:
    """The layout of a safetensors file from its first bytes (``data``: at least its whole header). With ``size``
    (the file's length) the tensors must end exactly there; without, wherever they end. LayoutError says what is
    wrong; ``source`` names the file in it."""
    if len(data) < 8:
        raise LayoutError(f"{source}: not a safetensors file (shorter than its 8-byte header length)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > MAX_HEADER:
        raise LayoutError(f"{source}: a safetensors header of {n} bytes is over the limit of {MAX_HEADER}")
    if len(data) < 8 + n:
        raise LayoutError(f"{source}: the safetensors header is cut short ({len(data) - 8} of {n} bytes)")
    try:
        header = json.loads(data[8 : 8 + n].decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise LayoutError(f"{source}: the safetensors header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise LayoutError(f"{source}: the safetensors header is not a JSON object")
    meta = header.get(METADATA, {})
    if not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise LayoutError(f"{source}: {METADATA} must be an object of strings")
    start = 8 + n
    tensors = [_entry(name, m, start, source) for name, m in header.items() if name != METADATA]
    tensors.sort(key=lambda t: (t.offset, t.end))  # a zero-size tensor sits before the one starting where it does
    problem = tiling_problem(tensors, start, size)
    if problem is not None:
        raise LayoutError(f"{source}: {problem}")
    return Layout(data[:start], tensors)


def read_layout(path: Path) -> Layout:
    """The layout of the safetensors file at ``path``, checked against its length (only its header is read)."""
    with open(path, "rb") as fh:
        prefix = fh.read(8)
        n = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else 0
        body = fh.read(n) if n <= MAX_HEADER else b""  # parse_header refuses an oversized length
        size = os.fstat(fh.fileno()).st_size
    return parse_header(prefix + body, size, str(path))


def read_span(fh: BinaryIO, offset: int, nbytes: int, out: np.ndarray | None = None) -> np.ndarray:
    """``nbytes`` bytes of an open file from ``offset`` as a uint8 array: a fresh one, or ``out`` filled. Read at the
    offset (pread), not from the file's position, so threads may read one open file at once."""
    if out is None:
        out = np.empty(nbytes, dtype=np.uint8)
    view, done = memoryview(out)[:nbytes], 0
    while done < nbytes:
        got = os.preadv(fh.fileno(), [view[done:]], offset + done)
        if got <= 0:
            raise LayoutError("weights file shorter than its header says")
        done += got
    return out


def elements(raw: np.ndarray, t: TensorEntry) -> np.ndarray:
    """A tensor's bytes (uint8) viewed as its elements in its shape (BF16 and FP8 as their bits)."""
    return raw.view(NUMPY_DTYPES[t.dtype]).reshape(t.shape)


def map_tensors(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    """Every tensor of a safetensors file as (dtype, read-only memory-mapped elements), without reading the file:
    for engines that need a few elements of a new version."""
    layout = read_layout(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    return {t.name: (t.dtype, elements(mm[t.offset : t.end], t)) for t in layout.tensors}


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16) widened exactly to float32 (a bf16 is the top half of an fp32)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


# -- writing -------------------------------------------------------------------------------------------------------
def encode_header(specs: Iterable[tuple[str, str, Sequence[int]]], metadata: Mapping[str, str] | None) -> Layout:
    """The header of a file holding tensors (name, dtype, shape) back to back in this order, and their layout; the
    caller writes ``head`` then each tensor's bytes. Compact JSON padded with spaces to 8 bytes (the data starts
    aligned), byte for byte what the safetensors library writes for the same tensors in the same order."""
    header: dict[str, Any] = {METADATA: dict(metadata)} if metadata is not None else {}
    spans: list[tuple[str, str, list[int], int, int]] = []
    offset = 0
    for name, dtype, shape in specs:
        if dtype not in DTYPE_WIDTHS or name == METADATA or name in header:
            raise ValueError(f"cannot write tensor {name!r} of dtype {dtype!r}")
        size = math.prod(shape) * DTYPE_WIDTHS[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        spans.append((name, dtype, list(shape), offset, size))
        offset += size
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    head = struct.pack("<Q", len(body)) + body
    return Layout(head, [TensorEntry(name, d, s, len(head) + a, size) for name, d, s, a, size in spans])
