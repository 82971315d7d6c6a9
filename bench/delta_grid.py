"""bench/delta's int8-grid parts (issue 27): what a frozen grid costs in fidelity, and which codec packs patches best.

Fidelity: the realistic trained fixture (trainer/realistic_model.py, a ~1M-parameter Llama peaked like a real
checkpoint) takes real AdamW steps (fp32 master weights) on its own next-token task at an RL learning rate: an
Adam step moves every weight by about the learning rate, the size of a GRPO step's AdamW update. Each step is a
version, rounded to bf16 as the learner publishes it. At versions 10 and 50, per completion token of a fixed set of
the task's examples (teacher-forced, fp32 compute), the logprob under

- bf16: the version as published (the reference);
- fresh int8: MLX's own 8-bit group quantization of that version (what an MLX int8 sampler runs today: a new grid
  every version);
- grid: the int8-grid version (each group's grid frozen at version 0, re-gridded by the rule); and grid without the
  rule (frozen whatever happens), to show what the rule bounds.

Codecs: the same index and value streams as the product's patch (node/weights/patch.py), each compressed by zlib
(the product's), zstd levels 1-3, and zstd with a dictionary trained per stream kind on the previous version's
streams; and grail's sparse layout (delta indices narrowed to uint8/uint16/uint32 per tensor, new values raw,
zstd), for bf16 patches and int8-grid patches alike.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from node.weights.grid import (
    GROUP,
    GridRule,
    codes_on,
    dequantize,
    encode_groups,
    f32_to_bf16,
    fresh_grid,
    rule_for,
)
from node.weights.patch import INTS, UINTS, ZLIB_LEVEL, encode_values, leb128_encode
from protocols.weights_file import element_width, read_layout

EVAL_EXAMPLES = 512  # teacher-forced task examples the logprobs are compared on
NO_RULE = GridRule(excess_steps=float("inf"), step_ratio=float("inf"))


# -- fidelity --------------------------------------------------------------------------------------------------
@dataclass
class Fidelity:
    """Token logprob differences (nats) at one version: (mean |d|, 99.9th percentile |d|, max |d|) per pair."""

    lr: float
    version: int
    tokens: int
    pairs: dict[str, tuple[float, float, float]]
    regridded: int  # groups given a fresh grid by the rule so far (of ``groups``)
    groups: int
    codes_changed: float  # share of codes that changed at this version (grid with the rule)
    bf16_changed: float  # share of bf16 elements that changed at this version


def _examples(model_dir: Path, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from trainer.base_model import padded_batch
    from trainer.model import load_tokenizer
    from trainer.realistic_model import RealisticConfig, _example

    tok = load_tokenizer(model_dir)
    rng = random.Random(seed)
    cfg = RealisticConfig()
    return padded_batch([_example(rng, tok, cfg) for _ in range(n)], tok.pad_token_id)


@torch.no_grad()
def _token_logprobs(model, ids: torch.Tensor, attn: torch.Tensor, labels: torch.Tensor) -> np.ndarray:
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].double()
    target = labels[:, 1:]
    keep = target != -100
    logp = torch.log_softmax(logits, -1).gather(-1, target.clamp_min(0)[..., None])[..., 0]
    return logp[keep].numpy()


def _bf16(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.bfloat16).to(torch.float32).numpy()


def _diff(a: np.ndarray, b: np.ndarray) -> tuple[float, float, float]:
    d = np.abs(a - b)
    return float(d.mean()), float(np.quantile(d, 0.999)), float(d.max())


def fidelity(
    model_dir: Path,
    lr: float,
    versions: int = 50,
    at: tuple[int, ...] = (10, 50),
    batch: int = 32,
    seed: int = 0,
    bits: int = 8,
) -> list[Fidelity]:
    """Train ``versions`` AdamW steps at ``lr`` on the realistic fixture; the logprob differences at ``at`` of the
    grid at ``bits`` (int8-grid, int4-grid) and MLX's fresh quantization at that width."""
    from trainer.base_model import padded_batch
    from trainer.model import load_model, load_tokenizer
    from trainer.realistic_model import RealisticConfig, _example

    torch.manual_seed(seed)
    model = load_model(model_dir).train()
    evaluator = load_model(model_dir).eval()
    tok = load_tokenizer(model_dir)
    cfg = RealisticConfig()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
    rng = random.Random(seed + 7)
    ev = _examples(model_dir, EVAL_EXAMPLES, seed + 99)
    names = [n for n, p in model.named_parameters() if p.ndim == 2 and p.shape[1] % GROUP == 0]
    params = dict(model.named_parameters())

    def grids(rule: GridRule, prev: dict | None) -> dict[str, tuple]:
        out = {}
        for n in names:
            g = _bf16(params[n]).reshape(-1, GROUP)
            out[n] = encode_groups(g, None if prev is None else prev[n][1:3], rule, bits)
        return out

    rule = rule_for(bits)
    fresh_label = f"fresh int{bits}"
    with_rule = grids(rule, None)
    no_rule = with_rule
    regridded = 0
    total_groups = sum(v[1].size for v in with_rule.values())
    last_bf16 = {n: _bf16(p) for n, p in params.items()}
    out: list[Fidelity] = []
    for v in range(versions + 1):
        bf16_changed = codes_changed = 0.0
        if v:  # version 0 is the anchor: the fixture itself, on fresh grids
            ids, attn, labels = padded_batch([_example(rng, tok, cfg) for _ in range(batch)], tok.pad_token_id)
            loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            prev_codes = {n: c[0] for n, c in with_rule.items()}
            with_rule, no_rule = grids(rule, with_rule), grids(NO_RULE, no_rule)
            regridded += sum(int(c[3].sum()) for c in with_rule.values())
        now_bf16 = {n: _bf16(p) for n, p in params.items()}
        if v:
            bf16_changed = sum(int(np.count_nonzero(now_bf16[n] != last_bf16[n])) for n in params) / sum(
                p.numel() for p in params.values()
            )
            codes_changed = sum(int(np.count_nonzero(with_rule[n][0] != prev_codes[n])) for n in names) / sum(
                params[n].numel() for n in names
            )
        last_bf16 = now_bf16
        if v not in at:
            continue
        variants: dict[str, dict[str, np.ndarray]] = {"bf16": now_bf16}
        fresh = {}
        for n in names:
            g = now_bf16[n].reshape(-1, GROUP)
            s, b = fresh_grid(g, bits)  # MLX: codes against the float32 scale, dequantized with the bf16 one
            fresh[n] = dequantize(codes_on(g, s, b, bits), f32_to_bf16(s), f32_to_bf16(b)).reshape(params[n].shape)
        variants[fresh_label] = {**now_bf16, **fresh}
        for label, g in (("grid", with_rule), ("grid, no rule", no_rule)):
            deq = {n: dequantize(g[n][0], g[n][1], g[n][2]).reshape(params[n].shape) for n in names}
            variants[label] = {**now_bf16, **deq}
        lps = {}
        for label, state in variants.items():
            evaluator.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(x)) for k, x in state.items()},
                                      strict=False)  # fmt: skip
            lps[label] = _token_logprobs(evaluator, *ev)
        pairs = {
            f"{fresh_label} vs bf16": _diff(lps[fresh_label], lps["bf16"]),
            "grid vs bf16": _diff(lps["grid"], lps["bf16"]),
            f"grid vs {fresh_label}": _diff(lps["grid"], lps[fresh_label]),
            f"grid no rule vs {fresh_label}": _diff(lps["grid, no rule"], lps[fresh_label]),
        }
        out.append(Fidelity(lr, v, len(lps["bf16"]), pairs, regridded, total_groups, codes_changed, bf16_changed))
    return out


