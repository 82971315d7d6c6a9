"""bench/delta: policy versions as sparse patches (issue 12), against full bf16 versions, measured in one run.

Part 1, on this machine: a Qwen2 of ~31M parameters (trainer/tiny_qwen2.py, 10 layers x 512, built
deterministically) is trained with the real Learner (fp32 master weights and compute, AdamW, versions published in
bf16) for a few GRPO steps at each learning rate (1e-6, 1e-5, 1e-4). Each step trains on real rollouts: groups of the
reverse task sampled by a torch engine running the current version, rewarded by the task, scored by the learner. The
real Publisher publishes every version as a patch of its parent; a sampler's ChunkStore rebuilds it from the parent
and the patch chunks; a torch engine and an MLX int8 engine take it in place (``install`` with the changed
positions), while a second engine of each kind does a full swap of the same version (the baseline). Per version:

- bytes: the patch (and patch + signed manifest) as a fraction of the full bf16 weights file; bf16 elements changed;
- trainer: the patch build time (compare, encode, compress, hash), against publishing the full version;
- sampler: rebuild time (patch -> verified weights file), against reassembling a full version from its chunks;
  in-place engine update time, torch and MLX int8, against a full swap of the same engine kind;
- bit-exactness: the rebuilt file is byte-identical to the trainer's, every tensor hashes to its manifest entry,
  and every in-place engine holds exactly the parameters the swapped engine holds.

int8-grid (issue 27), in part 1: every version is also published by a second Publisher as int8-grid (MLX int8
group codes on grids frozen from version 0, node/weights/grid.py) and rebuilt from its patch by a second sampler
store: bytes per version against the bf16 patch and the full int8 file, groups re-gridded, bit-exactness. Both
patch kinds' streams are also compressed by zstd 1-3 (and with a trained dictionary) and in grail's sparse layout
(bench/delta_grid.py). Then the frozen grid's fidelity: logprob differences on the realistic trained fixture after
10 and 50 versions of real AdamW steps at each lr (bench/delta_grid.py says how).

Part 2, in the WAN lab (bench/wan.py's network namespaces, one process per node running the product's weight
stack; needs root): the origin replays the real lr=1e-6 versions of part 1 as bf16 versions; rounds alternate a
version shipped whole (no patch) and one shipped as a patch (the product's default), and each round's time from
publish to the last sampler holding the version is compared, full against patch, in the same run.

Writes bench/results/delta.txt and bench/results/delta.png. Takes about 10 minutes on a 2-core box.

    .venv/bin/python bench/delta.py [--steps 4] [--layers 10 --hidden 512] [--wan-samplers 6] [--no-wan]
        [--fidelity-versions 50]

Without the WAN lab (--no-wan, or no root), part 2's lines are carried over from the last results file, marked so.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import msgpack
import numpy as np
import torch
from rich.console import Console
from rich.progress import Progress, TaskID
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from libp2p.crypto.ed25519 import create_new_key_pair

from bench.delta_grid import Fidelity, Streams, codec_sizes, fidelity, fidelity_lines, patch_streams
from bench.netlab.topology import lab_unavailable
from bench.wan import Round, delta_lines, run_lab
from node.engines import Engine, install, make_engine
from node.weights.grid import GRID_ENCODING, rule_for
from node.weights.hashes import hash_weights
from node.weights.manifest import WEIGHTS_FILE
from node.weights.patch import INTS, UINTS, build_patch
from node.weights.publish import Publisher
from node.weights.store import ChunkStore
from protocols.weights import Manifest, SignedManifest
from protocols.weights_file import read_layout
from trainer.groups import Group, has_signal
from trainer.learner import Learner
from trainer.model import load_model
from trainer.settings import LearnerSettings
from trainer.tasks.reverse import ReverseDigitsTask
from trainer.tiny_qwen2 import build_random_model

console = Console()
RESULTS = Path(__file__).resolve().parent / "results"
LRS = (1e-6, 1e-5, 1e-4)
TARGET_FRACTION = 0.02  # of the full bf16 version, per version at lr 1e-6
TARGET_SPEEDUP = 20.0  # time to all samplers, full / patch, in the WAN lab
TARGET_GRID = 0.003  # an int8-grid patch, of the full bf16 version, per version at lr 1e-6 (worst step)
MLX_BITS = 8


@dataclass
class Row:
    """One published version."""

    lr: float
    version: int
    full_bytes: int
    patch_bytes: int
    manifest_bytes: int
    changed: int
    elements: int
    learn_s: float
    build_s: float
    publish_s: float
    rebuild_s: float
    torch_update_s: float
    torch_swap_s: float
    mlx_update_s: float
    mlx_swap_s: float
    exact_file: bool
    exact_hashes: bool
    exact_torch: bool
    exact_mlx: bool
    reward: float
    floor_bytes: float  # entropy of the changes, positions and values iid per tensor: no such coder does better
    ctx_floor_bytes: float  # the same, positions conditioned on the parent element's exponent
    lzma_bytes: int | None  # the same patch with the product's lzma codec (measured when zlib's is under 10%)
    grid_patch_bytes: int = 0  # the int8-grid version's patch (node/weights/grid.py)
    grid_full_bytes: int = 0  # the int8-grid version's whole weights file
    grid_changed: int = 0  # codes (and other elements) its patch changes
    grid_regridded: int = 0  # groups the re-grid rule gave a fresh grid at this version
    grid_exact: bool = False  # rebuilt from its parent and patch by a sampler's store: the trainer's file, bit for bit
    codecs: dict[str, dict[str, tuple[int, int]]] = field(default_factory=dict)  # stream -> codec -> (index, value)

    @property
    def fraction(self) -> float:
        return self.patch_bytes / self.full_bytes

    @property
    def wire_fraction(self) -> float:
        return (self.patch_bytes + self.manifest_bytes) / self.full_bytes

    @property
    def exact(self) -> bool:
        return self.exact_file and self.exact_hashes and self.exact_torch and self.exact_mlx

    @property
    def grid_fraction(self) -> float:
        return self.grid_patch_bytes / self.full_bytes


@dataclass
class LrRun:
    lr: float
    full_publish_s: float  # version 0: published whole (cut, hash, store)
    full_assemble_s: float  # version 0 on the sampler: reassembled from its chunks
    full_manifest_bytes: int
    rows: list[Row] = field(default_factory=list)
    grid: str = GRID_ENCODING  # the grid encoding of the grid columns (--grid-bits)


# -- rollouts ------------------------------------------------------------------------------------------------------
def rollouts(
    engine: Engine, learner: Learner, task: ReverseDigitsTask, seed: int, groups: int, group_size: int
) -> tuple[list[Group], int]:
    """``groups`` GRPO groups with reward variance, sampled by ``engine`` (running the learner's current version)
    and scored by the learner at that version; returns them and the next seed."""
    out: list[Group] = []
    codec = learner.codec
    while len(out) < groups:
        seed += 1
        prompt = codec.encode_prompt(task.prompt(seed))
        gens = engine.generate([prompt] * group_size, temperature=1.0, top_p=1.0, max_tokens=8, seed=seed)
        texts = [codec.completion_text(g.completion_ids) for g in gens]
        rewards = [task.reward(seed, t) for t in texts]
        if not has_signal(rewards):
            continue
        comps = [g.completion_ids for g in gens]
        old = learner.logprobs(learner.version, [prompt] * len(comps), comps, 1.0)
        assert old is not None
        solved = [task.solved(seed, t) for t in texts]
        sampled = [g.logprobs for g in gens]
        version = learner.version
        out.append(
            Group(str(seed), "bench", version, task.name, seed, prompt, comps, sampled, old, rewards, solved, 1.0)
        )
    return out, seed


# -- sizes ---------------------------------------------------------------------------------------------------------
def binary_entropy(k: np.ndarray, n: np.ndarray) -> float:
    """Bits to say which ``k`` of ``n`` elements changed, coin by coin, summed over the (k, n) pairs."""
    k, n = k.astype(np.float64), n.astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(n > 0, k / np.maximum(n, 1), 0.0)
        h = -(np.where(p > 0, p * np.log2(p), 0.0) + np.where(p < 1, (1 - p) * np.log2(1 - p), 0.0))
    return float(np.sum(n * h))


def entropy_floors(old_path: Path, new_path: Path) -> tuple[float, float]:
    """Bytes the changes from one file to the other take at least for a coder that sees, in each tensor, which
    elements changed as iid coins (the tensor's own rate) and the bit deltas as iid draws (the tensor's own
    histogram): the Shannon entropy of both, summed over tensors. Second: the same with the coin's rate
    conditioned on the parent element's exponent (a bf16 weight moved by a fixed step flips more often the
    smaller it is, and the receiver knows the parent), what a context-modelling coder could reach."""
    _, layout = read_layout(new_path)
    old_mm = np.memmap(old_path, dtype=np.uint8, mode="r")
    new_mm = np.memmap(new_path, dtype=np.uint8, mode="r")
    iid = ctx = 0.0
    for t in layout:
        width = t.nbytes // t.numel if t.numel else 0
        if width not in UINTS:
            continue
        old = old_mm[t.offset : t.offset + t.nbytes].view(UINTS[width])
        new = new_mm[t.offset : t.offset + t.nbytes].view(UINTS[width])
        hit = old != new
        k = int(np.count_nonzero(hit))
        if k == 0:
            continue
        _, counts = np.unique((new[hit] - old[hit]).view(INTS[width]), return_counts=True)
        q = counts / k
        values = -k * float(np.sum(q * np.log2(q)))
        iid += binary_entropy(np.array([k]), np.array([t.numel])) + values
        if t.dtype == "BF16":
            exponent = (old >> np.uint16(7)) & np.uint16(0xFF)
            n_e = np.bincount(exponent, minlength=256)
            k_e = np.bincount(exponent[hit], minlength=256)
            ctx += binary_entropy(k_e, n_e) + values
        else:
            ctx += binary_entropy(np.array([k]), np.array([t.numel])) + values
    del old_mm, new_mm
    return iid / 8, ctx / 8


# -- exactness -----------------------------------------------------------------------------------------------------
def torch_same(a: Engine, b: Engine) -> bool:
    sa, sb = a.model.state_dict(), b.model.state_dict()  # type: ignore[attr-defined]
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def mlx_params(engine: Engine) -> dict[str, tuple[str, np.ndarray]]:
    """Every parameter of an MLX engine as (dtype, bits), read on the engine's own MLX thread."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    def read() -> dict[str, tuple[str, np.ndarray]]:
        flat = tree_flatten(engine.model.parameters())  # type: ignore[attr-defined]
        return {k: (str(v.dtype), np.array(v.view(mx.uint16) if v.dtype == mx.bfloat16 else v)) for k, v in flat}

    return engine._thread.call(read)  # type: ignore[attr-defined]


