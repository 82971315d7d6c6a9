"""The embedded default policy: a tiny Qwen2 with a character tokenizer, built deterministically, no downloads.

The result is an ordinary HF checkpoint directory that stock ``transformers`` and ``mlx_lm`` both open.
rope_theta is written flat into config.json too, because mlx-lm ignores transformers 5's nested
``rope_parameters`` and would silently use 1e6 (wrong logits).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

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


def tiny_config(layers: int = 2, hidden: int = 128) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=len(vocab()),
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        rope_theta=ROPE_THETA,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )


def build_tiny_model(out_dir: Path, seed: int = 0, layers: int = 2, hidden: int = 128) -> Path:
    """Write the tiny model + tokenizer to ``out_dir``; the same seed gives the same bytes."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(tiny_config(layers, hidden)).to(torch.float32)
    model.save_pretrained(out_dir)
    build_tokenizer().save_pretrained(out_dir)
    flatten_rope_theta(out_dir)
    return out_dir


def flatten_rope_theta(model_dir: Path) -> None:
    """Copy a nested rope_theta to the top level of config.json, where mlx-lm looks for it."""
    path = Path(model_dir) / "config.json"
    cfg = json.loads(path.read_text())
    nested = (cfg.get("rope_parameters") or {}).get("rope_theta")
    if nested is not None and cfg.get("rope_theta") != nested:
        cfg["rope_theta"] = nested
        path.write_text(json.dumps(cfg, indent=2, sort_keys=True))
