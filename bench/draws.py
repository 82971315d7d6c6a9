"""bench/draws: honest noise of every sampler mode on a trained model, the verification limits it implies, and the
attacker's side of the same limits.

    .venv/bin/python bench/draws.py measure [--scale 1.0] [--modes q8-bf16,...]  # sample + replay: ~75 min here
    .venv/bin/python bench/draws.py report [--write] [--no-attack]                # fit, check, attack: ~8 min

``measure``: honest samplers of every engine x compute dtype x quantization (MLX fp32/bf16/fp16 compute with
none/int8/int4 weights, torch fp32/bf16; and on versions that travel int8 rowwise) sample GRPO groups (G=8,
max_tokens=16) of the realistic model's own task (trainer/realistic_model.py: a trained Llama, peaked distributions)
at temperatures 0.6/1.0 and top_p 1.0/0.9; the trainer replays every token in float64 from the fp32 version
(trainer/draws.py). Each group's replayed draws and claimed logprobs are kept in runs/draws/<mode>.pkl, so every
later step is a pure function of the records.

``report`` (bench/results/draws.txt): per mode, the flips (tokens outside their replayed interval) against the
exposure the trainer computes (node/intake/noise.py), the flip distances in log-odds scaled by temperature, the
logprob error; the fitted table (``--write`` puts it into node/intake/noise.py), the groups its limits refuse
(target 0) and each mode's groups run as one peer's history through the sequential test; then attackers
replayed against the same records: an injector that picks k tokens per group, a steerer that picks the best token
among those the tolerance admits, mixed and all-answer injectors; how many groups until the first strike and the
ban, and the reward gained meanwhile.
"""

from __future__ import annotations

import argparse
import pickle
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

G, MAX_TOKENS = 8, 16
CHUNK = 64  # groups per engine call
OUT = ROOT / "runs" / "draws"

# mode -> (engine, bits, compute); groups per (T, top_p) setting at --scale 1
MODES: dict[str, tuple[str, int | None, str]] = {
    "torch-fp32": ("torch", None, "fp32"),
    "mlx-fp32": ("mlx", None, "fp32"),
    "q8-fp32": ("mlx", 8, "fp32"),
    "q8-bf16": ("mlx", 8, "bf16"),
    "q8-fp16": ("mlx", 8, "fp16"),
    "bf16": ("mlx", None, "bf16"),
    "fp16": ("mlx", None, "fp16"),
    "torch-bf16": ("torch", None, "bf16"),
    "q4-fp32": ("mlx", 4, "fp32"),
    "q4-bf16": ("mlx", 4, "bf16"),
    # versions that travel int8 rowwise (--weights-encoding int8): the sampler runs the decoded weights
    "wire8-fp32": ("mlx", None, "fp32"),
    "wire8-q8-bf16": ("mlx", 8, "bf16"),
}
SETTINGS = ((1.0, 1.0), (0.6, 1.0), (1.0, 0.9), (0.6, 0.9))
FAST = {"torch-fp32", "mlx-fp32", "q8-fp32", "q4-fp32", "wire8-fp32"}  # fp32 matmuls: ~4x faster than bf16 on this CPU


def groups_for(mode: str, setting: tuple[float, float], scale: float) -> int:
    main = setting == (1.0, 1.0)
    if mode in ("torch-fp32", "q8-fp32"):
        n = 10_000 if main else 1_000
    elif mode in FAST:
        n = 2_000 if main else 500
    elif mode in ("q8-bf16", "q8-fp16"):
        n = 3_000 if main else 500
    else:
        n = 1_000 if main else 250
    return max(8, int(n * scale))


@dataclass
class Record:
    """One honest group as the trainer saw it."""

    seed: int
    temperature: float
    top_p: float
    draws: list  # per sample: list[TokenDraw] (the trainer's float64 replay)
    claimed: list  # per sample: the sampler's logprobs
    rewards: list = field(default_factory=list)
    ids: list = field(default_factory=list)  # per sample: the completion's token ids