def mlx_same(a: Engine, b: Engine) -> bool:
    pa, pb = mlx_params(a), mlx_params(b)
    return pa.keys() == pb.keys() and all(pa[k][0] == pb[k][0] and np.array_equal(pa[k][1], pb[k][1]) for k in pa)


def timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0


# -- part 1 --------------------------------------------------------------------------------------------------------
def run_lr(
    root: Path,
    model_dir: Path,
    lr: float,
    steps: int,
    batch: tuple[int, int],
    progress: Progress,
    bar: TaskID,
    keep: Path | None = None,
    grid: str = GRID_ENCODING,
) -> LrRun:
    """Train ``steps`` GRPO steps at ``lr``, publishing each version as a patch and taking it in on a sampler.
    ``keep``: also copy every version's model dir there (v0, v1, ...), for the WAN lab to replay."""
    root.mkdir(parents=True)
    task = ReverseDigitsTask()
    settings = LearnerSettings(lr=lr, dtype="fp32", publish_dtype="bf16", torch_threads=2, seed=0)
    learner = Learner(model_dir, settings, keep_versions=3, work_dir=root / "learner")
    # a patch whatever its size (the point is to measure it), no anchors in between
    pub = Publisher(
        ChunkStore(root / "trainer"), create_new_key_pair(), "delta", anchor_every=1 << 20, patch_max_fraction=10.0
    )
    node = ChunkStore(root / "sampler")
    # the same versions in the encoding an MLX int8 (int4) sampler runs: codes on grids frozen from version 0
    gpub = Publisher(
        ChunkStore(root / "grid-trainer"), create_new_key_pair(), "delta-grid", anchor_every=1 << 20,
        patch_max_fraction=10.0, encoding=grid,
    )  # fmt: skip
    gnode = ChunkStore(root / "grid-sampler")
    kept = root / "kept"  # each encoding's previous file, for the codec comparison
    kept.mkdir()

    def publish(version: int) -> tuple[bytes, SignedManifest, Manifest]:
        staging = learner.save_model_dir(pub.staging_dir(version))
        if keep is not None:
            shutil.copytree(staging, keep / f"v{version}", copy_function=shutil.copy2)
        shutil.copytree(staging, gpub.staging_dir(version), copy_function=shutil.copy2)
        return pub.publish(staging, version)

    def give(meta: tuple[bytes, SignedManifest, Manifest], route: str, store: ChunkStore = node, src=pub) -> None:
        _, signed, m = meta
        store.add_manifest(signed, m)
        store.put_verified({h: src.store.read(h) for h in store.route_chunks(m, route)})

    def wire_size(signed: SignedManifest) -> int:
        return len(msgpack.packb(signed.to_wire(), use_bin_type=True))

    progress.update(bar, description=f"lr {lr:g}: version 0, engines")
    meta, full_publish_s = timed(publish, 0)
    give(meta, "full")
    gmeta = gpub.publish(gpub.staging_dir(0), 0)
    give(gmeta, "full", gnode, gpub)
    gnode.assemble(gmeta[2])
    shutil.copyfile(gpub.links / "v0.safetensors", kept / "grid.safetensors")
    previous: dict[str, Streams] = {}
    d0, full_assemble_s = timed(node.assemble, meta[2])
    run = LrRun(lr, full_publish_s, full_assemble_s, wire_size(meta[1]), grid=grid)
    live_torch, ref_torch = make_engine("torch", d0, version=0), make_engine("torch", d0, version=0)
    live_mlx, ref_mlx = (make_engine("mlx", d0, bits=MLX_BITS, version=0) for _ in range(2))
    seed = int(lr * 1e9)
    for step in range(1, steps + 1):
        progress.update(bar, description=f"lr {lr:g}: step {step}/{steps}, rollouts")
        groups, seed = rollouts(live_torch, learner, task, seed, *batch)
        progress.update(bar, description=f"lr {lr:g}: step {step}/{steps}, learning")
        metrics, learn_s = timed(learner.step, groups)
        version = learner.new_version()
        progress.update(bar, description=f"lr {lr:g}: step {step}/{steps}, publishing")
        parent = meta
        meta = publish(version)
        _, signed, m = meta
        stats = pub.last_stats
        assert stats is not None and m.patch is not None and stats.patch_bytes is not None
        floor, ctx_floor = entropy_floors(learner.scorer.path(version - 1), learner.scorer.path(version))
        lzma_bytes = None
        if stats.patch_bytes < 0.1 * stats.full_bytes:
            again = build_patch(learner.scorer.path(version - 1), learner.scorer.path(version), "lzma")
            assert again is not None
            lzma_bytes = again.size
        progress.update(bar, description=f"lr {lr:g}: step {step}/{steps}, {grid}")
        gparent = gmeta
        gmeta = gpub.publish(gpub.staging_dir(version), version)
        gstats = gpub.last_stats
        assert gstats is not None and gstats.patch_bytes is not None and gstats.grid is not None
        give(gmeta, "patch", gnode, gpub)
        gout, _gchanges = gnode.build_patched(gmeta[2], gparent[2])
        grid_file = gpub.links / f"v{version}.safetensors"
        grid_exact = (gout / WEIGHTS_FILE).read_bytes() == grid_file.read_bytes()
        codecs = {}
        pairs = (
            ("bf16", learner.scorer.path(version - 1), learner.scorer.path(version)),
            (grid, kept / "grid.safetensors", grid_file),
        )
        for kind, old, new in pairs:
            streams = patch_streams(old, new)
            codecs[kind] = codec_sizes(streams, previous.get(kind))
            previous[kind] = streams
        shutil.copyfile(grid_file, kept / "grid.safetensors")
        gnode.gc(keep=2)
        progress.update(bar, description=f"lr {lr:g}: step {step}/{steps}, sampler")
        give(meta, "patch")
        (out, changes), rebuild_s = timed(node.build_patched, m, parent[2])
        assert changes is not None
        published = learner.scorer.path(version)
        exact_file = (out / WEIGHTS_FILE).read_bytes() == published.read_bytes()
        _, layout = read_layout(out / WEIGHTS_FILE)
        header_hash, hashes = hash_weights(out / WEIGHTS_FILE, layout)
        exact_hashes = header_hash == m.patch.header_hash and hashes == [t.hash for t in m.tensors]
        how, torch_update_s = timed(install, live_torch, out, version, changes)
        assert how == "updated", how
        _, torch_swap_s = timed(ref_torch.swap, out, version)
        how, mlx_update_s = timed(install, live_mlx, out, version, changes)
        assert how == "updated", how
        _, mlx_swap_s = timed(ref_mlx.swap, out, version)
        run.rows.append(
            Row(
                lr,
                version,
                stats.full_bytes,
                stats.patch_bytes,
                wire_size(signed),
                stats.changed,
                stats.elements,
                learn_s,
                stats.patch_seconds,
                stats.seconds,
                rebuild_s,
                torch_update_s,
                torch_swap_s,
                mlx_update_s,
                mlx_swap_s,
                exact_file,
                exact_hashes,
                torch_same(live_torch, ref_torch),
                mlx_same(live_mlx, ref_mlx),
                metrics["reward"],
                floor,
                ctx_floor,
                lzma_bytes,
                gstats.patch_bytes,
                gstats.full_bytes,
                gstats.changed,
                gstats.grid.regridded,
                grid_exact,
                codecs,
            )
        )
        r = run.rows[-1]
        progress.console.print(
            f"lr {lr:g} v{version}: patch {r.patch_bytes / 1e6:.3f} MB = {r.fraction:.2%} of {r.full_bytes / 1e6:.1f}"
            f" MB ({r.changed / r.elements:.2%} of elements changed), build {r.build_s:.2f} s,"
            f" rebuild {r.rebuild_s:.2f} s,"
            f" torch {r.torch_update_s:.3f}/{r.torch_swap_s:.3f} s, mlx {r.mlx_update_s:.3f}/{r.mlx_swap_s:.3f} s"
            f" (update/swap), bit-exact {r.exact}; {grid} patch {r.grid_patch_bytes / 1e6:.3f} MB ="
            f" {r.grid_fraction:.3%} of full bf16 ({r.grid_regridded} groups re-gridded), bit-exact {r.grid_exact}"
        )
        node.gc(keep=2)
        progress.advance(bar)
    return run


