"""A local Hugging Face model directory: checked before any engine or learner touches it, so bad input fails
with a clear error. Imports no torch (samplers use it too).

mlx-lm ignores transformers 5's nested ``rope_parameters`` and would silently use rope_theta 1e6 (wrong
logits), so every directory this project writes gets rope_theta flat in config.json too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.errors import UserError

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)
# what a tokenizer may come as instead of tokenizer.json: transformers converts these (sentencepiece, tiktoken or
# BPE vocab files), but samplers get only tokenizer.json with every version (TOKENIZER_FILES)
SLOW_TOKENIZER_FILES = ("tokenizer.model", "tiktoken.model", "vocab.json", "merges.txt", "vocab.txt")


@dataclass(frozen=True)
class ModelDirInfo:
    path: Path
    config: dict[str, Any]
    model_type: str
    eos_ids: tuple[int, ...]
    rope_theta: float | None


def inspect_model_dir(path: Path) -> ModelDirInfo:
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"model directory {path} is not a directory")
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise UserError(f"model directory {path} has no config.json (is it a Hugging Face model directory?)")
    try:
        config = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{cfg_path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise UserError(f"{cfg_path} must hold a JSON object")
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UserError(f"model directory {path}: model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
    if not any(path.glob("*.safetensors")):
        raise UserError(f"model directory {path} has no *.safetensors weight files")
    require_tokenizer(path)
    eos_ids = stop_ids(path, config)
    rope = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta")
    return ModelDirInfo(path, config, model_type, eos_ids, float(rope) if rope is not None else None)


def require_tokenizer(path: Path) -> None:
    """A fast tokenizer (tokenizer.json) must be there: without one, transformers builds a one-token tokenizer
    for a Qwen2 and asks a Llama for sentencepiece or tiktoken, neither of which says that the file is missing."""
    if (path / "tokenizer.json").is_file():
        return
    slow = [name for name in SLOW_TOKENIZER_FILES if (path / name).is_file()]
    if slow:
        raise UserError(
            f"model directory {path} has no tokenizer.json, only {', '.join(slow)}: swarmrl needs the fast "
            "tokenizer file (every version ships it to the samplers); write it once with "
            "AutoTokenizer.from_pretrained(dir).save_pretrained(dir) where that tokenizer loads"
        )
    raise UserError(
        f"model directory {path} has no tokenizer files (tokenizer.json, or tokenizer.model / vocab.json + "
        "merges.txt to convert from): copy them from the model it was trained from"
    )


def _ids(value: Any) -> list[int]:
    if isinstance(value, list):
        return [int(v) for v in value if isinstance(v, int)]
    return [int(value)] if isinstance(value, int) else []


def stop_ids(path: Path, config: dict[str, Any]) -> tuple[int, ...]:
    """The tokens that end a completion: config.json's eos_token_id and generation_config.json's (chat models
    put their end-of-turn token there). Engines stop on these and the trainer checks against the same set."""
    ids = _ids(config.get("eos_token_id"))
    gen = path / "generation_config.json"
    if gen.is_file():
        try:
            ids += _ids(json.loads(gen.read_text()).get("eos_token_id"))
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            raise UserError(f"{gen} is not a valid JSON object") from None
    return tuple(dict.fromkeys(ids))


def flatten_rope_theta(model_dir: Path) -> None:
    """Copy a nested rope_theta to the top level of config.json, where mlx-lm looks for it."""
    path = Path(model_dir) / "config.json"
    cfg = json.loads(path.read_text())
    nested = (cfg.get("rope_parameters") or {}).get("rope_theta")
    if nested is not None and cfg.get("rope_theta") != nested:
        cfg["rope_theta"] = nested
        path.write_text(json.dumps(cfg, indent=2, sort_keys=True))
