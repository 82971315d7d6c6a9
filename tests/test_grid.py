"""int8-grid and int4-grid versions (node/weights/grid.py): MLX's own quantization reproduced in numpy bit for bit
at 8 and 4 bits, codes on a frozen grid, the re-grid rule, and patches of grid files that carry only the codes that
changed."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from node.weights.grid import (
    GROUP,
    GridRule,
    codes_on,
    dequantize,
    dequantize_file,
    encode_grid_file,
    encode_groups,
    f32_to_bf16,
    file_grid_bits,
    fresh_grid,
    mlx_weight,
    pack_codes,
    quantizable,
    read_grid,
    rule_for,
    stale_groups,
    unpack_codes,
)
from node.weights.patch import apply_patch, build_patch
from protocols import weights as w
from protocols.weights_file import PT_METADATA, bf16_to_f32, encode_header, read_layout


def bf16_values(x: np.ndarray) -> np.ndarray:
    """float32 values that are exactly bf16 (what a bf16 version holds)."""
    return bf16_to_f32(f32_to_bf16(x)).reshape(x.shape)


def weights(rng: np.random.Generator, rows: int = 96, cols: int = 256, special: bool = True) -> np.ndarray:
    """Weight-like values with the groups that matter: mostly normal, some all equal, all zero, one-sided."""
    x = (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)
    if not special:
        return bf16_values(x)
    g = x.reshape(-1, GROUP)
    g[0] = 0.0
    g[1] = 0.013
    g[2] = np.abs(g[2])  # positive only: the max is the edge, a negative scale
    g[3] = -np.abs(g[3])
    g[4, 7] = 0.5  # one outlier
    return bf16_values(x)


def test_f32_to_bf16_rounds_to_nearest_even_as_mlx_does():
    import mlx.core as mx

    rng = np.random.default_rng(1)
    x = np.concatenate([rng.standard_normal(10_000).astype(np.float32) * 10.0 ** rng.integers(-8, 3, 10_000)])
    x = np.concatenate([x, np.float32([0.0, -0.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 3.4e38])])
    want = np.array(mx.array(x).astype(mx.bfloat16).view(mx.uint16))
    assert np.array_equal(f32_to_bf16(x), want)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_a_fresh_grid_is_exactly_mlx_quantize(dtype, bits):
    """Scales and biases are MLX's bit for bit; MLX's codes are ours computed against its float32 scale, and its
    packing is the packed codes' bytes viewed as uint32 (at 4 bits two codes a byte, the even one low)."""
    import mlx.core as mx

    w_np = weights(np.random.default_rng(2))
    src = mx.array(w_np).astype(mx.bfloat16 if dtype == "bf16" else mx.float32)
    q, s, b = mx.quantize(src, group_size=GROUP, bits=bits)
    groups = w_np.reshape(-1, GROUP)
    scale, bias = fresh_grid(groups, bits)
    if dtype == "bf16":
        assert np.array_equal(np.array(s.view(mx.uint16)).reshape(-1), f32_to_bf16(scale))
        assert np.array_equal(np.array(b.view(mx.uint16)).reshape(-1), f32_to_bf16(bias))
    else:
        assert np.array_equal(np.array(s).reshape(-1), scale) and np.array_equal(np.array(b).reshape(-1), bias)
    mlx_codes = codes_on(groups, scale, bias, bits).reshape(w_np.shape)
    assert mlx_codes.max() == (1 << bits) - 1
    assert np.array_equal(mlx_weight(mlx_codes, bits), np.array(q))
    assert np.array_equal(unpack_codes(pack_codes(mlx_codes, bits), bits), mlx_codes)