# -- part 2 --------------------------------------------------------------------------------------------------------
def run_wan(versions: Path, args: argparse.Namespace, progress: Progress) -> list[Round]:
    """The WAN lab: the origin replays ``versions`` (v0, v1, ...); rounds alternate full and patch."""
    modes = [m for _ in range(args.wan_rounds) for m in ("full", "patch")]
    origin_args = ("--delta", "--versions", str(versions))
    with TemporaryDirectory(prefix="swarmrl-delta-wan-") as tmp:
        _, rounds = run_lab(
            Path(tmp),
            versions / "v0",
            args.wan_samplers,
            args.origin_mbps,
            args.link_scale,
            modes,
            progress,
            origin_args,
        )
    return rounds


# -- reporting -----------------------------------------------------------------------------------------------------
def mean(xs: Iterable[float]) -> float:
    return statistics.mean(list(xs))


def median(xs: Iterable[float]) -> float:
    return statistics.median(list(xs))


def lr_lines(runs: list[LrRun]) -> tuple[Table, list[str]]:
    g = runs[0].grid
    table = Table(title="bench/delta: one version as a patch against full bf16 (bytes: mean over steps; times: median)")
    cols = (
        "lr",
        "changed elems",
        "patch / full",
        "max",
        "+manifest",
        "lzma",
        "floor iid",
        "floor ctx",
        "build s (full publish)",
        "rebuild s (full assemble)",
        "torch update s (swap)",
        "mlx int8 update s (swap)",
        "bit-exact",
        f"{g} patch / full bf16",
        "grid max",
        f"grid / full {g[:4]}",
        "grid bit-exact",
    )
    for c in cols:
        table.add_column(c)
    lines = []
    for run in runs:
        rows = run.rows
        cells = (
            f"{run.lr:g}",
            f"{mean(r.changed / r.elements for r in rows):.3%}",
            f"{mean(r.fraction for r in rows):.3%}",
            f"{max(r.fraction for r in rows):.3%}",
            f"{mean(r.wire_fraction for r in rows):.3%}",
            f"{mean(r.lzma_bytes / r.full_bytes for r in rows):.3%}" if all(r.lzma_bytes for r in rows) else "-",
            f"{mean(r.floor_bytes / r.full_bytes for r in rows):.3%}",
            f"{mean(r.ctx_floor_bytes / r.full_bytes for r in rows):.3%}",
            f"{median(r.build_s for r in rows):.2f} ({run.full_publish_s:.2f})",
            f"{median(r.rebuild_s for r in rows):.2f} ({run.full_assemble_s:.2f})",
            f"{median(r.torch_update_s for r in rows):.3f} ({median(r.torch_swap_s for r in rows):.3f})",
            f"{median(r.mlx_update_s for r in rows):.3f} ({median(r.mlx_swap_s for r in rows):.3f})",
            f"{sum(r.exact for r in rows)}/{len(rows)}",
            f"{mean(r.grid_fraction for r in rows):.3%}",
            f"{max(r.grid_fraction for r in rows):.3%}",
            f"{mean(r.grid_patch_bytes / r.grid_full_bytes for r in rows):.3%}",
            f"{sum(r.grid_exact for r in rows)}/{len(rows)}",
        )
        table.add_row(*cells)
        lines.append("  ".join(f"{c}={v}" for c, v in zip(cols, cells, strict=True)))
        for r in rows:
            lines.append(
                f"    lr {r.lr:g} v{r.version}: full {r.full_bytes} B, patch {r.patch_bytes} B ({r.fraction:.3%}), "
                f"manifest {r.manifest_bytes} B, lzma {r.lzma_bytes or '-'} B, entropy floors iid "
                f"{r.floor_bytes / r.full_bytes:.3%} ctx {r.ctx_floor_bytes / r.full_bytes:.3%}, "
                f"changed {r.changed}/{r.elements} ({r.changed / r.elements:.3%}), "
                f"learn {r.learn_s:.2f} s, build {r.build_s:.3f} s, publish {r.publish_s:.3f} s, "
                f"rebuild {r.rebuild_s:.3f} s, torch update {r.torch_update_s:.3f} s / swap {r.torch_swap_s:.3f} s, "
                f"mlx update {r.mlx_update_s:.3f} s / swap {r.mlx_swap_s:.3f} s, exact file {r.exact_file} "
                f"hashes {r.exact_hashes} torch {r.exact_torch} mlx {r.exact_mlx}, reward {r.reward:.3f}; "
                f"{g}: full {r.grid_full_bytes} B, patch {r.grid_patch_bytes} B ({r.grid_fraction:.3%} of full "
                f"bf16, {r.grid_patch_bytes / r.grid_full_bytes:.3%} of full {g[:4]}), {r.grid_changed} elements "
                f"changed, {r.grid_regridded} groups re-gridded, exact {r.grid_exact}"
            )
    return table, lines


