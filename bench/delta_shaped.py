"""bench/delta_shaped: what a version of a 1.5B-parameter policy weighs, and costs, as a bf16 patch and as an
int8-grid patch (issue 27), on a model of Qwen2.5-1.5B's tensor shapes with updates calibrated on real GRPO steps.

No 1.5B checkpoint exists on this machine (no hub downloads), and training one here is out of reach, so the versions
are drawn. The calibration, from bench/results/delta.txt part 1 (real GRPO steps of a 31.5M Qwen2 at lr 1e-6, fp32
master weights published in bf16):

- weights: every matrix, embedding and bias drawn N(0, 0.02) (Qwen2's ``initializer_range``), norms 1 + N(0, 0.1),
  held in fp32 (the learner's master copy) and published rounded to bf16;
- each version moves every master weight by +-lr x a_v (Adam's step is about lr per weight whatever its gradient),
  the sign drawn at random, and a_v fitted on a 4M-weight sample so that the share of bf16 elements that change
  equals the real run's share at that version (v1-v4 as measured; later versions at v4's share: Adam's step
  settles after a few steps). With a_1 = 1 (Adam's first step, exactly lr per weight) this model gives 4.25% of
  bf16 elements changed against the real run's 4.25%, and 0.27% of int8 codes against its 0.31%.
- The int8 code changes are not fitted: each version's share is printed beside the real run's as the check.

Each version goes through the product's two Publishers, as a trainer with bf16 and MLX int8 samplers runs them: bf16
(the sparse patch of node/weights/patch.py) and int8-grid (node/weights/grid.py: codes on grids frozen from version
0, then the same patch codec); one sampler store rebuilds every int8-grid version from its patch, checking every
tensor's hash (bit-exact, or it raises). Per version: patch bytes against the full bf16 file (the issue's target:
the int8-grid patch <= 0.3% at lr 1e-6, worst version), the signed manifest's bytes on the wire, the trainer's
publish seconds per encoding (for int8-grid: encode on the frozen grid, diff, compress, hash, chunk), the sampler's
rebuild seconds. The int8-grid chain is cut into the pieces the origin cuts when it pushes to ``--audience``
samplers (node/weights/policy.py's piece rule, as the trainer's Outbox applies it). ``--keep DIR`` keeps that chain
(the trainer's store, signed with the key at DIR/origin.key) and a sampler's store holding version 0, for bench/wan's
``--replay DIR`` to send the versions through the WAN lab. Writes a dated block to bench/results/delta_shaped.txt,
the per-version numbers to bench/results/delta_shaped.json, and bench/results/delta_shaped.png.

Needs ~14 GB of memory and ~20 GB of disk at the full shape; ``--layers 2`` runs the same in a minute.

    .venv/bin/python bench/delta_shaped.py [--versions 10] [--lr 1e-6] [--layers 28] [--work DIR] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from tempfile import TemporaryDirectory

import msgpack
import numpy as np
from rich.console import Console
from rich.progress import Progress

from node.identity import load_or_create_key
from node.weights import policy
from node.weights.grid import ENCODE_THREADS, GRID_ENCODING, f32_to_bf16
from node.weights.publish import Publisher
from node.weights.store import ChunkStore
from protocols.weights import WEIGHTS_FILE, Manifest, SignedManifest
from protocols.weights_file import encode_header

console = Console()
RESULTS = Path(__file__).resolve().parent / "results"
SIGMA = 0.02  # Qwen2's initializer_range
SWARM = "wanbench"  # the swarm bench/wan's lab runs, so that kept versions replay there
SAMPLE = 1 << 22  # weights the step size is fitted on
BLOCK = 1 << 24  # weights updated at once (bounds the temporaries)
# Qwen2.5-1.5B (its config.json): tied embeddings, 2 KV heads of 128
QWEN25_15B = {"vocab": 151936, "hidden": 1536, "intermediate": 8960, "layers": 28, "heads": 12, "kv_heads": 2}


def tensor_shapes(shape: dict[str, int]) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every published tensor, in the order save_pretrained writes them (tied lm_head left out)."""
    h, i, kv = shape["hidden"], shape["intermediate"], shape["kv_heads"] * (shape["hidden"] // shape["heads"])
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (shape["vocab"], h))]
    for n in range(shape["layers"]):
        p = f"model.layers.{n}."
        out += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.q_proj.bias", (h,)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.k_proj.bias", (kv,)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.bias", (kv,)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (i, h)),
            (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
        ]
    return [*out, ("model.norm.weight", (h,))]


