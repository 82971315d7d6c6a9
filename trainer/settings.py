"""The learner's knobs, and ``knob``: a dataclass field with the help text its CLI flag shows.

node/settings.py turns every such dataclass into command-line flags and bootstrap.toml keys, so a knob is
declared once, here or there, with its default and its help.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEVICES = ("auto", "cuda", "mps", "cpu")
DTYPES = ("auto", "bf16", "fp32")


def knob(default: Any, help: str, **meta: Any) -> Any:
    """A settings field: ``help`` for --help; ``flag`` overrides the flag name and ``key`` the bootstrap.toml key,
    ``choices`` limits values, ``type`` is what the flag's text or the file's value must be (default: the
    default's type), ``parse(value, where)`` turns that into the field's value, ``many`` (a container type) makes
    a repeatable flag and a list in the file, ``moot`` is node/settings.py's."""
    return field(default=default, metadata={"help": help, **meta})


@dataclass
class LearnerSettings:
    model_dir: Path | None = knob(
        None, "local HF model directory (default: the embedded base model)", flag="model", type=Path
    )
    lr: float = knob(3e-4, "AdamW learning rate (the embedded base model's; real models want ~1e-6)")
    clip_low: float = knob(0.2, "PPO clip below the ratio 1 (eps_low)")
    clip_high: float = knob(0.28, "PPO clip above the ratio 1 (eps_high, DAPO's clip-higher)")
    tis_cap: float = knob(2.0, "cap on the truncated importance weight pi_old / mu")
    kl_beta: float = knob(0.0, "weight of a KL penalty to the initial model (0: none, no reference model kept)")
    grad_clip: float = knob(1.0, "gradient norm clip")
    seed: int = knob(0, "torch seed")
    torch_threads: int = knob(1, "torch CPU threads for the learner")
    device: str = knob("auto", "where the learner runs (auto: cuda, then mps, then cpu)", choices=DEVICES)
    dtype: str = knob(
        "auto", "bf16: fp32 master weights, bf16 autocast, bf16 versions (auto: bf16 on cuda)", choices=DTYPES
    )
    publish_dtype: str = knob(
        "auto",
        "dtype versions are published in (auto: the compute dtype); bf16 from an fp32 learner halves every version"
        " and lets versions travel as sparse patches (the bits that changed) at low learning rates",
        choices=DTYPES,
    )
    micro_batch_tokens: int = knob(8192, "padded tokens per forward/backward micro-batch (gradients accumulate)")
    activation_checkpointing: bool = knob(False, "recompute activations in backward (less memory, ~30% slower)")
    chat_template: bool = knob(False, "render prompts through the tokenizer's chat template")
    nproc: int = knob(
        1,
        "ranks the learner is sharded over (FSDP2; rank 0 is this node and starts the others; under torchrun,"
        " the ranks torchrun started)",
    )
