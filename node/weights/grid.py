"""int8-grid and int4-grid: a version in the encoding an MLX int8 (int4) sampler runs, on a grid frozen at its anchor.

An MLX int8 sampler holds each quantized weight as 8-bit affine group codes (``w ~ scale * q + bias``, one scale and
bias per group of 64 elements of a row, q in 0..255; an int4 one 4-bit codes, q in 0..15). Re-quantizing every
version afresh moves scale and bias with every step, so every code of a group can change when one element does.
Here each group keeps the scale and bias of its anchor (the *grid*), and a version's codes are
``clip(rint((w - bias) / scale), 0, LEVELS)`` on that frozen grid: an RL step changes only the codes that cross a
rounding boundary, and the patch of one grid file against its parent's (node/weights/patch.py, unchanged: codes are
stored as bytes) carries the bytes of those codes and nothing else.

The trainer computes the codes (numpy, no MLX), so the sampler loads exactly what was hashed and signed: the file's
bytes ARE MLX's parameters (codes laid out as MLX packs them: 32 / bits codes per little-endian uint32, element 0 in
the lowest bits, so the U8 tensor of packed codes viewed as uint32 is MLX's ``weight``: [rows, cols] bytes at 8
bits, [rows, cols / 2] at 4, two codes a byte with the even element in the low nibble; scales and biases as bf16).
The encoding's name says its bits (``GRID_BITS``); a file's bits follow from its shapes (``grid_bits``).

A group gets a fresh grid (``fresh_grid``: exactly MLX's ``mx.quantize``) at the anchor, and later only when the
re-grid rule (``stale_groups``) says its frozen grid has drifted past the bound: an element more than
``GridRule.excess_steps`` steps outside the grid's range (clipped), or a step more than ``GridRule.step_ratio`` times
the one a fresh grid would take (the range shrank). Such a group costs its 64 codes and its scale and bias in the
patch; the bound holds at every version, so no re-anchoring of the whole model is ever needed.

The weights file of an int8-grid version (``encode_grid_file``): every quantizable tensor (``quantizable``: a 2-D
float ``*.weight`` whose rows split into whole groups, what mlx-lm's ``nn.quantize`` quantizes in Llama/Qwen models)
becomes ``<name>`` (U8 codes, same shape), ``<base>.scales`` and ``<base>.biases`` (BF16, one per group); every
other tensor is copied as it is. Tensors are laid out widest dtype first, then by name (the header is the same for
every version of a model, so versions patch one into another).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from protocols.weights_file import (
    DTYPE_WIDTHS,
    PT_METADATA,
    LayoutError,
    TensorEntry,
    bf16_to_f32,
    elements,
    encode_header,
    read_layout,
    read_span,
)

GRID_ENCODING = "int8-grid"
GRID_BITS = {"int8-grid": 8, "int4-grid": 4}  # each grid encoding's code width (MLX's `bits`)
GROUP = 64  # elements per group (MLX's default group size)
BITS = 8
EPS = np.float32(1e-7)  # MLX's smallest scale
SCALES, BIASES = ".scales", ".biases"
FLOATS = ("F32", "BF16", "F16")
GROUPS_AT_ONCE = 1 << 16  # groups encoded at a time: ~30 bytes per element of temporaries
ENCODE_THREADS = min(8, os.cpu_count() or 1)  # tensors encoded at once (numpy leaves the GIL in its loops)


@dataclass(frozen=True)
class GridRule:
    """When a group's frozen grid is replaced by a fresh one: when an element lies more than ``excess_steps`` steps
    outside its codes 0..LEVELS (worst error 0.5 + excess_steps steps), or its step is over ``step_ratio`` times the
    fresh one (inside the range every error is at most half a step). A fresh MLX grid itself clips its far end (its
    scale is rescaled to put zero on a code, then rounded to bf16; measured on 10^6 normal groups at 8 bits: median
    0.24, 99th percentile 1.5, max 2.4 steps, 0.014% of groups past 2; at 4 bits, where a step is 17x wider: median
    0.18, 99th percentile 0.97, max 1.03), so the bound is set just past that (``rule_for``): a frozen grid is
    re-gridded only when it is worse than (nearly) any fresh one, and never for the noise of which code zero snaps
    to."""

    excess_steps: float = 2.0
    step_ratio: float = 1.25


def rule_for(bits: int) -> GridRule:
    """The re-grid rule of a code width: 2 steps past the range at 8 bits, 1.5 at 4 (just past a fresh grid's)."""
    return GridRule() if bits == 8 else GridRule(excess_steps=1.5)


def levels(bits: int) -> int:
    """The largest code of a width (255 at 8 bits, 15 at 4)."""
    return (1 << bits) - 1


@dataclass
class GridStats:
    """What one encoding did: quantized tensors, their groups, how many got a fresh grid, codes written."""

    tensors: int = 0
    groups: int = 0
    regridded: int = 0
    codes: int = 0
    clipped: int = 0  # codes clipped at 0 or 255 beyond half a step (elements outside their grid's range)

    def add(self, other: GridStats) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


# -- pure rules --------------------------------------------------------------------------------------------------
def quantizable(name: str, dtype: str, shape: list[int], group: int = GROUP) -> bool:
    """Whether a tensor is held as group codes: a 2-D float weight whose rows are whole groups (mlx-lm's
    ``nn.quantize`` quantizes exactly the Linear and Embedding weights of this shape; norms are 1-D)."""
    return name.endswith(".weight") and dtype in FLOATS and len(shape) == 2 and shape[1] > 0 and shape[1] % group == 0


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to bf16 (nearest, ties to even, as MLX and torch round), as their uint16 bits."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    out = ((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    if nan.any():
        out[nan] = np.uint16(0x7FC0)
    return out


def fresh_grid(groups: np.ndarray, bits: int = BITS) -> tuple[np.ndarray, np.ndarray]:
    """(scale, bias) per row of ``groups`` (float32 [n, GROUP]) exactly as MLX's affine quantize computes them in
    float32 at ``bits``: the edge of larger magnitude is the bias, the scale is rescaled so that zero lands on a
    code."""
    w_max, w_min = groups.max(axis=1), groups.min(axis=1)
    mask = np.abs(w_min) > np.abs(w_max)
    scale = np.maximum((w_max - w_min) / np.float32(levels(bits)), EPS)
    scale = np.where(mask, scale, -scale)
    edge = np.where(mask, w_min, w_max)
    q0 = np.rint(edge / scale)
    nz = q0 != 0
    scale = np.where(nz, edge / np.where(nz, q0, np.float32(1)), scale)
    bias = np.where(nz, edge, np.float32(0))
    return scale.astype(np.float32), bias.astype(np.float32)


def codes_on(groups: np.ndarray, scale: np.ndarray, bias: np.ndarray, bits: int = BITS) -> np.ndarray:
    """The codes of ``groups`` (float32 [n, GROUP]) on a grid (float32 [n] each): clip(rint((w - b) / s), 0,
    LEVELS), one code a byte (``pack_codes`` packs them as the file and MLX hold them)."""
    q = np.rint((groups - bias[:, None]) / scale[:, None])
    return np.clip(q, 0, levels(bits)).astype(np.uint8)


def _excess(w_min: np.ndarray, w_max: np.ndarray, scale: np.ndarray, bias: np.ndarray, bits: int) -> np.ndarray:
    """How far (in steps) a group's extreme weights lie outside its grid's codes 0..LEVELS (0: none clipped)."""
    ends = np.stack([(w_min - bias) / scale, (w_max - bias) / scale])  # a negative scale swaps them
    return np.maximum(np.maximum(-ends.min(axis=0), ends.max(axis=0) - levels(bits)), 0)


def stale_groups(
    groups: np.ndarray, scale: np.ndarray, bias: np.ndarray, rule: GridRule, bits: int = BITS
) -> np.ndarray:
    """Which groups' frozen grids (float32 [n] each) have drifted past ``rule`` for the weights ``groups``: an
    extreme element more than ``rule.excess_steps`` steps outside the grid's codes, or a step over
    ``rule.step_ratio`` times the one a fresh grid would take (range / LEVELS)."""
    w_max, w_min = groups.max(axis=1), groups.min(axis=1)
    fresh_step = np.maximum((w_max - w_min) / np.float32(levels(bits)), EPS)
    excess = _excess(w_min, w_max, scale, bias, bits)
    return (excess > rule.excess_steps) | (np.abs(scale) > rule.step_ratio * fresh_step)


def encode_groups(
    groups: np.ndarray, parent: tuple[np.ndarray, np.ndarray] | None, rule: GridRule, bits: int = BITS
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(codes u8 [n, GROUP], scale bf16 bits [n], bias bf16 bits [n], regridded bool [n]) of float32 ``groups``:
    on the parent's grid (bf16 bits, or None: every group fresh), a fresh grid where that one is stale."""
    if parent is None:
        regrid = np.ones(len(groups), dtype=bool)
        s_bits, b_bits = np.zeros(len(groups), np.uint16), np.zeros(len(groups), np.uint16)
    else:
        s_bits, b_bits = parent[0].copy(), parent[1].copy()
        regrid = stale_groups(groups, bf16_to_f32(s_bits), bf16_to_f32(b_bits), rule, bits)
    if regrid.any():
        s, b = fresh_grid(groups[regrid], bits)
        s_bits[regrid], b_bits[regrid] = f32_to_bf16(s), f32_to_bf16(b)
    codes = codes_on(groups, bf16_to_f32(s_bits), bf16_to_f32(b_bits), bits)
    return codes, s_bits, b_bits, regrid


def dequantize(codes: np.ndarray, scale_bits: np.ndarray, bias_bits: np.ndarray) -> np.ndarray:
    """The float32 weights a grid holds (what MLX's kernels compute from it: scale * q + bias in float32)."""
    q = codes.reshape(len(scale_bits), -1).astype(np.float32)
    w = q * bf16_to_f32(scale_bits)[:, None] + bf16_to_f32(bias_bits)[:, None]
    return w.reshape(codes.shape)


def pack_codes(codes: np.ndarray, bits: int = BITS) -> np.ndarray:
    """Codes one a byte [..., cols] as the grid file and MLX hold them (u8 [..., cols * bits / 8]): the same bytes
    at 8 bits; at 4, two a byte, the even element in the low nibble (MLX's packing, element 0 in the lowest bits)."""
    if bits == 8:
        return np.ascontiguousarray(codes, dtype=np.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << np.uint8(4))).astype(np.uint8)


def unpack_codes(packed: np.ndarray, bits: int = BITS) -> np.ndarray:
    """``pack_codes`` undone: one code a byte."""
    if bits == 8:
        return packed
    out = np.empty((*packed.shape[:-1], packed.shape[-1] * 2), dtype=np.uint8)
    out[..., 0::2], out[..., 1::2] = packed & np.uint8(15), packed >> np.uint8(4)
    return out


def mlx_weight(codes: np.ndarray, bits: int = BITS) -> np.ndarray:
    """Codes [rows, cols] (one a byte) as MLX's packed quantized weight (uint32 [rows, cols * bits / 32])."""
    return pack_codes(codes, bits).view("<u4")


def grid_bits(codes_shape: list[int], scales_shape: list[int]) -> int:
    """The code width of a grid tensor, from its packed codes' and its scales' shapes (bytes per group x 8 / 64)."""
    return 8 * codes_shape[-1] // (scales_shape[-1] * GROUP)


# -- files -------------------------------------------------------------------------------------------------------
def as_float32(raw: np.ndarray, t: TensorEntry) -> np.ndarray:
    values = elements(raw, t)
    return bf16_to_f32(values) if t.dtype == "BF16" else values.astype(np.float32)


@dataclass(frozen=True)
class _Part:
    out: str  # name in the grid file
    dtype: str
    shape: list[int]
    src: TensorEntry
    part: str  # "codes", "scales", "biases" or "raw"


def grid_plan(tensors: list[TensorEntry], bits: int = BITS) -> list[_Part]:
    """The grid file's tensors for a source layout at ``bits``, in file order (widest dtype first, then by name)."""
    names = {t.name for t in tensors}
    plan: list[_Part] = []
    for t in tensors:
        if quantizable(t.name, t.dtype, t.shape):
            base = t.name[: -len(".weight")]
            if base + SCALES in names or base + BIASES in names:
                raise LayoutError(f"{t.name!r}: the source already holds {base}{SCALES} or {base}{BIASES}")
            groups = [t.shape[0], t.shape[1] // GROUP]
            plan += [
                _Part(t.name, "U8", [t.shape[0], t.shape[1] * bits // 8], t, "codes"),
                _Part(base + SCALES, "BF16", groups, t, "scales"),
                _Part(base + BIASES, "BF16", groups, t, "biases"),
            ]
        else:
            plan.append(_Part(t.name, t.dtype, t.shape, t, "raw"))
    plan.sort(key=lambda p: (-DTYPE_WIDTHS[p.dtype], p.out))
    return plan


def _parent_grids(parent: Path | None, plan: list[_Part]) -> dict[str, tuple[np.ndarray, np.ndarray]] | None:
    """The parent grid file's (scale bits, bias bits) per quantized source tensor, if it has this plan's layout."""
    if parent is None:
        return None
    _head, tensors = read_layout(parent)
    layout = {t.name: t for t in tensors}
    if [(p.out, p.dtype, p.shape) for p in plan] != [(t.name, t.dtype, t.shape) for t in tensors]:
        return None
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    with open(parent, "rb") as fh:
        for p in plan:
            if p.part == "codes":
                base = p.out[: -len(".weight")]
                s, b = layout[base + SCALES], layout[base + BIASES]
                out[p.out] = (
                    read_span(fh, s.offset, s.nbytes).view(np.uint16).reshape(-1),
                    read_span(fh, b.offset, b.nbytes).view(np.uint16).reshape(-1),
                )
    return out


def _encode_tensor(
    w: np.ndarray, parent: tuple[np.ndarray, np.ndarray] | None, rule: GridRule, stats: GridStats, bits: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(packed codes [rows, cols * bits / 8], scale bits, bias bits) of one float32 tensor [rows, cols]."""
    groups = w.reshape(-1, GROUP)
    n = len(groups)
    codes = np.empty(groups.shape, dtype=np.uint8)
    s_bits, b_bits = np.empty(n, np.uint16), np.empty(n, np.uint16)
    for a in range(0, n, GROUPS_AT_ONCE):
        z = slice(a, min(a + GROUPS_AT_ONCE, n))
        par = None if parent is None else (parent[0][z], parent[1][z])
        codes[z], s_bits[z], b_bits[z], regrid = encode_groups(groups[z], par, rule, bits)
        stats.regridded += int(regrid.sum())
        pos = (groups[z] - bf16_to_f32(b_bits[z])[:, None]) / bf16_to_f32(s_bits[z])[:, None]
        stats.clipped += int(np.count_nonzero((pos < -0.5) | (pos > levels(bits) + 0.5)))
    stats.tensors += 1
    stats.groups += n
    stats.codes += w.size
    return pack_codes(codes.reshape(w.shape), bits), s_bits, b_bits


def encode_grid_file(
    src: Path,
    dst: Path,
    parent: Path | None = None,
    rule: GridRule | None = None,
    threads: int = ENCODE_THREADS,
    bits: int = BITS,
) -> GridStats:
    """Write the grid weights file of ``src`` (a float safetensors file) at ``bits`` (8: int8-grid, 4: int4-grid)
    to ``dst``: on the grids of ``parent`` (the previous version's grid file; None, or a file of another layout or
    width: every group fresh, an anchor). ``rule``: ``rule_for(bits)`` if not given. ``threads`` tensors at a
    time, each read and written at its own offsets (the bytes do not depend on the order): at 1.5B parameters one
    thread took ~19 s of the trainer's publish on this box (bench/delta_shaped.py)."""
    rule = rule or rule_for(bits)
    _head, tensors = read_layout(src)
    plan = grid_plan(tensors, bits)
    grids = _parent_grids(parent, plan)
    layout = encode_header([(p.out, p.dtype, p.shape) for p in plan], PT_METADATA)
    stats = GridStats()
    with open(src, "rb") as fh, open(dst, "wb") as out:
        out.write(layout.head)
        out.flush()

        def one(item: tuple[_Part, list[_Placed]]) -> GridStats:
            p, parts = item
            mine = GridStats()
            raw = read_span(fh, p.src.offset, p.src.nbytes)
            if p.part == "raw":
                _pwrite(out.fileno(), raw, layout.tensors[parts[0].index].offset)
                return mine
            codes, s_bits, b_bits = _encode_tensor(
                as_float32(raw, p.src), None if grids is None else grids[p.src.name], rule, mine, bits
            )
            for q in parts:
                data = {"codes": codes, "scales": s_bits, "biases": b_bits}[q.part]
                _pwrite(out.fileno(), data, layout.tensors[q.index].offset)
            return mine

        with ThreadPoolExecutor(max(1, threads)) as pool:
            for mine in pool.map(one, _grouped(plan)):
                stats.add(mine)
    return stats


def _pwrite(fd: int, data: np.ndarray, offset: int) -> None:
    view, done = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8)), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


@dataclass(frozen=True)
class _Placed:
    part: str
    index: int  # position in the file's layout


def _grouped(plan: list[_Part]) -> Iterator[tuple[_Part, list[_Placed]]]:
    """Each source tensor once (in file order of its first part), with every part it writes and where."""
    seen: dict[str, list[_Placed]] = {}
    first: list[_Part] = []
    for i, p in enumerate(plan):
        if p.src.name not in seen:
            seen[p.src.name] = []
            first.append(p)
        seen[p.src.name].append(_Placed(p.part, i))
    for p in first:
        yield p, seen[p.src.name]


def read_grid(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a grid file as numpy: codes u8 as packed in the file (``unpack_codes``), scales and biases
    as bf16 bits (uint16), others as stored."""
    _head, tensors = read_layout(path)
    with open(path, "rb") as fh:
        return {t.name: elements(read_span(fh, t.offset, t.nbytes), t) for t in tensors}


def file_grid_bits(path: Path) -> int | None:
    """A grid file's code width (8 or 4) by its header alone; None for a file that holds no group codes."""
    _head, tensors = read_layout(path)
    shapes = {t.name: t.shape for t in tensors if t.dtype in ("U8", "BF16")}
    coded = [t for t in tensors if t.dtype == "U8" and t.name.endswith(".weight")]
    widths = {
        grid_bits(t.shape, shapes[base + SCALES])
        for t in coded
        if (base := t.name[: -len(".weight")]) + SCALES in shapes and len(shapes[base + SCALES]) == len(t.shape) == 2
    }
    if len(widths) > 1:
        raise LayoutError(f"{path}: group codes of several widths {sorted(widths)}")
    return widths.pop() if widths else None


def mlx_tensors(path: Path, names: set[str] | None = None) -> list[tuple[str, str, np.ndarray]]:
    """A grid file's tensors (those in ``names``, if given) as an MLX int8/int4 model takes them (``load_weights``):
    (name, safetensors dtype, numpy elements), codes as MLX's packed uint32 weight, BF16 as their bits (the caller
    views them as bfloat16). The bytes are the file's own: what was hashed is what the sampler runs."""
    _head, tensors = read_layout(path)
    dtypes = {t.name: t.dtype for t in tensors}
    out = []
    with open(path, "rb") as fh:
        for t in tensors:
            if names is not None and t.name not in names:
                continue
            values = elements(read_span(fh, t.offset, t.nbytes), t)
            coded = t.dtype == "U8" and t.name.endswith(".weight") and t.name[: -len(".weight")] + SCALES in dtypes
            # packed codes are MLX's weight's bytes at any width: viewed, never repacked
            out.append((t.name, "U32", values.view("<u4")) if coded else (t.name, t.dtype, values))
    return out


def dequantize_file(path: Path) -> dict[str, np.ndarray]:
    """A grid file's weights as float32, by their source names (codes dequantized; other floats widened)."""
    grid = read_grid(path)
    bits = file_grid_bits(path) or BITS
    _head, tensors = read_layout(path)
    dtypes = {t.name: t.dtype for t in tensors}
    coded = [n for n in grid if dtypes[n] == "U8" and n.endswith(".weight")]
    grids = {n[: -len(".weight")] + suffix for n in coded for suffix in (SCALES, BIASES)}
    out: dict[str, np.ndarray] = {}
    for name, values in grid.items():
        if name in grids:
            continue
        if name in coded:
            base = name[: -len(".weight")]
            codes = unpack_codes(values, bits)
            out[name] = dequantize(codes, grid[base + SCALES].reshape(-1), grid[base + BIASES].reshape(-1))
        elif dtypes[name] == "BF16":
            out[name] = bf16_to_f32(values)
        else:
            out[name] = values.astype(np.float32) if dtypes[name] in FLOATS else values
    return out
