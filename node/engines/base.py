"""What every sampler engine provides: grouped generation with the sampled tokens' logprobs, and hot swap.

Logprobs are those of the distribution actually sampled from at the given temperature
(log_softmax(logits / T)), before top-p truncation; the trainer recomputes exactly that.
Tokens are chosen by the seeded draw rule of protocols/draw.py: sample k of a group with seed s takes, at
completion position t, the token whose CDF interval holds u(s, k, t), so the trainer can replay every choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


class NotUpdatable(Exception):
    """An engine cannot apply these changes in place (the caller swaps the whole model instead)."""


@dataclass(frozen=True)
class Generation:
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (ended with a stop token, which is included) or "length"


class Engine(Protocol):
    name: str
    quant: str  # weight quantization, one of protocols.rollouts.QUANT_MODES
    compute: str  # the dtype its forward pass computes in, one of protocols.rollouts.COMPUTE_DTYPES
    version: int

    def generate(
        self,
        prompts: list[list[int]],
        *,
        temperature: float,
        top_p: float,
        max_tokens: int,
        seed: int,
    ) -> list[Generation]:
        """One group: prompt i is sample i, drawn with (``seed``, i)."""
        ...

    def generate_rows(
        self,
        prompts: list[list[int]],
        rows: list[tuple[int, int]],
        *,
        temperature: float,
        top_p: float,
        max_tokens: int,
    ) -> list[Generation]:
        """Any number of groups in one batch: prompt i is drawn with ``rows[i]`` = (group seed, sample index)."""
        ...

    def swap(self, model_dir: Path, version: int) -> None:
        """Replace the live weights with those in ``model_dir`` (same architecture), tagged ``version``."""
        ...

    # Optional: ``update(model_dir, version, changes)`` puts ``version`` in place, given which elements changed since
    # the running version (node.weights.patch.WeightChanges: flat positions per tensor name); the result must be
    # exactly what ``swap`` gives. Raises NotUpdatable (before touching anything it cannot finish) to ask for a swap.
