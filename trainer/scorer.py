"""Recomputes logprobs at the exact policy version a rollout claims, with memory that does not grow with the
number of versions kept.

Every version the learner names is written once, in the publish dtype, to ``<root>/v<N>.safetensors`` (the
file publishing hard-links into the version's model dir: the bits samplers run are the bits scored). One
scoring model, in the publish dtype, is moved between versions by copying a version's file into it tensor by
tensor from a memory map. Host memory: one model in the publish dtype; disk: ``keep`` weight files.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from protocols.draw import TokenDraw
from trainer.device import Precision
from trainer.draws import split_draws, token_draws
from trainer.model import completion_logits, load_model, load_weights_into, micro_batches


class Scorer:
    def __init__(self, model_dir: Path, precision: Precision, keep: int, root: Path, token_budget: int) -> None:
        self.precision = precision
        self.model = self._load_model(model_dir)
        self.keep = keep
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        # versions already on disk when this scorer started: a restarted trainer's, named before it crashed (the
        # learner names version 0 next, which forgets them)
        self.found_at_start = self.kept()
        self.token_budget = token_budget
        self._loaded: int | None = None
        self._lock = threading.Lock()
        self.switches = 0  # how often the scoring model moved to another version

    def _load_model(self, model_dir: Path) -> torch.nn.Module:
        return load_model(model_dir, self.precision.scoring, self.precision.device).eval()

    def path(self, version: int) -> Path:
        return self.root / f"v{version}.safetensors"

    def knows(self, version: int) -> bool:
        return self.path(version).exists()

    def kept(self) -> list[int]:
        return sorted(int(p.stem[1:]) for p in self.root.glob("v*.safetensors"))

    def forget_older_than(self, version: int) -> None:
        """Keep the newest ``keep`` versions up to ``version``; drop the rest (and any newer: a restart)."""
        with self._lock:
            wanted = set(range(version - self.keep + 1, version + 1))
            for v in self.kept():
                if v not in wanted:
                    self.path(v).unlink(missing_ok=True)
                    if self._loaded == v:
                        self._loaded = None

    @torch.no_grad()
    def score(
        self, version: int, prompts: list[list[int]], completions: list[list[int]], temperature: float, top_p: float
    ) -> list[list[TokenDraw]] | None:
        """Every completion token's logprob under ``version`` and the interval of the seeded draw that picks it
        (protocols/draw.py), from one forward pass; None when that version is no longer kept."""
        with self._lock:
            if not self.knows(version):
                return None
            if self._loaded != version:
                load_weights_into(self.model, self.path(version))
                self._loaded = version
                self.switches += 1
            out: list[list[TokenDraw]] = [[] for _ in completions]
            lengths = [len(p) + len(c) for p, c in zip(prompts, completions, strict=True)]
            for rows in micro_batches(lengths, self.token_budget):
                with self.precision.autocast():
                    logits, _, _, targets = completion_logits(
                        self.model, [prompts[i] for i in rows], [completions[i] for i in rows]
                    )
                draws = split_draws(
                    token_draws(logits, targets, temperature, top_p), [len(completions[i]) for i in rows]
                )
                for i, row in zip(rows, draws, strict=True):
                    out[i] = row
        return out

    def logprobs(
        self, version: int, prompts: list[list[int]], completions: list[list[int]], temperature: float
    ) -> list[list[float]] | None:
        """Per-token logprobs under ``version``, or None when that version is no longer kept."""
        draws = self.score(version, prompts, completions, temperature, 1.0)
        return None if draws is None else [[d.logprob for d in row] for row in draws]