def codec_lines(runs: list[LrRun]) -> list[str]:
    """Per lr and stream (bf16, the grid encoding): each codec's index and value bytes, summed over the versions, as
    a share of the full bf16 versions; the best per stream kind marked."""
    lines = []
    for run in runs:
        full = sum(r.full_bytes for r in run.rows)
        for kind in ("bf16", run.grid):
            names = [c for c in run.rows[-1].codecs.get(kind, {}) if all(c in r.codecs.get(kind, {}) for r in run.rows)]
            if not names:
                continue
            idx = {c: sum(r.codecs[kind][c][0] for r in run.rows) for c in names}
            val = {c: sum(r.codecs[kind][c][1] for r in run.rows) for c in names}
            best_i, best_v = min(idx, key=idx.__getitem__), min(val, key=val.__getitem__)
            cells = "; ".join(
                f"{c} {100 * (idx[c] + val[c]) / full:.3f}% (index {100 * idx[c] / full:.3f}%, values "
                f"{100 * val[c] / full:.3f}%)"
                for c in names
            )
            # the dictionary needs a previous version's streams to train on: over the versions that have one
            later = [r for r in run.rows if "zstd-3 + dictionary" in r.codecs.get(kind, {})]
            if later:
                dic = sum(sum(r.codecs[kind]["zstd-3 + dictionary"]) for r in later)
                plain = sum(sum(r.codecs[kind]["zstd-3"]) for r in later)
                zl = sum(sum(r.codecs[kind]["zlib-6 (product)"]) for r in later)
                cells += (
                    f"; zstd-3 + dictionary (versions {later[0].version}-{later[-1].version}, its 2 x 16 KiB "
                    f"counted each version) {dic / plain:.3f}x zstd-3, {dic / zl:.3f}x zlib-6"
                )
            lines.append(
                f"    lr {run.lr:g} {kind} patches, % of full bf16 (versions {run.rows[0].version}-"
                f"{run.rows[-1].version}): {cells}. Best index stream: {best_i}; best value stream: {best_v}"
            )
    return lines