def config_json(shape: dict[str, int]) -> dict:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": shape["vocab"],
        "hidden_size": shape["hidden"],
        "intermediate_size": shape["intermediate"],
        "num_hidden_layers": shape["layers"],
        "num_attention_heads": shape["heads"],
        "num_key_value_heads": shape["kv_heads"],
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "torch_dtype": "bfloat16",
    }


def measured_steps(path: Path, lr: str = "1e-06") -> list[tuple[float, float]]:
    """(bf16 elements changed, int8 codes changed) as shares, per version of the real GRPO run at ``lr``."""
    pat = re.compile(rf"^\s+lr {re.escape(lr)} v\d+: .*?changed (\d+)/(\d+) .*?int8-grid: .*?(\d+) elements changed")
    out = []
    for line in path.read_text().splitlines():
        m = pat.match(line)
        if m:
            changed, total, codes = map(int, m.groups())
            out.append((changed / total, codes / total))
    if not out:
        raise SystemExit(f"no lr {lr} versions in {path}: run bench/delta.py first")
    return out


def bf16_changed(w: np.ndarray, step: float, signs: np.ndarray) -> float:
    return float(np.mean(f32_to_bf16(w + np.where(signs, step, -step).astype(np.float32)) != f32_to_bf16(w)))


def fit_step(w: np.ndarray, lr: float, target: float, rng: np.random.Generator) -> float:
    """a such that moving ``w`` by +-lr x a changes ``target`` of its bf16 elements (bisection in log space)."""
    signs = rng.integers(0, 2, w.size, dtype=np.int8).astype(bool)
    lo, hi = 1e-3, 1e3
    for _ in range(30):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if bf16_changed(w, lr * mid, signs) < target else (lo, mid)
    return (lo * hi) ** 0.5


@dataclass
class Version:
    version: int
    a: float  # the step per weight, in units of lr
    bf16_changed: float  # share of bf16 elements changed (the fitted quantity)
    codes_changed: float  # share of int8 codes changed (the check)
    real_bf16_changed: float
    real_codes_changed: float
    full_bf16: int
    full_grid: int
    bf16_patch: int
    grid_patch: int
    grid_manifest_wire: int  # the signed int8-grid manifest, msgpack as gossiped and fetched
    regridded: int
    write_s: float  # the learner writing the bf16 file (before any publisher)
    bf16_publish_s: float
    grid_publish_s: float
    grid_rebuild_s: float  # one sampler: int8-grid patch -> verified weights file


def wire(signed: SignedManifest) -> int:
    return len(msgpack.packb(signed.to_wire(), use_bin_type=True))


class Drawn:
    """The fp32 master weights of the drawn model, and each version's bf16 file and model dir."""

    def __init__(self, shape: dict[str, int], seed: int) -> None:
        self.shape, self.rng = shape, np.random.default_rng(seed)
        self.tensors = tensor_shapes(shape)
        self.master: dict[str, np.ndarray] = {}
        for name, dims in self.tensors:
            w = self.rng.standard_normal(int(np.prod(dims)), dtype=np.float32)
            if name.endswith("norm.weight"):
                w = 1.0 + w * np.float32(0.1)
            else:
                w *= np.float32(SIGMA)
            self.master[name] = w
        self.layout = encode_header([(n, "BF16", d) for n, d in self.tensors], {"format": "pt"})

    def sample(self) -> np.ndarray:
        """The weights the step is fitted on: the first ones of layer 0's gate projection (a typical matrix)."""
        big = max(self.master, key=lambda n: self.master[n].size if ".layers.0." in n else 0)
        return self.master[big][:SAMPLE]

    def step(self, lr: float, a: float) -> None:
        step = np.float32(lr * a)
        for w in self.master.values():
            for s in range(0, w.size, BLOCK):
                part = w[s : s + BLOCK]
                signs = self.rng.integers(0, 2, part.size, dtype=np.int8).astype(bool)
                part += np.where(signs, step, -step)

    def write(self, model_dir: Path) -> Path:
        """The version as the learner publishes it: config.json and the bf16 weights file."""
        model_dir.mkdir(parents=True)
        (model_dir / "config.json").write_text(json.dumps(config_json(self.shape), indent=1))
        with open(model_dir / WEIGHTS_FILE, "wb") as fh:
            fh.write(self.layout.head)
            for name, _ in self.tensors:
                fh.write(f32_to_bf16(self.master[name]).data)
        return model_dir


