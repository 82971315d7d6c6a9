"""The one safetensors reader and writer (protocols/weights_file.py): malformed headers each refused with a clear
LayoutError, a written header read back as written, and byte-for-byte what the safetensors library writes."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocols.errors import ProtocolError
from protocols.weights_file import (
    MAX_HEADER,
    PT_METADATA,
    LayoutError,
    TensorEntry,
    bf16_to_f32,
    element_width,
    encode_header,
    map_tensors,
    parse_header,
    read_layout,
    tiling_problem,
)


def raw(header: dict[str, Any] | bytes, data: bytes = b"") -> bytes:
    """A file: an 8-byte length, the header (JSON of ``header``, or these bytes as they are), ``data``."""
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(body)) + body + data


def entry(dtype: str, shape: list[int], a: int, b: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [a, b]}


GOOD = {"__metadata__": {"format": "pt"}, "x": entry("F32", [2], 0, 8), "y": entry("BF16", [3], 8, 14)}


def refused(data: bytes, match: str, size: int | None = None) -> None:
    with pytest.raises(LayoutError, match=match):
        parse_header(data, size)


# -- malformed headers --------------------------------------------------------------------------------------------
def test_a_well_formed_header_reads():
    layout = parse_header(raw(GOOD, bytes(14)), len(raw(GOOD, bytes(14))))
    assert [(t.name, t.dtype, t.shape, t.nbytes) for t in layout.tensors] == [
        ("x", "F32", [2], 8),
        ("y", "BF16", [3], 6),
    ]
    assert layout.tensors[0].offset == layout.data_start == len(layout.head) and layout.end == layout.data_start + 14


def test_the_header_length_is_bounded_and_must_be_there():
    refused(b"\x01\x02", "shorter than its 8-byte header length")
    refused(struct.pack("<Q", MAX_HEADER + 1), "over the limit")
    refused(struct.pack("<Q", (1 << 64) - 1) + b"{}", "over the limit")
    refused(struct.pack("<Q", 100) + b"{}", "cut short")


def test_the_header_must_be_a_json_object():
    refused(raw(b"{not json"), "not JSON")
    refused(raw(b'{"x": \xff}'), "not JSON")  # not UTF-8
    refused(raw(b"[" * 100_000 + b"]" * 100_000), "not JSON|not a JSON object")  # deep nesting: no RecursionError
    refused(raw(b"[1, 2]"), "not a JSON object")
    refused(raw(b'{"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "x": {}}', bytes(4)), "names 'x' twice")
    refused(raw({"__metadata__": {"format": 1}}), "__metadata__ must be an object of strings")
    refused(raw({"x": [1]}), "not described by an object")


def test_every_dtype_must_be_known_and_byte_sized():
    refused(raw({"x": entry("F33", [1], 0, 4)}, bytes(4)), "unknown or unsupported dtype 'F33'")
    refused(raw({"x": entry("F4", [2], 0, 1)}, bytes(1)), "unknown or unsupported dtype 'F4'")
    refused(raw({"x": {"shape": [1], "data_offsets": [0, 4]}}, bytes(4)), "dtype None")


def test_shapes_and_offsets_must_be_counts():
    refused(raw({"x": entry("F32", [-1], 0, 4)}, bytes(4)), "malformed shape")
    refused(raw({"x": entry("F32", [True], 0, 4)}, bytes(4)), "malformed shape")
    refused(raw({"x": entry("F32", [1], 4, 0)}, bytes(4)), "malformed data_offsets")
    refused(raw({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0]}}, bytes(4)), "malformed data_offsets")


def test_a_span_must_be_exactly_its_elements():
    refused(raw({"x": entry("F32", [2, 3], 0, 20)}, bytes(20)), r"spans 20 bytes, but F32 x \[2, 3\] is 24")
    refused(raw({"x": entry("BF16", [3], 0, 12)}, bytes(12)), "spans 12 bytes, but BF16")


def test_spans_must_tile_the_data_exactly():
    overlap = {"x": entry("F32", [2], 0, 8), "y": entry("F32", [2], 4, 12)}
    refused(raw(overlap, bytes(12)), "tensor 'y' at byte .* overlaps")
    gap = {"x": entry("F32", [2], 0, 8), "y": entry("F32", [2], 12, 20)}
    refused(raw(gap, bytes(20)), "a gap of 4 bytes before tensor 'y'")
    late = {"x": entry("F32", [2], 4, 12)}
    refused(raw(late, bytes(12)), "a gap of 4 bytes before tensor 'x'")
    data = raw(GOOD, bytes(14))
    refused(data + b"\0", "the tensors end at byte", len(data) + 1)  # trailing bytes
    refused(data[:-1], "the tensors end at byte", len(data) - 1)  # truncated data
    # a zero-size tensor sitting where the next one starts tiles, whichever the header lists first
    zero = {"y": entry("F32", [1], 0, 4), "e": entry("F32", [0], 0, 0)}
    assert [t.name for t in parse_header(raw(zero, bytes(4)), len(raw(zero, bytes(4)))).tensors] == ["e", "y"]


def test_read_layout_checks_the_file_and_names_it(tmp_path):
    good = tmp_path / "good.safetensors"
    good.write_bytes(raw(GOOD, bytes(14)))
    assert read_layout(good) == parse_header(good.read_bytes())
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(raw(GOOD, bytes(15)))
    with pytest.raises(LayoutError, match=r"bad\.safetensors: the tensors end at byte"):
        read_layout(bad)
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes(struct.pack("<Q", MAX_HEADER + 1))
    with pytest.raises(LayoutError, match="over the limit"):
        read_layout(huge)
    tiny = tmp_path / "tiny.safetensors"
    tiny.write_bytes(b"\0")
    with pytest.raises(LayoutError, match="shorter than its 8-byte"):
        read_layout(tiny)


FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
metas = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(["F32", "BF16", "I8", "F4", "x", 3]),
        "shape": st.lists(st.integers(-2, 5), max_size=3) | st.booleans(),
        "data_offsets": st.lists(st.integers(-4, 40), max_size=3),
    }
)


@FUZZ
@given(st.binary(max_size=200))
def test_any_bytes_read_or_are_refused(data):
    try:
        parse_header(data)
    except LayoutError:
        pass


@FUZZ
@given(st.dictionaries(st.text(max_size=4), metas, max_size=4), st.integers(0, 48))
def test_any_header_reads_to_a_tiling_layout_or_is_refused(header, n):
    data = raw(header, bytes(n))
    try:
        layout = parse_header(data, len(data))
    except ProtocolError as exc:
        assert isinstance(exc, LayoutError)
        return
    assert tiling_problem(layout.tensors, layout.data_start, len(data)) is None


# -- writing ------------------------------------------------------------------------------------------------------
def test_a_written_header_reads_back_as_written(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {
        "w": rng.standard_normal((3, 5)).astype(np.float32),
        "h": rng.standard_normal(7).astype(np.float16),
        "i": rng.integers(-100, 100, (2, 2)).astype(np.int64),
        "s": np.array(3.5, dtype=np.float32),  # a scalar: shape []
        "empty": np.zeros((0, 4), dtype=np.float32),
    }
    dtypes = {"w": "F32", "h": "F16", "i": "I64", "s": "F32", "empty": "F32"}
    layout = encode_header([(k, dtypes[k], list(v.shape)) for k, v in arrays.items()], PT_METADATA)
    path = tmp_path / "w.safetensors"
    path.write_bytes(layout.head + b"".join(v.tobytes() for v in arrays.values()))
    assert len(layout.head) % 8 == 0
    assert read_layout(path) == layout
    mapped = map_tensors(path)
    for k, v in arrays.items():
        assert mapped[k][0] == dtypes[k] and mapped[k][1].shape == v.shape and np.array_equal(mapped[k][1], v), k
    with pytest.raises(ValueError):
        encode_header([("a", "F32", [1]), ("a", "F32", [1])], None)
    with pytest.raises(ValueError):
        encode_header([("a", "Q8", [1])], None)


def test_the_writer_writes_what_the_safetensors_library_writes(tmp_path):
    import torch
    from safetensors.numpy import save as save_numpy
    from safetensors.torch import save as save_torch

    g = torch.Generator().manual_seed(0)
    tensors = {  # in the library's order: widest dtype first, then by name
        "a": torch.randn(2, 3, generator=g),
        "e": torch.zeros(0),
        "z": torch.randn(3, 4, generator=g).to(torch.bfloat16),
        "m": torch.arange(5, dtype=torch.int8),
    }
    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.int8: "I8"}
    specs = [(k, names[t.dtype], list(t.shape)) for k, t in tensors.items()]
    data = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors.values())
    theirs = save_torch(tensors, metadata=dict(PT_METADATA))
    assert encode_header(specs, PT_METADATA).head + data == theirs
    path = tmp_path / "theirs.safetensors"
    path.write_bytes(theirs)
    mapped = map_tensors(path)
    assert mapped["z"][0] == "BF16"
    assert np.array_equal(bf16_to_f32(mapped["z"][1]), tensors["z"].float().numpy())  # widened exactly
    assert np.array_equal(mapped["a"][1], tensors["a"].numpy()) and np.array_equal(mapped["m"][1], tensors["m"])
    # without metadata (the numpy front end writes none)
    plain = {"b": np.ones((2, 2), dtype=np.float64), "c": np.arange(3, dtype=np.int32)}
    ours = encode_header([("b", "F64", [2, 2]), ("c", "I32", [3])], None).head + b"".join(
        v.tobytes() for v in plain.values()
    )
    assert ours == save_numpy(plain)


def test_the_manifest_checks_share_the_tiling_and_element_width_rules():
    a, b = TensorEntry("a", "F32", [2], 16, 8), TensorEntry("b", "BF16", [3], 24, 6)
    assert tiling_problem([a, b], 16, 30) is None
    assert "gap of 2 bytes" in (tiling_problem([a, b], 14, 30) or "")
    assert tiling_problem([a, b], 16, None) is None
    assert "the file at byte 31" in (tiling_problem([a, b], 16, 31) or "")
    assert element_width(a) == 4 and element_width(b) == 2
    assert element_width(TensorEntry("c", "F32", [0], 0, 0)) is None
    assert element_width(TensorEntry("d", "X", [2], 0, 6)) is None  # 3 bytes an element: not patchable


def test_the_reader_is_the_only_one():
    """No module parses or writes a safetensors header by hand any more (they all go through weights_file)."""
    root = Path(__file__).resolve().parents[1]
    hand = [
        str(p.relative_to(root))
        for d in ("node", "trainer", "protocols")
        for p in (root / d).rglob("*.py")
        if p.name != "weights_file.py" and ('"<Q"' in p.read_text() or "data_offsets" in p.read_text())
    ]
    assert hand == []