def verdicts(runs: list[LrRun], rounds: list[Round] | None) -> list[str]:
    out, g = [], runs[0].grid
    low = next((run for run in runs if run.lr == LRS[0]), None)
    if low is not None:
        worst = max(r.fraction for r in low.rows)
        ok = "MET" if worst <= TARGET_FRACTION else "MISSED"
        out.append(
            f"target <= {TARGET_FRACTION:.0%} of full bf16 per version at lr {LRS[0]:g}: worst {worst:.3%} ({ok})"
        )
        worst = max(r.grid_fraction for r in low.rows)
        ok = "MET" if worst <= TARGET_GRID else "MISSED"
        out.append(
            f"target {g} patch <= {TARGET_GRID:.1%} of full bf16 per version at lr {LRS[0]:g}: worst {worst:.3%} ({ok})"
        )
    rows = [r for run in runs for r in run.rows]
    exact = sum(r.exact for r in rows)
    out.append(f"target bit-exact: {exact}/{len(rows)} versions ({'MET' if exact == len(rows) else 'MISSED'})")
    exact = sum(r.grid_exact for r in rows)
    out.append(f"target {g} bit-exact: {exact}/{len(rows)} versions ({'MET' if exact == len(rows) else 'MISSED'})")
    if rounds:
        ratio = mean(r.t_all for r in rounds if r.mode == "full") / mean(r.t_all for r in rounds if r.mode == "patch")
        ok = "MET" if ratio >= TARGET_SPEEDUP else "MISSED"
        out.append(f"target >= {TARGET_SPEEDUP:.0f}x less time to all samplers (WAN lab): {ratio:.1f}x ({ok})")
    return out