def run(args: argparse.Namespace, work: Path, progress: Progress, keep: Path | None = None) -> list[Version]:
    shape = {**QWEN25_15B, "layers": args.layers}
    real = measured_steps(RESULTS / "delta.txt")
    key = load_or_create_key(work / "origin.key")
    bf16_pub = Publisher(ChunkStore(work / "trainer"), key, SWARM, anchor_every=1 << 20, patch_max_fraction=10.0)
    grid_pub = Publisher(
        ChunkStore(work / "trainer"), key, SWARM, anchor_every=1 << 20, patch_max_fraction=10.0,
        encoding=GRID_ENCODING, tag="grid",
    )  # fmt: skip
    ceiling = grid_pub.chunk_size
    sampler = ChunkStore(work / "sampler")
    bar = progress.add_task("drawing the weights", total=args.versions + 1)
    model = Drawn(shape, args.seed)
    n_params = sum(w.size for w in model.master.values())
    progress.console.print(f"{n_params / 1e9:.3f}B parameters in {len(model.tensors)} tensors")
    out: list[Version] = []
    prev_grid: Manifest | None = None
    for v in range(args.versions + 1):
        a = changed = codes = 0.0
        if v:
            target = real[min(v, len(real)) - 1][0]
            progress.update(bar, description=f"version {v}: fitting the step to {100 * target:.2f}% of bf16")
            sample = model.sample().copy()
            a = fit_step(sample, args.lr, target, model.rng)
            model.step(args.lr, a)
        progress.update(bar, description=f"version {v}: writing the bf16 file")
        t0 = time.perf_counter()
        learner = model.write(work / f"learner-v{v}")
        write_s = time.perf_counter() - t0
        for pub in (bf16_pub, grid_pub):  # each publisher consumes its own staging dir: hard links, one file
            staging = pub.staging_dir(v)
            staging.mkdir()
            for f in learner.iterdir():
                os.link(f, staging / f.name)
        shutil.rmtree(learner)
        progress.update(bar, description=f"version {v}: publishing bf16")
        t0 = time.perf_counter()
        bf16_pub.publish(bf16_pub.staging_dir(v), v)
        bf16_s = time.perf_counter() - t0
        bstats = bf16_pub.last_stats
        progress.update(bar, description=f"version {v}: publishing int8-grid")
        if prev_grid is not None and prev_grid.patch is not None and grid_pub.last_stats is not None:
            proposed = policy.piece_size(prev_grid.patch.size, args.audience, grid_pub.last_stats.full_bytes, ceiling)
            grid_pub.chunk_size = policy.keep_piece_size(grid_pub.chunk_size, proposed)
        t0 = time.perf_counter()
        _, gsigned, gm = grid_pub.publish(grid_pub.staging_dir(v), v)
        grid_s = time.perf_counter() - t0
        gstats = grid_pub.last_stats
        assert bstats is not None and gstats is not None and gstats.grid is not None
        progress.update(bar, description=f"version {v}: a sampler rebuilds int8-grid")
        sampler.add_manifest(gsigned, gm)
        route = "full" if prev_grid is None else "patch"
        sampler.put_verified({h: grid_pub.store.read_verified(h) for h in sampler.route_chunks(gm, route)})
        t0 = time.perf_counter()
        if prev_grid is None:
            sampler.assemble(gm)
            if keep is not None:  # a sampler that holds version 0, for the lab's samplers to start from
                shutil.copytree(work / "sampler", keep / "sampler", copy_function=os.link)
        else:
            sampler.build_patched(gm, prev_grid)  # every tensor checked against its hash
            sampler.unbuild(prev_grid.version)
        rebuild_s = time.perf_counter() - t0
        if v:
            changed = bstats.changed / bstats.elements
            codes = gstats.changed / gstats.grid.codes
        rec = Version(
            v, a, changed, codes, real[min(v, len(real)) - 1][0] if v else 0.0,
            real[min(v, len(real)) - 1][1] if v else 0.0, bstats.full_bytes, gstats.full_bytes,
            bstats.patch_bytes or 0, gstats.patch_bytes or 0, wire(gsigned), gstats.grid.regridded,
            write_s, bf16_s, grid_s, rebuild_s,
        )  # fmt: skip
        out.append(rec)
        prev_grid = gm
        if v:
            progress.console.print(
                f"v{v}: a {a:.3f}, bf16 changed {100 * changed:.3f}% (real {100 * rec.real_bf16_changed:.3f}%), "
                f"codes {100 * codes:.3f}% (real {100 * rec.real_codes_changed:.3f}%); patch bf16 "
                f"{rec.bf16_patch / 1e6:.1f} MB ({100 * rec.bf16_patch / rec.full_bf16:.3f}%), int8-grid "
                f"{rec.grid_patch / 1e6:.2f} MB ({100 * rec.grid_patch / rec.full_bf16:.3f}%); publish bf16 "
                f"{bf16_s:.1f} s, int8-grid {grid_s:.1f} s; rebuild {rebuild_s:.1f} s"
            )
        progress.advance(bar)
    return out


