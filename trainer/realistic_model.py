"""The realistic test model: a small *trained* Llama with a BPE tokenizer and a chat template, built
deterministically here (no download), for everything whose behaviour depends on how peaked a model's next-token
distributions are: verification limits (bench/draws.py), engines in reduced precision, patches.

Why: noise limits measured on random-init models (flat distributions, a CDF boundary every ~1/V) are wrong for
trained ones. A bf16 forward pass on a peaked model moved CDF boundaries by 0.27 log-odds where a random-init tiny
model showed 0.01, and an honest MLX int8 sampler computing in bf16 (what a Mac does) was banned as a forger.

What it is: a LlamaForCausalLM (untied embeddings, GQA 4 heads / 2 KV heads, rope_theta 5e5 written flat), a
Metaspace BPE tokenizer of ~340 tokens trained by ``tokenizers`` on the task's text, a chat template with an
end-of-turn stop token, fine-tuned by next-token prediction on chat-rendered arithmetic ("What is 23 plus 45?"
answered in one of three phrasings, the sum right most of the time). ``peakedness`` reports how peaked its
distributions are on the task's prompts (median top-1 probability, mean entropy); the dataset it was trained on is
written beside it (``sums.jsonl``) for the ``jsonl:`` task with the ``numeric`` reward.

Deterministic: a fixed seed, one CPU thread during the build and a private RNG; the same seed, torch version and
CPU give the same bytes. ``cached_realistic_model`` keeps one build per configuration under a cache directory.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from trainer.base_model import padded_batch
from trainer.model import LOAD_LOCK
from trainer.model_dir import flatten_rope_theta

transformers.utils.logging.disable_progress_bar()

SPECIALS = ["<|pad|>", "<|begin|>", "<|end|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "<|begin|>{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
ROPE_THETA = 5e5
DATASET = "sums.jsonl"
BUILD_VERSION = 1  # bump when the recipe changes: cached builds are keyed on it


@dataclass(frozen=True)
class RealisticConfig:
    """The model's shape and the fine-tuning schedule (defaults: ~1M parameters, ~1 min on one core)."""

    hidden: int = 128
    layers: int = 4
    vocab: int = 512
    max_operand: int = 49
    wrong_prob: float = 0.1  # the teacher's sum is off by one this often: the answer digits stay uncertain
    steps: int = 500
    batch_size: int = 32
    lr: float = 3e-3
    warmup: int = 30
    seed: int = 0


def question(a: int, b: int) -> str:
    return f"What is {a} plus {b}?"


def answer_text(rng: random.Random, a: int, b: int, n: int) -> str:
    """One of three phrasings: a real model's first completion token is uncertain, its continuation peaked."""
    r = rng.random()
    if r < 0.5:
        return str(n)
    if r < 0.8:
        return f"The answer is {n}."
    return f"{a} plus {b} is {n}."


def write_dataset(path: Path, cfg: RealisticConfig) -> Path:
    """Every (a, b) pair as a JSON-lines row: the task the model was tuned on, answers as numbers."""
    with open(path, "w", encoding="utf-8") as fh:
        for a in range(cfg.max_operand + 1):
            for b in range(cfg.max_operand + 1):
                fh.write(json.dumps({"prompt": question(a, b), "answer": a + b}) + "\n")
    return path