def fidelity_lines(rows: list[Fidelity]) -> list[str]:
    lines = []
    for r in rows:
        cells = ", ".join(f"{k} {m:.4f}/{q:.4f}/{x:.4f}" for k, (m, q, x) in r.pairs.items())
        lines.append(
            f"    lr {r.lr:g} v{r.version} ({r.tokens} tokens): |logprob diff| mean/p99.9/max nats: {cells}; "
            f"re-gridded {r.regridded}/{r.groups} groups so far; this version changed {r.codes_changed:.3%} of "
            f"codes, {r.bf16_changed:.3%} of bf16 elements"
        )
    return lines


# -- codecs -----------------------------------------------------------------------------------------------------
@dataclass
class Streams:
    """A patch's raw streams per changed tensor: (index stream (gaps or bitmap, the shorter), value stream), and
    grail's (narrowed delta indices, new values raw)."""

    ours: list[tuple[bytes, bytes]] = field(default_factory=list)
    grail: list[tuple[bytes, bytes]] = field(default_factory=list)


def patch_streams(old_path: Path, new_path: Path) -> Streams:
    _, layout = read_layout(new_path)
    old_mm = np.memmap(old_path, dtype=np.uint8, mode="r")
    new_mm = np.memmap(new_path, dtype=np.uint8, mode="r")
    out = Streams()
    for t in layout:
        width = element_width(t)
        if width is None:
            continue
        old = old_mm[t.offset : t.end].view(UINTS[width])
        new = new_mm[t.offset : t.end].view(UINTS[width])
        differs = old != new
        hit = np.flatnonzero(differs)
        if not hit.size:
            continue
        gaps = np.diff(hit, prepend=-1) - 1
        gap_stream = leb128_encode(gaps.astype(np.uint64))
        bitmap = np.packbits(differs, bitorder="little").tobytes()
        values = encode_values((new[hit] - old[hit]).view(INTS[width]).astype(np.int64))
        out.ours.append((gap_stream if len(gap_stream) <= len(bitmap) else bitmap, values))
        deltas = np.diff(hit, prepend=0)
        narrow = np.uint8 if deltas.max() < 1 << 8 else np.uint16 if deltas.max() < 1 << 16 else np.uint32
        out.grail.append((deltas.astype(narrow).tobytes(), new[hit].tobytes()))
    del old_mm, new_mm
    return out