def plot(runs: list[LrRun], rounds: list[Round] | None, png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter, NullFormatter

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    ax = axes[0]
    width = 0.8 / max(1, max(len(run.rows) for run in runs))
    for k, run in enumerate(runs):
        for j, r in enumerate(run.rows):
            at = k + (j - (len(run.rows) - 1) / 2) * width
            ax.bar(at, 100 * r.fraction, width * 0.9, color=f"C{k}")
            ax.plot(
                [at],
                [100 * r.ctx_floor_bytes / r.full_bytes],
                "kx",
                label="entropy floor, context" if not k + j else None,
            )
            ax.bar(at, 100 * r.grid_fraction, width * 0.5, color="k", alpha=0.6,
                   label=f"{run.grid} patch" if not k + j else None)  # fmt: skip
        ax.plot(
            [k - 0.4, k + 0.4], [100 * mean(r.changed / r.elements for r in run.rows)] * 2, "k:", lw=1.5,
            label="bf16 elements changed" if k == 0 else None,
        )  # fmt: skip
    ax.axhline(100 * TARGET_FRACTION, color="grey", ls="--", label=f"target {TARGET_FRACTION:.0%} at lr {LRS[0]:g}")
    ax.axhline(100 * TARGET_GRID, color="k", ls=":", label=f"int8-grid target {TARGET_GRID:.1%} at lr {LRS[0]:g}")
    ax.set_xticks(range(len(runs)), [f"lr {run.lr:g}" for run in runs])
    ax.set(yscale="log", ylabel="% of the full bf16 version", title="patch bytes per version (a bar per step)")
    ax.set_ylim(bottom=0.05)
    ax.set_yticks([0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50])
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.legend(fontsize=8)
    ax = axes[1]
    x = np.arange(len(runs))
    for off, key, label in (
        (-0.3, "torch_update_s", "torch in place"),
        (-0.1, "torch_swap_s", "torch swap"),
        (0.1, "mlx_update_s", "MLX int8 in place"),
        (0.3, "mlx_swap_s", "MLX int8 swap"),
    ):
        ax.bar(x + off, [median(getattr(r, key) for r in run.rows) for run in runs], 0.18, label=label)
    ax.plot(x, [median(r.rebuild_s for r in run.rows) for run in runs], "ko-", label="rebuild file from patch")
    ax.set_xticks(x, [f"lr {run.lr:g}" for run in runs])
    ax.set(ylabel="seconds (median over steps)", title="sampler: applying a version")
    ax.legend(fontsize=8)
    ax = axes[2]
    if rounds:
        seen = set()
        for r in rounds:
            ys = [(i + 1) / len(r.arrivals) for i in range(len(r.arrivals))]
            color = "tab:red" if r.mode == "full" else "tab:blue"
            label = f"{r.mode} ({r.size / 1e6:.2f} MB)" if r.mode not in seen else None
            ax.step([r.arrivals[0], *r.arrivals], [0, *ys], where="post", color=color, label=label)
            seen.add(r.mode)
        ax.set(xscale="log", xlabel="seconds after publish (log)", ylabel="fraction of samplers holding it")
        ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
        ratio = mean(r.t_all for r in rounds if r.mode == "full") / mean(r.t_all for r in rounds if r.mode == "patch")
        ax.set_title(f"WAN lab: version to all samplers (full / patch = {ratio:.1f}x)")
        ax.legend(fontsize=8)
    else:
        ax.set_title("WAN lab: not run")
    for ax in axes:
        ax.grid(alpha=0.3, which="both")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def previous_wan(path: Path, verdict: bool = False) -> list[str]:
    """Part 2 of the last results file (the WAN lab, not rerun this time), labelled as such: its block, or its
    verdict line."""
    if not path.exists():
        return []
    old = path.read_text().splitlines()
    if verdict:
        tag = " [previous run]"
        return [line.removesuffix(tag) + tag for line in old if line.startswith("target >=") and "WAN lab" in line]
    start = next((i for i, line in enumerate(old) if line.startswith("part 2:")), None)
    if start is None:
        return []
    end = next((i for i in range(start, len(old)) if old[i].startswith("target ")), len(old))
    head = old[start]
    if "[not rerun here" not in head:
        when = old[0].split("(", 1)[1].split(",", 1)[0] if "(" in old[0] else "?"
        head += f" [not rerun here: the previous run's, {when}]"
    return [head, *old[start + 1 : end]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4, help="GRPO steps (versions) per learning rate")
    ap.add_argument("--lrs", type=float, nargs="+", default=list(LRS))
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--groups", type=int, default=4, help="groups per GRPO batch")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--no-wan", action="store_true", help="skip part 2 (the WAN lab)")
    ap.add_argument("--wan-samplers", type=int, default=6)
    ap.add_argument("--wan-rounds", type=int, default=2, help="versions per mode (full, patch) in the WAN lab")
    ap.add_argument("--origin-mbps", type=float, default=25.0, help="WAN lab: the trainer's uplink")
    ap.add_argument("--link-scale", type=float, default=1.0, help="WAN lab: samplers' access links x this")
    ap.add_argument("--out", default="delta", help="results file stem under bench/results")
    ap.add_argument(
        "--fidelity-versions", type=int, default=50, help="the grid's fidelity: AdamW steps per lr (0: skip)"
    )
    ap.add_argument(
        "--grid-bits", type=int, choices=(8, 4), default=8, help="the grid columns' width: int8-grid or int4-grid"
    )
    args = ap.parse_args()
    wan = not args.no_wan
    grid = f"int{args.grid_bits}-grid"
    if wan and (why := lab_unavailable()):
        console.print(f"[yellow]no WAN lab ({why}): part 2 skipped")
        wan = False
    if wan and (LRS[0] not in args.lrs or args.steps < 2 * args.wan_rounds):
        raise SystemExit(f"the WAN lab replays lr {LRS[0]:g}'s versions: it needs that lr and --steps >= 2 x rounds")
    t_start, load_start = time.time(), os.getloadavg()[0]
    rounds: list[Round] | None = None
    with TemporaryDirectory(prefix="swarmrl-delta-") as tmp, Progress(console=console) as progress:
        root = Path(tmp)
        progress.console.print("building the model")
        model = build_random_model(root / "model", layers=args.layers, hidden=args.hidden)
        n_params = sum(p.numel() for p in load_model(model).parameters())
        progress.console.print(f"{n_params / 1e6:.1f}M parameters ({args.layers} layers x {args.hidden})")
        bar = progress.add_task("part 1", total=len(args.lrs) * args.steps)
        runs = []
        versions = root / "versions"
        versions.mkdir()
        for lr in args.lrs:
            keep = versions if wan and lr == LRS[0] else None
            batch = (args.groups, args.group_size)
            runs.append(run_lr(root / f"lr{lr:g}", model, lr, args.steps, batch, progress, bar, keep, grid))
            shutil.rmtree(root / f"lr{lr:g}")
        if wan:
            rounds = run_wan(versions, args, progress)
        fid: list[Fidelity] = []
        if args.fidelity_versions:
            from trainer.realistic_model import cached_realistic_model

            realistic = cached_realistic_model(cache_dir=Path(__file__).resolve().parents[1] / "runs" / ".fixtures")
            at = tuple(v for v in (0, 10, 50, args.fidelity_versions) if v <= args.fidelity_versions)
            for lr in args.lrs:
                progress.console.print(f"{grid} fidelity: lr {lr:g}, {args.fidelity_versions} versions")
                fid += fidelity(realistic, lr, args.fidelity_versions, tuple(sorted(set(at))), bits=args.grid_bits)
    elapsed = time.time() - t_start
    table, lines = lr_lines(runs)
    console.print(table)
    head = (
        f"bench/delta ({time.strftime('%Y-%m-%d')}, this {os.cpu_count()}-core CPU box): "
        f"{n_params / 1e6:.1f}M-parameter Qwen2 ({args.layers} layers x {args.hidden}), fp32 AdamW learner "
        f"publishing bf16, {args.steps} GRPO steps "
        f"per lr ({args.groups} groups x {args.group_size} rollouts of the reverse task); full bf16 version "
        f"{runs[0].rows[0].full_bytes / 1e6:.1f} MB; chunk size 1 MiB, zlib patches; MLX int8 engine group 64"
    )
    out = [
        head,
        "part 1: per lr (bytes: mean over steps, max; times: median over steps); baselines in parentheses",
        *lines,
        f"{grid} (node/weights/grid.py): the same versions as MLX {grid[:4]} group codes (group 64, bf16 scales and "
        f"biases) on grids frozen from version 0 (re-gridded per group by the rule: no element over "
        f"{rule_for(args.grid_bits).excess_steps:g} steps outside its codes, step <= 1.25x fresh; a fresh MLX grid "
        f"clips up to {1.5 if args.grid_bits == 8 else 1.02:g}); its patch is the product's patch of the grid file "
        "against its parent's",
        "codecs: the product's patch streams (index: gap varints or bitmap; values: zigzag varints of the bit "
        "deltas) under zlib-6, zstd 1-3 and zstd-3 with a dictionary trained on the previous version's streams "
        "(its bytes counted); grail's layout: index deltas narrowed to uint8/uint16/uint32 per tensor, new values "
        "raw, zstd-3",
        *codec_lines(runs),
    ]
    if fid:
        out += [
            f"{grid} fidelity: the realistic trained fixture (trainer/realistic_model.py), real AdamW steps "
            "(fp32 master weights, its next-token task, batch 32) published as bf16; per completion token of 512 "
            f"teacher-forced task examples, fp32 compute: fresh {grid[:4]} = MLX's own quantization of each version "
            f"(the {grid[:4]} noise itself), grid = the {grid} version, grid no rule = frozen at v0 whatever happens",
            *fidelity_lines(fid),
        ]
    if not rounds:
        out += previous_wan(RESULTS / f"{args.out}.txt")
    if rounds:
        wan_head = (
            f"part 2: WAN lab, {args.wan_samplers} samplers, origin {args.origin_mbps:g} Mbit/s, access links "
            f"x{args.link_scale:g} (20-200 Mbit/s profile), replaying lr {LRS[0]:g}'s versions, rounds alternating "
            f"full and patch ({args.wan_rounds} each)"
        )
        out += [wan_head, *delta_lines(rounds, args.wan_samplers, args.origin_mbps, args.link_scale)]
        for r in rounds:
            out.append(
                f"    v{r.version} {r.mode}: {r.size} B, arrivals {' '.join(f'{a:.2f}' for a in r.arrivals)} s, "
                f"origin uploaded {r.uploaded} B, CPU {r.cpu_share:.0%}"
            )
    out += verdicts(runs, rounds)
    if not rounds:
        out += previous_wan(RESULTS / f"{args.out}.txt", verdict=True)
    out.append(
        f"bench runtime {elapsed:.0f} s; 1-minute load average {load_start:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end (other jobs on the box inflate the times above)"
    )
    for line in out[len(lines) + 2 :]:
        console.print(line)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.txt").write_text("\n".join(out) + "\n")
    plot(
        runs, rounds, RESULTS / f"{args.out}.png", f"bench/delta: {n_params / 1e6:.1f}M-parameter Qwen2, bf16 versions"
    )
    console.print(f"wrote {RESULTS / args.out}.txt and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
