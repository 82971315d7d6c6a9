"""Checks a local HF checkpoint directory before any engine touches it, so bad input fails with a clear error."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node.errors import UserError

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    config: dict[str, Any]
    model_type: str
    eos_ids: tuple[int, ...]
    rope_theta: float | None


def inspect_checkpoint(path: Path) -> CheckpointInfo:
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"checkpoint {path} is not a directory")
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise UserError(f"checkpoint {path} has no config.json (is it a Hugging Face model directory?)")
    try:
        config = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{cfg_path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise UserError(f"{cfg_path} must hold a JSON object")
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UserError(f"checkpoint {path}: model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
    if not any(path.glob("*.safetensors")):
        raise UserError(f"checkpoint {path} has no *.safetensors weight files")
    eos = config.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    rope = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta")
    return CheckpointInfo(path, config, model_type, eos_ids, float(rope) if rope is not None else None)