@pytest.mark.parametrize("bits", [8, 4])
def test_mlx_dequantizes_grid_codes_to_the_weights_numpy_says(bits):
    """The layout as MLX reads it: mx.dequantize of the grid's own bytes equals numpy's scale * q + bias."""
    import mlx.core as mx

    w_np = weights(np.random.default_rng(3))
    codes, s_bits, b_bits, regrid = encode_groups(w_np.reshape(-1, GROUP), None, rule_for(bits), bits)
    assert regrid.all()
    codes = codes.reshape(w_np.shape)
    rows = w_np.shape[0]
    s = mx.array(s_bits.reshape(rows, -1)).view(mx.bfloat16).astype(mx.float32)
    b = mx.array(b_bits.reshape(rows, -1)).view(mx.bfloat16).astype(mx.float32)
    got = np.array(mx.dequantize(mx.array(mlx_weight(codes, bits)), s, b, group_size=GROUP, bits=bits))
    want = dequantize(codes, s_bits, b_bits)
    assert np.allclose(got, want, rtol=0, atol=1e-7)
    # and the grid is a good one: half a step from nearly every weight, under two where MLX's grid clips its end
    step = np.abs(bf16_to_f32(s_bits))[:, None]
    err = np.abs(want - w_np).reshape(-1, GROUP)
    assert np.all(err <= 2.0 * step) and np.mean(err <= 0.5 * step * (1 + 1e-6)) > 0.99


def test_codes_on_a_frozen_grid_move_only_across_rounding_boundaries():
    rng = np.random.default_rng(4)
    w0 = weights(rng).reshape(-1, GROUP)
    codes0, s_bits, b_bits, _ = encode_groups(w0, None, GridRule())
    # the same weights on their own grid: nothing changes, nothing is re-gridded
    again, s2, _b2, regrid = encode_groups(w0, (s_bits, b_bits), GridRule())
    assert np.array_equal(again, codes0) and np.array_equal(s2, s_bits) and not regrid.any()
    # an RL-sized step (1e-5 either way): the grids stay, a small share of codes moves, each by one; only the
    # all-zero group (a zero-width grid) gets a fresh one (the constant 0.013 group stays: bf16 rounds the step away)
    w1 = bf16_values(w0 + rng.choice([-1e-5, 1e-5], w0.shape).astype(np.float32))
    codes1, s1, b1, regrid = encode_groups(w1, (s_bits, b_bits), GridRule())
    assert np.flatnonzero(regrid).tolist() == [0]
    kept = ~regrid
    assert np.array_equal(s1[kept], s_bits[kept]) and np.array_equal(b1[kept], b_bits[kept])
    moved = codes1[kept] != codes0[kept]
    assert 0 < moved.mean() < 0.05
    assert np.all(np.abs(codes1[kept].astype(int) - codes0[kept].astype(int)) <= 1)
    assert np.array_equal(codes1, codes_on(w1, bf16_to_f32(s1), bf16_to_f32(b1)))


def test_the_regrid_rule_holds_the_bound_per_group():
    rule = GridRule(excess_steps=2.0, step_ratio=1.25)
    s0 = 2.0**-10  # a group whose fresh grid is exact: step s0, codes 0..255 from -200 s0 to 55 s0
    base = (np.round(np.linspace(0, 255, GROUP)) - 200).astype(np.float32) * np.float32(s0)
    scale, bias = fresh_grid(base[None, :])
    assert scale[0] == s0 and bias[0] == base[0]

    def stale(g: np.ndarray) -> bool:
        return bool(stale_groups(g[None, :].astype(np.float32), scale, bias, rule)[0])

    def moved(i: int, steps: float) -> np.ndarray:
        g = base.copy()
        g[i] += np.float32(steps * s0)
        return g

    assert not stale(base)
    assert not stale(moved(3, 0.4))  # inside the range: at most half a step off, as on a fresh grid
    assert not stale(moved(-1, 1.5))  # 1.5 steps past the top: as far as a fresh MLX grid may clip
    assert stale(moved(-1, 2.5))  # past the bound
    assert stale(moved(0, -2.5))
    assert stale(base * np.float32(0.7))  # the range shrank: the frozen step is 1.43x a fresh one
    assert not stale(base * np.float32(0.9))
    # a stale group gets a fresh grid, the others keep theirs
    groups = np.stack([base, base * np.float32(0.5)])
    s_bits, b_bits = f32_to_bf16(np.repeat(scale, 2)), f32_to_bf16(np.repeat(bias, 2))
    _codes, s2, _b2, regrid = encode_groups(groups, (s_bits, b_bits), rule)
    assert regrid.tolist() == [False, True] and s2[0] == s_bits[0] and s2[1] != s_bits[1]