def _zstd(level: int, dict_data=None):
    import zstandard

    return zstandard.ZstdCompressor(level=level, dict_data=dict_data)


def _train(samples: list[bytes], size: int = 16 << 10):
    import zstandard

    pieces = [s[i : i + 4096] for s in samples for i in range(0, len(s), 4096)]
    if len(pieces) < 8:
        return None
    try:
        return zstandard.train_dictionary(size, pieces)
    except Exception:
        return None


def codec_sizes(streams: Streams, previous: Streams | None) -> dict[str, tuple[int, int]]:
    """(index bytes, value bytes) per codec for one patch; ``previous``: the last patch's streams, to train the
    dictionaries on (what a sampler would hold)."""
    out: dict[str, tuple[int, int]] = {}
    idx = [a for a, _ in streams.ours]
    val = [b for _, b in streams.ours]
    out["zlib-6 (product)"] = (
        sum(len(zlib.compress(x, ZLIB_LEVEL)) for x in idx),
        sum(len(zlib.compress(x, ZLIB_LEVEL)) for x in val),
    )
    for level in (1, 2, 3):
        c = _zstd(level)
        out[f"zstd-{level}"] = (sum(len(c.compress(x)) for x in idx), sum(len(c.compress(x)) for x in val))
    if previous is not None:
        di, dv = _train([a for a, _ in previous.ours]), _train([b for _, b in previous.ours])
        if di is not None and dv is not None:
            ci, cv = _zstd(3, di), _zstd(3, dv)
            out["zstd-3 + dictionary"] = (
                sum(len(ci.compress(x)) for x in idx) + len(di.as_bytes()),
                sum(len(cv.compress(x)) for x in val) + len(dv.as_bytes()),
            )  # the dictionaries' own bytes counted: a sampler must get them once
    c = _zstd(3)
    out["grail (narrowed deltas, raw values, zstd-3)"] = (
        sum(len(c.compress(a)) for a, _ in streams.grail),
        sum(len(c.compress(b)) for _, b in streams.grail),
    )
    out["grail indices + our values, zstd-3"] = (
        out["grail (narrowed deltas, raw values, zstd-3)"][0],
        out["zstd-3"][1],
    )
    return out
