"""The embedded base model: a tiny Qwen2 *pretrained* on a weak teacher, so that RL has something to sharpen.

Why not random init: a randomly initialised tiny Qwen2 learns "reverse 5 digits" from GRPO alone very slowly
(eval reward 0 -> ~0.2, exact accuracy 0.00 after 80 steps of 16x8 rollouts), even with its outputs restricted to
digits; a same-size GPT-2 (learned absolute positions) learns the restricted task in ~80 steps. Reversal needs absolute
positions, which a RoPE model must discover from sparse reward: too slow for a demo.

What this builds instead: the same architecture and tokenizer as ``trainer.tiny_qwen2``, trained by plain
next-token prediction on a *weak teacher*: for a 5-digit string followed by ">" (the RL task's prompt format), the
teacher answers with the string copied (probability ``1 - reverse_prob``) or reversed (``reverse_prob``), then "<eos>".
Teaching several lengths at once (3-7) left the two modes entangled at this budget (rotations, mixed outputs) and made
the RL curve slower and seed-dependent, so the default teaches the task's length only.
The resulting base model reverses in about one sample in five at temperature 1 but copies under greedy decoding,
so the RL task's held-out exact accuracy starts near 0 while GRPO groups carry signal from the first step;
the rise of the greedy eval curve is the RL's doing.

Deterministic: a fixed seed, one CPU thread during the build (the thread count changes float summation order)
and a private RNG state; the same seed, torch version and CPU give the same bytes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from transformers import Qwen2ForCausalLM

from trainer.model import LOAD_LOCK
from trainer.model_dir import flatten_rope_theta
from trainer.tiny_qwen2 import BOS_ID, EOS_ID, PAD_ID, build_tokenizer, tiny_config, vocab

transformers.utils.logging.disable_progress_bar()  # no 'Writing model shards' bars in the demo

DIGITS = "0123456789"
__all__ = ["BOS_ID", "EOS_ID", "PAD_ID", "PretrainConfig", "build_base_model", "padded_batch", "pretrain"]


@dataclass(frozen=True)
class PretrainConfig:
    """The weak teacher and the supervised schedule (defaults take ~30-40 s on one core)."""

    lengths: tuple[int, ...] = (5,)  # the RL task's prompt length: see the module docstring
    reverse_prob: float = 0.2  # the teacher reverses this often and copies otherwise
    steps: int = 400
    batch_size: int = 64
    lr: float = 3e-3
    warmup: int = 50
    layers: int = 2
    hidden: int = 128


def teacher_example(rng: random.Random, cfg: PretrainConfig) -> tuple[list[int], list[int]]:
    """One (prompt ids, completion ids) pair: "<bos>d1..dn>" then the copy or the reversal and "<eos>"."""
    table = vocab()
    digits = "".join(rng.choice(DIGITS) for _ in range(rng.choice(cfg.lengths)))
    answer = digits[::-1] if rng.random() < cfg.reverse_prob else digits
    prompt = [BOS_ID, *(table[c] for c in digits + ">")]
    return prompt, [*(table[c] for c in answer), EOS_ID]


def make_batch(rng: random.Random, cfg: PretrainConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch of the weak teacher's examples (``padded_batch``)."""
    return padded_batch([teacher_example(rng, cfg) for _ in range(cfg.batch_size)], PAD_ID)


def padded_batch(
    rows: list[tuple[list[int], list[int]]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(prompt, completion) pairs as right-padded input ids, attention mask and labels (-100 outside completions:
    prompts are not learned)."""
    width = max(len(p) + len(c) for p, c in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (p, c) in enumerate(rows):
        seq = p + c
        ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
        labels[i, len(p) : len(seq)] = torch.tensor(c)
    return ids, attn, labels


def pretrain(seed: int = 0, cfg: PretrainConfig | None = None) -> Qwen2ForCausalLM:
    """Train a fresh tiny Qwen2 on the weak teacher; deterministic for a given seed (runs on one thread)."""
    cfg = cfg or PretrainConfig()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            with LOAD_LOCK:  # another thread's load would leave torch.nn.init patched to no-ops
                model = Qwen2ForCausalLM(tiny_config(cfg.layers, cfg.hidden)).to(torch.float32)
            opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=0.0)
            sched = torch.optim.lr_scheduler.LambdaLR(
                opt, lambda s: min(1.0, (s + 1) / cfg.warmup) * max(0.0, 1.0 - s / cfg.steps)
            )
            rng = random.Random(seed)
            model.train()
            for _ in range(cfg.steps):
                ids, attn, labels = make_batch(rng, cfg)
                loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
            return model.eval()
    finally:
        torch.set_num_threads(threads)


def build_base_model(out_dir: Path, seed: int = 0, cfg: PretrainConfig | None = None) -> Path:
    """Pretrain and write the base model + tokenizer to ``out_dir`` (a model dir transformers and mlx_lm open)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pretrain(seed, cfg).save_pretrained(out_dir)
    build_tokenizer().save_pretrained(out_dir)
    flatten_rope_theta(out_dir)
    return out_dir