def report(rows: list[Version], args: argparse.Namespace, started: float) -> list[str]:
    vs = [r for r in rows if r.version]
    v0 = rows[0]
    worst = max(vs, key=lambda r: r.grid_patch)
    pct = [100 * r.grid_patch / r.full_bf16 for r in vs]
    lines = [
        f"## {datetime.now(UTC):%Y-%m-%d %H:%M} UTC: bench/delta_shaped, Qwen2.5-1.5B's shapes ({args.layers} layers, "
        f"{v0.full_bf16 / 2 / 1e9:.3f}B parameters: bf16 file {v0.full_bf16 / 1e9:.3f} GB, int8-grid file "
        f"{v0.full_grid / 1e9:.3f} GB), {len(vs)} versions at lr {args.lr:g}, updates drawn (calibration in the "
        "module docstring)",
        f"version 0 (anchors): learner writes bf16 {v0.write_s:.1f} s, publish bf16 {v0.bf16_publish_s:.1f} s, "
        f"int8-grid {v0.grid_publish_s:.1f} s (fresh grids), a sampler assembles the int8-grid file in "
        f"{v0.grid_rebuild_s:.1f} s",
    ]
    for r in vs:
        lines.append(
            f"    v{r.version}: step {r.a:.3f} lr; bf16 changed {100 * r.bf16_changed:.3f}% (real run "
            f"{100 * r.real_bf16_changed:.3f}%), int8 codes changed {100 * r.codes_changed:.3f}% (real run "
            f"{100 * r.real_codes_changed:.3f}%); bf16 patch {r.bf16_patch} B ({100 * r.bf16_patch / r.full_bf16:.3f}%"
            f"), int8-grid patch {r.grid_patch} B ({100 * r.grid_patch / r.full_bf16:.3f}% of full bf16, "
            f"{100 * r.grid_patch / r.full_grid:.3f}% of full int8), its signed manifest {r.grid_manifest_wire} B, "
            f"{r.regridded} groups re-gridded; trainer: write {r.write_s:.1f} s, publish bf16 {r.bf16_publish_s:.1f} s"
            f", int8-grid {r.grid_publish_s:.1f} s; sampler rebuild int8-grid {r.grid_rebuild_s:.1f} s (bit-exact)"
        )
    mean = sum(pct) / len(pct)
    lines += [
        f"int8-grid patch / full bf16: mean {mean:.3f}%, worst {max(pct):.3f}% (v{worst.version}, "
        f"{worst.grid_patch / 1e6:.2f} MB + manifest {worst.grid_manifest_wire / 1e3:.0f} KB); bf16 patch mean "
        f"{sum(100 * r.bf16_patch / r.full_bf16 for r in vs) / len(vs):.3f}%, worst "
        f"{max(100 * r.bf16_patch / r.full_bf16 for r in vs):.3f}%; int8-grid / bf16 patch "
        f"{sum(r.grid_patch for r in vs) / sum(r.bf16_patch for r in vs):.3f}x",
        f"trainer per version (median): publish bf16 {median([r.bf16_publish_s for r in vs]):.1f} s, int8-grid "
        f"{median([r.grid_publish_s for r in vs]):.1f} s; sampler int8-grid rebuild "
        f"{median([r.grid_rebuild_s for r in vs]):.1f} s (this {os.cpu_count()}-core box; the int8-grid encode on "
        f"{ENCODE_THREADS} threads, the rest on one)",
        f"target int8-grid patch <= 0.3% of full bf16 per version at lr 1e-6 (worst): {max(pct):.3f}% "
        f"({'MET' if max(pct) <= 0.3 else 'MISSED'}); bit-exact {len(vs)}/{len(vs)} (every tensor's hash checked)",
        f"bench runtime {time.time() - started:.0f} s; 1-minute load average at the end {os.getloadavg()[0]:.1f}",
    ]
    return lines


