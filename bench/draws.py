"""bench/draws: the seeded-draw check (protocols/draw.py, node/intake/draws.py) against real samplers.

    .venv/bin/python bench/draws.py [--groups 10000] [--sections random,nucleus,...] [--save out.json] [--quick]

Full run ~75 min on 2 shared cores (--quick: 256 groups everywhere, ~10 min); results in bench/results/draws.txt.

1. Noise: honest samplers (MLX int8, int4, fp32 and torch; group size 8, max_tokens 8, T=1, top_p=1, reverse-task
   prompts) generate ``--groups`` groups; the trainer replays every token in float64 (trainer/draws.py). For
   every token outside its replayed interval ("near-boundary flip") the distance of u from the interval is
   recorded, absolute and in log-odds: their distribution sets the tolerances, the flips per group the budgets.
2. False positives: groups those honest samplers produce that ``check_group_draws`` (the limits in
   node/intake/draws.py) would refuse. Target: zero.
3. Detection: an injector samples honestly, then replaces half of each group's completions with the right answer
   (with honest logprobs): is its first group refused, and what fraction of its groups is?
4. Cost: per group, the verifier's forward pass (trainer/model.py token_logprobs) against computing the intervals
   (token_draws) and checking them; also token_draws on a 151,936-token vocabulary.
Sections: ``random`` and ``nucleus`` (top_p=0.9) on the random-init tiny Qwen2 (flat distributions), ``inject``,
``cost``, ``base`` and ``baseinject`` on the pretrained base model (peaked distributions), ``big`` (random d=256 x 4
layers), ``bf16`` (bf16 weights: MLX computes in bf16) and ``bf16score`` (the trainer scoring in bf16).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from tempfile import TemporaryDirectory

import numpy as np
import torch

from node.engines.base import Generation
from node.engines.mlx_engine import MlxEngine
from node.engines.torch_engine import TorchEngine
from node.intake.draws import DEFAULT_DRAW_LIMITS, Tolerance, check_draws, check_group_draws
from protocols.draw import draw_uniforms, inside
from trainer.base_model import build_base_model
from trainer.draws import MAX_ALT_MARGIN, completion_draws, token_draws
from trainer.model import load_model, load_tokenizer, token_logprobs
from trainer.tasks.reverse import ReverseDigitsTask
from trainer.tiny_qwen2 import EOS_ID, build_random_model

G, MAX_TOKENS, TEMPERATURE, TOP_P = 8, 8, 1.0, 1.0
CHUNK = 64  # groups per engine call (512 rows)
TASK = ReverseDigitsTask()


@dataclass
class Noise:
    name: str
    quant: str
    top_p: float
    tokens: list[int] = field(default_factory=list)  # per group
    flips: list[int] = field(default_factory=list)  # per group: tokens outside their replayed interval
    distances: list[float] = field(default_factory=list)  # every flip's distance (nucleus alternatives considered)
    log_odds: list[float] = field(default_factory=list)  # the same in log-odds
    worst: list[float] = field(default_factory=list)  # per group: the largest flip distance in log-odds
    refused: int = 0
    max_lp_diff: float = 0.0

    def report(self) -> str:
        d = np.array(self.distances) if self.distances else np.zeros(1)
        lo = np.array(self.log_odds) if self.log_odds else np.zeros(1)
        per = np.bincount(self.flips) if self.flips else np.zeros(1, dtype=int)
        rate = np.array(self.flips) / np.maximum(np.array(self.tokens), 1)
        lim = DEFAULT_DRAW_LIMITS[self.quant]
        n_tok = sum(self.tokens)
        nucleus = f"+{lim.per_token_nucleus:g}" if self.top_p < 1 else ""
        return (
            f"{self.name:<12} top_p {self.top_p:<3} groups {len(self.tokens):>5} tokens {n_tok:>6} flips "
            f"{len(self.distances):>5} ({len(self.distances) / max(n_tok, 1):.2%}) | distance p99 "
            f"{np.quantile(d, 0.99):.1e} max {d.max():.1e} | log-odds p50 {np.median(lo):.2f} p99 "
            f"{np.quantile(lo, 0.99):.2f} max {lo.max():.2f} | flips/group max {len(per) - 1} ({rate.max():.2f} of "
            f"its tokens) | max|dlogprob| {self.max_lp_diff:.1e} | REFUSED {self.refused} (tol "
            f"{lim.tolerance_for(self.top_p).log_odds:g} log-odds or {lim.tolerance_for(self.top_p).absolute:g}, "
            f"budget {lim.budget}+{lim.per_token:g}{nucleus}/token)"
        )


def prompt_ids(tok, seed: int) -> list[int]:
    return [tok.bos_token_id, *tok.encode(TASK.prompt(seed), add_special_tokens=False)]


def sample_groups(engine, tok, seeds: list[int], top_p: float = TOP_P) -> list[list[Generation]]:
    """One engine call for a chunk of groups: row (seed, k) for sample k of the group with that seed."""
    prompts = [prompt_ids(tok, s) for s in seeds for _ in range(G)]
    rows = [(s, k) for s in seeds for k in range(G)]
    gens = engine.generate_rows(prompts, rows, temperature=TEMPERATURE, top_p=top_p, max_tokens=MAX_TOKENS)
    return [gens[i * G : (i + 1) * G] for i in range(len(seeds))]


def replay(model, tok, seeds: list[int], groups: list[list[list[int]]], top_p: float = TOP_P):
    prompts = [prompt_ids(tok, s) for s in seeds for _ in range(G)]
    comps = [c for g in groups for c in g]
    flat = completion_draws(model, prompts, comps, TEMPERATURE, top_p)
    return [flat[i * G : (i + 1) * G] for i in range(len(seeds))]


def measure_noise(
    name: str, engine, model, tok, n_groups: int, quant: str, first_seed: int = 0, top_p: float = TOP_P
) -> Noise:
    noise = Noise(f"{quant} {name}".strip(), quant, top_p)
    for start in range(first_seed, first_seed + n_groups, CHUNK):
        seeds = list(range(start, min(start + CHUNK, first_seed + n_groups)))
        gens = sample_groups(engine, tok, seeds, top_p)
        draws = replay(model, tok, seeds, [[x.completion_ids for x in g] for g in gens], top_p)
        for seed, group, gd in zip(seeds, gens, draws, strict=True):
            for gen, row in zip(group, gd, strict=True):
                lp = np.abs(np.array(gen.logprobs) - [d.logprob for d in row]).max()
                noise.max_lp_diff = max(noise.max_lp_diff, float(lp))
            # every deviation, every nucleus alternative admissible
            everything = check_draws(gd, seed, Tolerance(MAX_ALT_MARGIN, 0.0), budget=1 << 30)
            deviations = everything.flips + everything.forged
            noise.distances += [x.distance for x in deviations]
            noise.log_odds += [x.log_odds for x in deviations]
            noise.flips.append(len(deviations))
            noise.worst.append(max((x.log_odds for x in deviations), default=0.0))
            noise.tokens.append(everything.tokens)
            noise.refused += not check_group_draws(gd, seed, quant, top_p).ok
    return noise


def detection(engine, model, tok, n_groups: int, quant: str, first_seed: int = 10**6) -> str:
    """An injector: honest sampling, then half of each group's completions replaced by the right answer."""
    seeds = list(range(first_seed, first_seed + n_groups))
    caught, first, passed_tokens, injected_tokens = 0, None, 0, 0
    for start in range(0, n_groups, CHUNK):
        chunk = seeds[start : start + CHUNK]
        gens = sample_groups(engine, tok, chunk)
        comps = []
        for seed, group in zip(chunk, gens, strict=True):
            answer = [*tok.encode(TASK.answer(seed), add_special_tokens=False), EOS_ID]
            comps.append([answer if k % 2 == 0 else g.completion_ids for k, g in enumerate(group)])
        draws = replay(model, tok, chunk, comps)  # honest logprobs of the injected tokens come with these
        for seed, gd in zip(chunk, draws, strict=True):
            result = check_group_draws(gd, seed, quant, TOP_P)
            caught += not result.ok
            first = (not result.ok) if first is None else first
            for k in range(0, G, 2):
                us = draw_uniforms(seed, k, np.arange(len(gd[k])))
                passed_tokens += sum(inside(float(u), d.lo, d.hi) for u, d in zip(us, gd[k], strict=True))
                injected_tokens += len(gd[k])
    return (
        f"injector ({quant}, half of each group = the right answer): first group refused: {first}; "
        f"refused {caught}/{n_groups} groups; injected tokens inside their draw interval "
        f"{passed_tokens}/{injected_tokens} ({passed_tokens / injected_tokens:.2%})"
    )