def test_which_tensors_are_quantized():
    assert quantizable("model.layers.0.mlp.up_proj.weight", "BF16", [384, 128])
    assert quantizable("model.embed_tokens.weight", "F32", [512, 128])
    assert not quantizable("model.layers.0.input_layernorm.weight", "BF16", [128])
    assert not quantizable("model.layers.0.self_attn.q_proj.bias", "BF16", [128, 128])
    assert not quantizable("x.weight", "BF16", [128, 100])
    assert not quantizable("x.weight", "I64", [128, 128])


def write_bf16(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """A bf16 safetensors file of float32 values that are exactly bf16 (numpy has no bf16 for safetensors.numpy)."""
    order = sorted(tensors)
    layout = encode_header([(k, "BF16", list(tensors[k].shape)) for k in order], PT_METADATA)
    with open(path, "wb") as fh:
        fh.write(layout.head)
        for k in order:
            fh.write(f32_to_bf16(tensors[k]).tobytes())


def grid_pair(tmp_path: Path, step: float, seed: int = 5, bits: int = 8) -> tuple[Path, Path, dict, dict]:
    """Two bf16 versions of a small model-like file, the second moved by ``step`` either way, and their grid files
    at ``bits`` (the second on the first's grid)."""
    rng = np.random.default_rng(seed)
    v0 = {
        "model.embed_tokens.weight": weights(rng, 64, 128, special=False),
        "model.layers.0.mlp.up_proj.weight": weights(rng, 256, 128, special=False),
        "model.layers.0.self_attn.q_proj.bias": bf16_values(rng.standard_normal(128).astype(np.float32) * 0.1),
        "model.norm.weight": bf16_values(np.ones(128, np.float32)),
    }
    v1 = {k: bf16_values(v + rng.choice([-step, step], v.shape).astype(np.float32)) for k, v in v0.items()}
    write_bf16(tmp_path / "v0.safetensors", v0)
    write_bf16(tmp_path / "v1.safetensors", v1)
    g0, g1 = tmp_path / "g0.safetensors", tmp_path / "g1.safetensors"
    encode_grid_file(tmp_path / "v0.safetensors", g0, bits=bits)
    encode_grid_file(tmp_path / "v1.safetensors", g1, parent=g0, bits=bits)
    return g0, g1, v0, v1


@pytest.mark.parametrize("bits", [8, 4])
def test_a_grid_file_holds_every_tensor_and_patches_carry_only_changed_codes(tmp_path, bits):
    g0, g1, _v0, v1 = grid_pair(tmp_path, 2e-5 if bits == 8 else 3e-4, bits=bits)
    _, layout = read_layout(g1)
    kinds = {t.name: t.dtype for t in layout}
    shapes = {t.name: t.shape for t in layout}
    assert kinds["model.layers.0.mlp.up_proj.weight"] == "U8" and kinds["model.layers.0.mlp.up_proj.scales"] == "BF16"
    assert shapes["model.layers.0.mlp.up_proj.weight"] == [256, 128 * bits // 8] and file_grid_bits(g1) == bits
    assert kinds["model.norm.weight"] == "BF16" and kinds["model.layers.0.self_attn.q_proj.bias"] == "BF16"
    assert [t.dtype for t in layout] == sorted((t.dtype for t in layout), key=lambda d: -{"BF16": 2, "U8": 1}[d])
    deq, grid = dequantize_file(g1), read_grid(g1)
    for name, want in v1.items():
        assert deq[name].shape == want.shape
        if want.ndim == 1:  # copied as they are
            assert np.array_equal(deq[name], want)
            continue
        base = name[: -len(".weight")]
        step = np.abs(bf16_to_f32(grid[base + ".scales"].reshape(-1)))[:, None]
        err = np.abs(deq[name] - want).reshape(-1, GROUP)
        assert np.all(err <= (2.0 + rule_for(bits).excess_steps) * step), name  # a fresh grid clips up to ~1.5 steps
        assert np.mean(err <= 0.5 * step) > 0.99, name
    _, l0 = read_layout(g0)
    assert l0 == layout and g0.read_bytes()[: layout[0].offset] == g1.read_bytes()[: layout[0].offset]
    built = build_patch(g0, g1)
    assert built is not None
    touched = {layout[d.tensor].name for d in built.deltas}
    # the grids are frozen: only codes move (and the unquantized 1-D tensors, as bf16 bits)
    assert not any(n.endswith((".scales", ".biases")) for n in touched)
    assert {"model.layers.0.mlp.up_proj.weight", "model.embed_tokens.weight"} <= touched
    codes0, codes1 = read_grid(g0), read_grid(g1)
    changed = sum(int(np.count_nonzero(codes0[n] != codes1[n])) for n in touched)
    assert built.changed == changed  # bytes of codes: at 4 bits a byte holds two
    moved = unpack_codes(codes0["model.embed_tokens.weight"], bits) != unpack_codes(
        codes1["model.embed_tokens.weight"], bits
    )
    assert 0 < moved.mean() < 0.05
    # applied to the parent's grid file it rebuilds the child's bit for bit
    tensors = [replace(t, hash=h) for t, h in zip(layout, built.hashes, strict=True)]
    info = w.PatchInfo(b"\0" * 32, 0, "zlib", built.size, [b"\1" * 32], built.weights_size, built.header_hash,
                       built.deltas)  # fmt: skip
    m = w.Manifest("t", 1, 0, f"int{bits}-grid", 1 << 20, [], tensors, info)
    changes = apply_patch(g0, tmp_path / "out.safetensors", m, built.blob)
    assert (tmp_path / "out.safetensors").read_bytes() == g1.read_bytes()
    assert set(changes.indices) == touched
    w.Manifest.from_body(replace(m, files=[w.FileEntry("config.json", 2, [b"\2" * 32])]).body())  # it parses


def test_tensors_encoded_at_once_write_the_same_file(tmp_path):
    """Threads encode tensors at once, each at its own offsets: the bytes and the tally are one thread's."""
    g0, g1, _v0, _v1 = grid_pair(tmp_path, 2e-4)
    for threads in (1, 4):
        a, b = tmp_path / f"a{threads}.safetensors", tmp_path / f"b{threads}.safetensors"
        s0 = encode_grid_file(tmp_path / "v0.safetensors", a, threads=threads)
        s1 = encode_grid_file(tmp_path / "v1.safetensors", b, parent=a, threads=threads)
        assert a.read_bytes() == g0.read_bytes() and b.read_bytes() == g1.read_bytes()
        assert (s0.tensors, s0.groups, s0.regridded) == (2, s0.groups, s0.groups) and s0.groups > 0
        assert s1.codes == s0.codes and s1.groups == s0.groups and s1.regridded < s0.groups


def test_a_grid_file_without_a_usable_parent_is_an_anchor(tmp_path):
    g0, _g1, _v0, _v1 = grid_pair(tmp_path, 2e-5)
    other = tmp_path / "other.safetensors"
    save_file({"x.weight": np.zeros((4, 64), np.float32)}, str(other))
    stats = encode_grid_file(tmp_path / "v1.safetensors", tmp_path / "g.safetensors", parent=other)
    assert stats.regridded == stats.groups > 0
    stats = encode_grid_file(tmp_path / "v1.safetensors", tmp_path / "g.safetensors", parent=g0)
    assert stats.regridded < stats.groups // 10


@pytest.mark.parametrize("bits", [8, 4])
def test_an_mlx_quantized_model_runs_exactly_the_grid_file(tmp_path, realistic_model_dir, bits):
    """The realistic fixture as a bf16 version, its int8-grid (int4-grid) file loaded into an mlx-lm model quantized
    the way the MLX engine quantizes (nn.quantize, group 64, 8 (4) bits): every parameter is the file's bytes, the
    anchor's scales and biases are MLX's own, and its logits are an int8 (int4) model's."""
    import shutil

    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    from node.weights.encoding import read_float_tensors
    from node.weights.grid import mlx_tensors

    model_dir = tmp_path / "bf16"
    model_dir.mkdir()
    for f in realistic_model_dir.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, model_dir / f.name)
    write_bf16(model_dir / "model.safetensors", read_float_tensors(realistic_model_dir / "model.safetensors"))
    grid = tmp_path / "grid.safetensors"
    encode_grid_file(model_dir / "model.safetensors", grid, bits=bits)

    def quantized_model():
        model, _ = load_model(model_dir)
        model.set_dtype(mx.bfloat16)
        nn.quantize(model, group_size=GROUP, bits=bits)
        return model

    own, ours = quantized_model(), quantized_model()
    arrays = [(n, mx.array(a).view(mx.bfloat16) if d == "BF16" else mx.array(a)) for n, d, a in mlx_tensors(grid)]
    ours.load_weights(arrays, strict=True)
    mx.eval(ours.parameters())
    mine, theirs = dict(tree_flatten(ours.parameters())), dict(tree_flatten(own.parameters()))
    file = {n: a for n, _d, a in mlx_tensors(grid)}
    assert mine.keys() == file.keys() == theirs.keys()

    def raw(x: mx.array) -> np.ndarray:
        return np.array(x.view(mx.uint16) if x.dtype == mx.bfloat16 else x)

    for name, x in mine.items():
        assert np.array_equal(raw(x), file[name]), name  # bit for bit what was hashed
    scales = [n for n in mine if n.endswith((".scales", ".biases"))]
    assert scales and all(np.array_equal(raw(mine[n]), raw(theirs[n])) for n in scales)
    codes = [n for n in mine if mine[n].dtype == mx.uint32]
    same = np.mean(np.concatenate([
        (raw(mine[n]).view(np.uint8) == raw(theirs[n]).view(np.uint8)).reshape(-1) for n in codes
    ]))  # fmt: skip
    assert same > 0.7  # the rest differ by one: ours are rounded against the bf16 scale MLX keeps, not its fp32 one
    ids = mx.array([[1, 5, 9, 17, 33, 65, 100, 7]])
    a, b = np.array(ours(ids).astype(mx.float32)), np.array(own(ids).astype(mx.float32))
    assert np.abs(a - b).max() < 0.25 * np.abs(b).max()


@pytest.mark.parametrize("encoding", ["int8-grid", "int4-grid"])
def test_a_publisher_ships_grid_versions_as_patches_of_codes(tmp_path, tiny_model_dir, encoding):
    """The real Publisher in int8-grid (int4-grid): version 0 an anchor on fresh grids, the next ones patches of
    their parent's grid file that a sampler's store rebuilds bit for bit; the grids stay frozen, so a patch carries
    codes only."""
    import shutil

    import torch
    from libp2p.crypto.ed25519 import create_new_key_pair

    from node.weights.manifest import WEIGHTS_FILE
    from node.weights.publish import Publisher
    from node.weights.store import ChunkStore
    from trainer.model import load_model, save_model_dir

    pub = Publisher(ChunkStore(tmp_path / "t"), create_new_key_pair(), "g", chunk_size=16 << 10, encoding=encoding,
                    patch_max_fraction=0.5)  # fmt: skip
    node = ChunkStore(tmp_path / "s")
    model = load_model(tiny_model_dir)
    g = torch.Generator().manual_seed(0)
    metas = []
    for version in range(3):
        if version:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=g).sign() * 2e-5)
        staging = save_model_dir(model, pub.staging_dir(version), tiny_model_dir, torch.bfloat16)
        metas.append(pub.publish(staging, version))
        published = tmp_path / f"v{version}.safetensors"
        shutil.copyfile(pub.links / f"v{version}.safetensors", published)
        _, signed, m = metas[-1]
        assert m.encoding == encoding and file_grid_bits(published) == int(encoding[3])
        w.Manifest.from_body(signed.body)  # the wire's own checks accept it
        node.add_manifest(signed, m)
        route = "full" if version == 0 else "patch"
        assert (m.patch is None) == (version == 0)
        node.put_verified({h: pub.store.read(h) for h in node.route_chunks(m, route)})
        out = node.assemble(m) if version == 0 else node.build_patched(m, metas[-2][2])[0]
        assert (out / WEIGHTS_FILE).read_bytes() == published.read_bytes()
        stats = pub.last_stats
        assert stats is not None and stats.grid is not None and stats.grid.tensors > 0
        if version:
            touched = {m.tensors[d.tensor].name for d in m.patch.deltas}
            # the padding token's embedding row is all zero at version 0: its 2 groups' grids are as narrow as its
            # weights, which each step here widens past them, so they get fresh grids; every other grid stays
            assert stats.grid.regridded == 2
            grids = {n for n in touched if n.endswith((".scales", ".biases"))}
            assert grids == {"model.embed_tokens.scales", "model.embed_tokens.biases"}
            assert any(m.tensors[d.tensor].dtype == "U8" for d in m.patch.deltas)
            assert m.patch.size < 0.05 * stats.full_bytes