def median(xs: list[float]) -> float:
    s = sorted(xs)
    return (s[(len(s) - 1) // 2] + s[len(s) // 2]) / 2


def title(rows: list[Version], args: argparse.Namespace) -> str:
    params = rows[0].full_bf16 / 2e9
    return f"bench/delta_shaped: Qwen2.5-1.5B's shapes ({args.layers} layers, {params:.2f}B), lr {args.lr:g}"


def plot(rows: list[Version], png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vs = [r for r in rows if r.version]
    x = [r.version for r in vs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(x, [100 * r.bf16_patch / r.full_bf16 for r in vs], "o-", label="bf16 patch")
    ax1.plot(x, [100 * r.grid_patch / r.full_bf16 for r in vs], "o-", label="int8-grid patch")
    ax1.axhline(0.3, color="grey", ls="--", label="target 0.3%")
    ax1.set(yscale="log", xlabel="version", ylabel="% of the full bf16 version", title="bytes per version")
    ax1.legend()
    ax2.plot(x, [r.bf16_publish_s for r in vs], "o-", label="trainer: publish bf16")
    ax2.plot(x, [r.grid_publish_s for r in vs], "o-", label="trainer: publish int8-grid")
    ax2.plot(x, [r.grid_rebuild_s for r in vs], "o-", label="sampler: rebuild int8-grid")
    ax2.set(xlabel="version", ylabel="seconds (2-core CPU box)", title="CPU time per version")
    ax2.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--versions", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--layers", type=int, default=QWEN25_15B["layers"], help="fewer for a quick run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", type=Path, help="where the versions go (default: a temporary dir; ~20 GB)")
    ap.add_argument("--audience", type=int, default=14, help="samplers the origin pushes to (sizes the pieces)")
    ap.add_argument("--keep", type=Path, help="keep the int8-grid chain here for bench/wan --replay (~10 GB)")
    ap.add_argument("--out", type=Path, default=RESULTS / "delta_shaped", help="results path stem")
    args = ap.parse_args()
    started = time.time()
    with TemporaryDirectory(prefix="swarmrl-shaped-", dir=args.work) as tmp, Progress(console=console) as progress:
        if args.keep is not None:
            shutil.rmtree(args.keep, ignore_errors=True)
            args.keep.mkdir(parents=True)
        rows = run(args, Path(tmp), progress, args.keep)
        if args.keep is not None:
            os.replace(Path(tmp) / "trainer", args.keep / "trainer")
            os.replace(Path(tmp) / "origin.key", args.keep / "origin.key")
            (args.keep / "versions.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    lines = report(rows, args, started)
    console.print("\n".join(lines))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out.with_suffix(".txt"), "a") as fh:
        fh.write("\n".join(lines) + "\n\n")
    args.out.with_suffix(".json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    plot(rows, args.out.with_suffix(".png"), title(rows, args))
    console.print(f"wrote {args.out}.txt, .json, .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