def timed(fn: Callable[[], object], reps: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def cost(engine, model, tok) -> list[str]:
    seed = 424242
    gens = sample_groups(engine, tok, [seed])[0]
    prompts = [prompt_ids(tok, seed)] * G
    comps = [g.completion_ids for g in gens]
    with torch.no_grad():
        fwd = timed(lambda: token_logprobs(model, prompts, comps, TEMPERATURE), 50)
        rows = completion_logits(model, prompts, comps)
        toks = [t for c in comps for t in c]
        intervals = timed(lambda: token_draws(rows, toks, TEMPERATURE, TOP_P), 50)
        draws = completion_draws(model, prompts, comps, TEMPERATURE, TOP_P)
        check = timed(lambda: check_group_draws(draws, seed, "q8"), 200)
        big = torch.randn(len(toks), 151936) * 3
        big_intervals = timed(lambda: token_draws(big, toks, TEMPERATURE, TOP_P), 5)
        big_nucleus = timed(lambda: token_draws(big, toks, TEMPERATURE, 0.95), 3)
    return [
        f"cost per group ({G} x <= {MAX_TOKENS} tokens, {len(toks)} tokens, tiny model, {torch.get_num_threads()} "
        f"torch threads): logprob forward pass {fwd * 1e3:.2f} ms; intervals (token_draws) {intervals * 1e3:.2f} ms "
        f"= {intervals / fwd:.0%} of it; check_draws {check * 1e3:.3f} ms = {check / fwd:.1%}",
        f"token_draws on a 151,936-token vocabulary ({len(toks)} rows): {big_intervals * 1e3:.1f} ms at top_p=1, "
        f"{big_nucleus * 1e3:.1f} ms at top_p=0.95 (sort + boundary alternatives)",
    ]


def completion_logits(model, prompts: list[list[int]], comps: list[list[int]]) -> torch.Tensor:
    seqs = [p + c for p, c in zip(prompts, comps, strict=True)]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    logits = model(input_ids=ids).logits.float()
    pairs = enumerate(zip(prompts, comps, strict=True))
    return torch.cat([logits[i, len(p) - 1 : len(p) - 1 + len(c)] for i, (p, c) in pairs])


def to_bf16(model_dir: Path, out: Path) -> Path:
    """The same model with bf16 weights (what a CUDA trainer publishes)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out)
    for f in out.glob("*.safetensors"):
        save_file({k: v.to(torch.bfloat16) for k, v in load_file(str(f)).items()}, str(f), metadata={"format": "pt"})
    return out


SECTIONS = ("random", "nucleus", "inject", "cost", "base", "baseinject", "big", "bf16", "bf16score")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--groups", type=int, default=10_000, help="groups per int8/int4/torch sampler (top_p=1)")
    p.add_argument("--fp32-groups", type=int, default=2_000, help="groups for the MLX fp32 sampler")
    p.add_argument("--nucleus-groups", type=int, default=1_000, help="groups per sampler at top_p=0.9")
    p.add_argument("--base-groups", type=int, default=2_000, help="groups per sampler on the pretrained base model")
    p.add_argument("--big-groups", type=int, default=500, help="groups per sampler on the bigger model and bf16")
    p.add_argument("--inject-groups", type=int, default=1_000)
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    p.add_argument("--save", type=Path, help="write per-group flip counts and worst distances here (JSON)")
    p.add_argument("--quick", action="store_true", help="256 groups everywhere")
    args = p.parse_args()
    if args.quick:
        args.groups = args.fp32_groups = args.nucleus_groups = args.big_groups = args.inject_groups = 256
        args.base_groups = 256
    todo = set(args.sections.split(","))
    torch.set_num_threads(2)
    results: list[Noise] = []
    makers = {
        "q8": lambda d: MlxEngine(d, bits=8, batch_size=CHUNK * G),
        "q4": lambda d: MlxEngine(d, bits=4, batch_size=CHUNK * G),
        "torch": lambda d: TorchEngine(d, batch_size=CHUNK * G),
        "none": lambda d: MlxEngine(d, bits=None, batch_size=CHUNK * G),
    }

    def run(label: str, model_dir: Path, model, n: int, quant: str, first_seed: int, top_p: float) -> None:
        t = time.perf_counter()
        noise = measure_noise(label, makers[quant](model_dir), model, tok, n, quant, first_seed, top_p)
        results.append(noise)
        print(noise.report(), f"[{time.perf_counter() - t:.0f} s]", flush=True)

    with TemporaryDirectory() as tmp:
        tiny = build_random_model(Path(tmp) / "tiny")
        tok = load_tokenizer(tiny)
        model = load_model(tiny).eval()
        counts = {"q8": args.groups, "q4": args.groups, "torch": args.groups, "none": args.fp32_groups}
        head = f"G={G}, max_tokens={MAX_TOKENS}, T=1, reverse-task prompts"
        print(f"random-init tiny Qwen2 (d=128, 2 layers, vocab {model.config.vocab_size}): {head}", flush=True)
        for quant in makers:
            if "random" in todo:
                run("", tiny, model, counts[quant], quant, 0, 1.0)
        for quant in makers:
            if "nucleus" in todo:
                run("", tiny, model, args.nucleus_groups, quant, 20_000, 0.9)
        if "inject" in todo:
            for quant in ("q8", "q4"):
                print(detection(makers[quant](tiny), model, tok, args.inject_groups, quant), flush=True)
        if "cost" in todo:
            for line in cost(makers["q8"](tiny), model, tok):
                print(line, flush=True)
        if "base" in todo or "baseinject" in todo:
            base = build_base_model(Path(tmp) / "base")
            base_model = load_model(base).eval()
            print(f"pretrained base model (trainer/base_model.py, peaked distributions): {args.base_groups} groups")
        if "base" in todo:
            for quant in makers:
                run("base", base, base_model, args.base_groups, quant, 30_000, 1.0)
            for quant in makers:
                run("base", base, base_model, args.nucleus_groups, quant, 40_000, 0.9)
        if "base" in todo or "baseinject" in todo:
            for quant in ("q8", "q4"):
                line = detection(makers[quant](base), base_model, tok, args.inject_groups, quant, 2 * 10**6)
                print("base", line, flush=True)
        if "big" in todo:
            big = build_random_model(Path(tmp) / "big", layers=4, hidden=256)
            big_model = load_model(big).eval()
            print(f"random-init Qwen2 d=256, 4 layers: {args.big_groups} groups per sampler")
            for quant in makers:
                run("d256", big, big_model, args.big_groups, quant, 50_000, 1.0)
        if "bf16" in todo:
            bf16 = to_bf16(tiny, Path(tmp) / "bf16")
            bf16_model = load_model(bf16).eval()  # the trainer's fp32 replay on the bf16 weights
            print(f"bf16 weights (random tiny; MLX computes in bf16, the trainer replays in fp32): {args.big_groups}")
            for quant in ("none", "q8"):
                run("bf16", bf16, bf16_model, args.big_groups, quant, 90_000, 1.0)
                run("bf16", bf16, bf16_model, args.big_groups, quant, 95_000, 0.9)
        if "bf16score" in todo:
            bf16 = to_bf16(tiny, Path(tmp) / "bf16s")
            scorer = load_model(bf16, dtype=torch.bfloat16).eval()  # a trainer scoring in its bf16 publish dtype
            print(f"bf16 weights scored in bf16 (what a CUDA trainer's scorer does): {args.big_groups} groups")
            for quant in ("torch", "none", "q8"):
                run("bf16-scored", bf16, scorer, args.big_groups, quant, 97_000, 1.0)
    if args.save:
        keep = ("name", "quant", "top_p", "tokens", "flips", "worst")
        args.save.write_text(json.dumps([{k: getattr(n, k) for k in keep} for n in results]))


if __name__ == "__main__":
    main()
