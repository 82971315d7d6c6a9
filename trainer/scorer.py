"""Recomputes logprobs at the exact policy version a rollout claims, from snapshots of recent versions."""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

import torch

from trainer.model import load_model, token_logprobs


class Scorer:
    """A second copy of the model, loaded with whichever recent version a rollout names."""

    def __init__(self, model_dir: Path, keep: int) -> None:
        self.model = load_model(model_dir).eval()
        self.keep = keep
        self._snapshots: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()
        self._loaded: int | None = None
        self._lock = threading.Lock()

    def remember(self, version: int, state: dict[str, torch.Tensor]) -> None:
        snap = {k: v.detach().clone() for k, v in state.items()}
        with self._lock:
            self._snapshots[version] = snap
            while len(self._snapshots) > self.keep:
                self._snapshots.popitem(last=False)

    def forget_all(self) -> None:
        with self._lock:
            self._snapshots.clear()
            self._loaded = None

    def knows(self, version: int) -> bool:
        return version in self._snapshots

    @torch.no_grad()
    def logprobs(
        self, version: int, prompts: list[list[int]], completions: list[list[int]], temperature: float
    ) -> list[list[float]] | None:
        """Per-token logprobs under ``version``, or None when that version is no longer kept."""
        with self._lock:
            snap = self._snapshots.get(version)
            if snap is None:
                return None
            if self._loaded != version:
                self.model.load_state_dict(snap)
                self._loaded = version
            lp, _ = token_logprobs(self.model, prompts, completions, temperature)
        return [lp[i, : len(c)].tolist() for i, c in enumerate(completions)]
