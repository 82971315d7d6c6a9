"""A tiny Qwen2 with a character tokenizer, built deterministically with random weights, no downloads: the shape of
the embedded base model (trainer/base_model.py pretrains it), and the model tests and benchmarks use at any size.

The result is an ordinary HF model directory that stock ``transformers`` and ``mlx_lm`` both open (rope_theta
written flat, see trainer/model_dir.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from trainer.model import LOAD_LOCK
from trainer.model_dir import flatten_rope_theta

transformers.utils.logging.disable_progress_bar()  # no 'Writing model shards' bars in the demo

SPECIALS = ["<pad>", "<bos>", "<eos>"]
CHARS = "0123456789+-*/=()<> abcdefghijklmnopqrstuvwxyz,.:?\n"
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
ROPE_THETA = 10000.0


def vocab() -> dict[str, int]:
    table = {tok: i for i, tok in enumerate(SPECIALS)}
    for c in CHARS:
        table[c] = len(table)
    return table


def build_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel(vocab=vocab(), unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")


def tiny_config(
    layers: int = 2,
    hidden: int = 128,
    vocab_size: int | None = None,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
) -> Qwen2Config:
    """The embedded shape by default; any Qwen2 shape otherwise (``vocab_size`` above the tokenizer's leaves the
    extra rows as ids it never produces: Qwen2.5-0.5B's shape is layers 24, hidden 896, vocab 151936, heads 14,
    kv_heads 2, intermediate 4864)."""
    return Qwen2Config(
        vocab_size=vocab_size or len(vocab()),
        hidden_size=hidden,
        intermediate_size=intermediate or 3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        rope_theta=ROPE_THETA,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )


def build_random_model(out_dir: Path, seed: int = 0, layers: int = 2, hidden: int = 128, **shape: int) -> Path:
    """Write a randomly initialised tiny Qwen2 + tokenizer to ``out_dir``; the same seed gives the same bytes.
    ``shape``: tiny_config's other arguments."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    with LOAD_LOCK:  # another thread's load would leave torch.nn.init patched to no-ops
        model = Qwen2ForCausalLM(tiny_config(layers, hidden, **shape)).to(torch.float32)
    model.save_pretrained(out_dir)
    build_tokenizer().save_pretrained(out_dir)
    flatten_rope_theta(out_dir)
    return out_dir