def build_tokenizer(cfg: RealisticConfig) -> PreTrainedTokenizerFast:
    rng = random.Random(cfg.seed)
    corpus = []
    for a in range(cfg.max_operand + 1):
        for b in range(cfg.max_operand + 1):
            corpus.append(question(a, b) + " " + answer_text(rng, a, b, a + b))
    corpus += ["<|user|>\n", "<|end|>\n", "<|assistant|>\n"] * 8  # the template's newline is a token too
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    tok.decoder = decoders.Metaspace(prepend_scheme="never")
    trainer = trainers.BpeTrainer(vocab_size=cfg.vocab, special_tokens=SPECIALS, show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin|>", eos_token="<|end|>", pad_token="<|pad|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def render_prompt(tok: PreTrainedTokenizerFast, text: str) -> list[int]:
    """The chat-rendered prompt ids, exactly as trainer/text.py's TextCodec(chat_template=True) builds them."""
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return list(tok.encode(rendered, add_special_tokens=False))


def llama_config(cfg: RealisticConfig, tok: PreTrainedTokenizerFast) -> LlamaConfig:
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    return LlamaConfig(
        vocab_size=len(tok),
        hidden_size=cfg.hidden,
        intermediate_size=3 * cfg.hidden,
        num_hidden_layers=cfg.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        rope_theta=ROPE_THETA,
        bos_token_id=ids["<|begin|>"],
        eos_token_id=ids["<|end|>"],
        pad_token_id=ids["<|pad|>"],
    )


def _example(rng: random.Random, tok: PreTrainedTokenizerFast, cfg: RealisticConfig) -> tuple[list[int], list[int]]:
    a, b = rng.randint(0, cfg.max_operand), rng.randint(0, cfg.max_operand)
    n = a + b + (rng.choice((-1, 1)) if rng.random() < cfg.wrong_prob else 0)
    prompt = render_prompt(tok, question(a, b))
    completion = [*tok.encode(answer_text(rng, a, b, n), add_special_tokens=False), tok.eos_token_id]
    return prompt, completion


def finetune(tok: PreTrainedTokenizerFast, cfg: RealisticConfig) -> LlamaForCausalLM:
    """Next-token prediction on the completions (prompts are not learned); one thread, fixed seed."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            with LOAD_LOCK:  # another thread's load would leave torch.nn.init patched to no-ops
                model = LlamaForCausalLM(llama_config(cfg, tok)).to(torch.float32)
            opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=0.0)
            sched = torch.optim.lr_scheduler.LambdaLR(
                opt, lambda s: min(1.0, (s + 1) / cfg.warmup) * max(0.05, 1.0 - s / cfg.steps)
            )
            rng = random.Random(cfg.seed + 1)
            model.train()
            for _ in range(cfg.steps):
                ids, attn, labels = padded_batch(
                    [_example(rng, tok, cfg) for _ in range(cfg.batch_size)], tok.pad_token_id
                )
                loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
            return model.eval()
    finally:
        torch.set_num_threads(threads)


def build_realistic_model(out_dir: Path, cfg: RealisticConfig | None = None) -> Path:
    """Build, fine-tune and write the model, its tokenizer and its dataset (``sums.jsonl``) to ``out_dir``."""
    cfg = cfg or RealisticConfig()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(cfg)
    model = finetune(tok, cfg)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    flatten_rope_theta(out_dir)
    write_dataset(out_dir / DATASET, cfg)
    return out_dir


def cache_key(cfg: RealisticConfig) -> str:
    blob = json.dumps({"v": BUILD_VERSION, "torch": torch.__version__, **asdict(cfg)}, sort_keys=True)
    return hashlib.blake2s(blob.encode()).hexdigest()[:12]


def default_cache_dir() -> Path:
    """Where builds are kept: $SWARMRL_CACHE, else runs/.fixtures under the current directory."""
    return Path(os.environ.get("SWARMRL_CACHE") or Path("runs") / ".fixtures")


def cached_realistic_model(cfg: RealisticConfig | None = None, cache_dir: Path | None = None) -> Path:
    """The model for ``cfg``, built once per cache directory (atomically: a crashed build leaves no half dir)."""
    cfg = cfg or RealisticConfig()
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / f"realistic-{cache_key(cfg)}"
    if (final / DATASET).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    # one build at a time per cache: the test suite's two workers asked for it at once, and each trained its own copy
    # (~35 s of CPU each, on a 2-core box); the second now waits for the first's and uses it
    with open(root / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / DATASET).is_file():
            return final
        tmp = root / f".{final.name}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        build_realistic_model(tmp, cfg)
        try:
            tmp.rename(final)
        except OSError:  # another process finished the same build first (a cache without working locks)
            shutil.rmtree(tmp, ignore_errors=True)
    return final


@torch.no_grad()
def peakedness(model_dir: Path, prompts: int = 64, max_tokens: int = 12, seed: int = 0) -> dict[str, float]:
    """How peaked the model is where samplers draw: greedy completions of dataset prompts, and at every
    completion position the top-1 probability and the entropy (nats) of the next-token distribution at T=1."""
    from trainer.model import load_model, load_tokenizer

    tok = load_tokenizer(model_dir)
    model = load_model(model_dir).eval()
    rng = random.Random(seed)
    top1: list[float] = []
    ent: list[float] = []
    eos = tok.eos_token_id
    for _ in range(prompts):
        a, b = rng.randint(0, 49), rng.randint(0, 49)
        ids = render_prompt(tok, question(a, b))
        for _ in range(max_tokens):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].double()
            p = torch.softmax(logits, -1)
            top1.append(float(p.max()))
            ent.append(float(-(p * p.clamp_min(1e-300).log()).sum()))
            nxt = int(p.argmax())
            ids.append(nxt)
            if nxt == eos:
                break
    t = torch.tensor(top1)
    return {
        "positions": float(len(top1)),
        "median_top1": float(t.median()),
        "mean_top1": float(t.mean()),
        "frac_top1_over_0.9": float((t > 0.9).double().mean()),
        "mean_entropy": float(torch.tensor(ent).mean()),
    }