def int8_wire_copy(model_dir: Path) -> Path:
    """The model dir as a sampler holds it after an int8-rowwise transfer: weights encoded and decoded."""
    import shutil

    from safetensors.numpy import save_file

    from node.weights.encoding import decode_int8, encode_int8, read_float_tensors

    out = OUT / "wire8-model"
    if not (out / "model.safetensors").exists():
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(model_dir, out)
        state = read_float_tensors(model_dir / "model.safetensors")
        save_file(decode_int8(encode_int8(state)), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def make_engine(mode: str, model_dir: Path):
    from node.engines.mlx_engine import MlxEngine
    from node.engines.torch_engine import TorchEngine

    if mode.startswith("wire8"):
        model_dir = int8_wire_copy(model_dir)
    engine, bits, compute = MODES[mode]
    if engine == "torch":
        return TorchEngine(model_dir, batch_size=CHUNK * G, compute=compute)
    return MlxEngine(model_dir, bits=bits, batch_size=CHUNK * G, compute=compute)


def measure(args: argparse.Namespace) -> None:
    import torch

    from trainer.draws import completion_draws
    from trainer.model import load_model, load_tokenizer
    from trainer.realistic_model import DATASET, cached_realistic_model, peakedness
    from trainer.tasks.dataset import JsonlTask
    from trainer.text import TextCodec

    torch.set_num_threads(args.threads)
    model_dir = cached_realistic_model()
    tok = load_tokenizer(model_dir)
    codec = TextCodec(tok, (tok.eos_token_id,), chat_template=True)
    task = JsonlTask(model_dir / DATASET, "numeric")
    scorer = load_model(model_dir).eval()  # fp32: the trainer's replay of an fp32 version
    OUT.mkdir(parents=True, exist_ok=True)
    print(f"realistic model {model_dir.name}: {peakedness(model_dir)}", flush=True)
    for mode in args.modes.split(","):
        engine = make_engine(mode, model_dir)
        records: list[Record] = []
        t0 = time.perf_counter()
        for si, (temp, top_p) in enumerate(SETTINGS):
            n = groups_for(mode, (temp, top_p), args.scale)
            first = 1_000_000 * (si + 1)
            for start in range(first, first + n, CHUNK):
                seeds = list(range(start, min(start + CHUNK, first + n)))
                prompts = [codec.encode_prompt(task.prompt(s)) for s in seeds for _ in range(G)]
                rows = [(s, k) for s in seeds for k in range(G)]
                gens = engine.generate_rows(prompts, rows, temperature=temp, top_p=top_p, max_tokens=MAX_TOKENS)
                comps = [g.completion_ids for g in gens]
                with torch.no_grad():
                    flat = completion_draws(scorer, prompts, comps, temp, top_p)
                for i, s in enumerate(seeds):
                    part = slice(i * G, (i + 1) * G)
                    rewards = [task.reward(s, codec.completion_text(c)) for c in comps[part]]
                    claimed = [g.logprobs for g in gens[part]]
                    records.append(Record(s, temp, top_p, flat[part], claimed, rewards, comps[part]))
                done = len(records)
                print(f"\r{mode}: T={temp} top_p={top_p} {done} groups [{time.perf_counter() - t0:.0f} s]", end="")
        print(flush=True)
        with open(OUT / f"{mode}.pkl", "wb") as fh:
            pickle.dump(records, fh)


class _Unpickler(pickle.Unpickler):
    """Records pickled by this file run as a script name ``__main__.Record``."""

    def find_class(self, module: str, name: str):
        if name == "Record":
            return Record
        return super().find_class(module, name)


def load_records(modes: list[str]) -> dict[str, list[Record]]:
    out = {}
    for m in modes:
        p = OUT / f"{m}.pkl"
        if p.exists():
            with open(p, "rb") as fh:
                out[m] = _Unpickler(fh).load()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("phase", choices=("measure", "report"))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--scale", type=float, default=1.0, help="multiply every group count (0.1 for a quick run)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-attack", action="store_true", help="report: fit and check only")
    p.add_argument("--write", action="store_true", help="report: write the fitted table into node/intake/noise.py")
    p.add_argument("--plot", type=Path, default=ROOT / "bench" / "results" / "draws.png", help="report: the figure")
    args = p.parse_args()
    random.seed(0)
    if args.phase == "measure":
        measure(args)
    else:
        from bench.draws_report import report

        report(load_records(args.modes.split(",")), not args.no_attack, args.write, args.plot)


if __name__ == "__main__":
    main()
