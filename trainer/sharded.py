"""The learner sharded over N ranks with FSDP2 (``fully_shard``): one instance per rank, all running each command
together (trainer/distributed.py decides which; trainer/leader.py is rank 0's view of it).

- Sharding: every decoder layer is its own FSDP unit, the root (embeddings, final norm, output head: tied weights
  stay in one unit) another; the root module is ``LogitsAt`` so that its forward computes logits only at
  completion positions. Under ``--dtype bf16``: ``MixedPrecisionPolicy`` (bf16 parameters in compute, fp32
  gradient reduction) inside the same autocast the single-rank learner uses; fp32 otherwise.
- Data parallel: each step's rows are dealt to the ranks (trainer/model.py ``rank_micro_batches``); every rank
  runs as many micro-batches (an idle pass where it has none left), each micro-batch's loss divided by the WHOLE
  batch's token count, and the reduce-scatter SUMS the ranks' gradients: the gradient one rank would compute.
- Versions: written tensor by tensor through rank 0, each gathered in the publish dtype (no rank ever holds the
  model in fp32, nor more than one tensor beyond its shard), bit-identical to what one rank writes.
- Verification: the scoring model is sharded too; a version's file is loaded as each rank's own slices (dim 0,
  the way FSDP cuts it), and scoring is a collective forward with the rows dealt to the ranks.
- Checkpoints: DCP (trainer/sharded_state.py).

Loading: each rank reads the full model on the CPU and shards it, one rank after another (``in_turn``), so the
host holds one full copy at a time beside the shards, not one per rank.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from protocols.draw import TokenDraw
from protocols.weights_file import read_layout, read_span
from trainer.checkpoint import load_checkpoint
from trainer.distributed import Ranks
from trainer.draws import split_draws, token_draws
from trainer.errors import UserError
from trainer.evaluate import evaluate_with
from trainer.grpo import LossStats
from trainer.learner import Learner
from trainer.model import (
    TORCH_DTYPES,
    LogitsAt,
    completion_logits,
    load_model,
    published_state,
    rank_micro_batches,
    weights_header,
)
from trainer.scorer import Scorer
from trainer.settings import LearnerSettings
from trainer.sharded_state import load_full, load_sharded, save_sharded
from trainer.tasks import Task

T = TypeVar("T")


def decoder_layers(lm: PreTrainedModel) -> list[torch.nn.Module]:
    layers = getattr(lm.base_model, "layers", None)
    if layers is None:
        raise UserError(f"cannot shard {type(lm).__name__}: its base model has no .layers (decoder layers)")
    return list(layers)


def shard(lm: PreTrainedModel, mesh: Any, mp: MixedPrecisionPolicy | None = None) -> LogitsAt:
    """``lm`` sharded in place: each decoder layer a unit, the rest in the root ``LogitsAt``. Gradients are summed
    over ranks, not averaged (each rank's loss is already a share of the whole batch's)."""
    kw: dict[str, Any] = {"mesh": mesh, **({"mp_policy": mp} if mp is not None else {})}
    for layer in decoder_layers(lm):
        fully_shard(layer, **kw)
    policy = LogitsAt(lm)
    fully_shard(policy, **kw)
    for m in policy.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    return policy


def resharded(policy: torch.nn.Module) -> torch.nn.Module:
    """``policy`` with every unit's parameters back to their shards. FSDP leaves the root's gathered after a forward
    without backward (scoring, generating): that frees them, and a child module's state_dict sees the shards."""
    for m in policy.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    return policy


def in_turn(ranks: Ranks, build: Callable[[], T]) -> T:
    """``build()`` on each rank in rank order, one at a time (a model read whole before sharding: host memory)."""
    out = None
    for r in range(ranks.world):
        if r == ranks.rank:
            out = build()
        dist.barrier(group=ranks.control)
    return out  # type: ignore[return-value]


def gathered(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One whole tensor in ``dtype`` (a shard is cast first: the gather moves publish-dtype bytes)."""
    t = t.detach().to(dtype)
    return t.full_tensor() if isinstance(t, DTensor) else t


def write_sharded_weights(policy: LogitsAt, path: Path, dtype: torch.dtype, writer: bool) -> None:
    """``write_weights`` for a sharded model: every rank gathers each tensor in turn, rank 0 (``writer``) writes it."""
    state = published_state(resharded(policy).lm)
    tmp = path.with_suffix(".tmp")
    fh = open(tmp, "wb") if writer else None
    try:
        if fh is not None:
            fh.write(weights_header(state, dtype).head)
        for t in state.values():
            full = gathered(t, dtype)
            if fh is not None and full.numel():
                fh.write(full.to("cpu").contiguous().view(torch.uint8).numpy().data)
            del full
    finally:
        if fh is not None:
            fh.close()
    if writer:
        os.replace(tmp, path)


def dim0_slice(rows: int, rank: int, world: int) -> tuple[int, int]:
    """The rows of a dim-0 shard, as FSDP (torch.chunk) cuts them: ceil(rows / world) each, the last ones short."""
    per = math.ceil(rows / world) if rows else 0
    start = min(rows, rank * per)
    return start, min(rows, start + per)


@torch.no_grad()
def load_shards_into(policy: LogitsAt, path: Path, rank: int, world: int) -> None:
    """A weights file into a sharded model: each rank reads only its own rows of each tensor."""
    params = resharded(policy).lm.state_dict()
    _head, tensors = read_layout(path)
    with open(path, "rb") as fh:
        for t in tensors:
            dst = params[t.name]
            local = dst.to_local() if isinstance(dst, DTensor) else dst
            if isinstance(dst, DTensor) and t.shape:
                start, stop = dim0_slice(t.shape[0], rank, world)
                if local.shape[0] != stop - start:
                    raise RuntimeError(f"{t.name}: shard of {local.shape[0]} rows, expected {stop - start}")
                row = t.nbytes // max(t.shape[0], 1)
                offset, nbytes = t.offset + start * row, (stop - start) * row
            else:
                offset, nbytes = t.offset, t.nbytes
            if not nbytes:
                continue
            raw = torch.from_numpy(read_span(fh, offset, nbytes)).view(TORCH_DTYPES[t.dtype])
            local.copy_(raw.reshape(local.shape))


def idle_forward(policy: torch.nn.Module, device: torch.device) -> torch.Tensor:
    """A one-token forward: a rank with no rows left still takes part in every collective."""
    one = torch.zeros(1, 1, dtype=torch.long, device=device)
    zero = torch.zeros(1, dtype=torch.long, device=device)
    return policy(one, torch.ones_like(one), zero, zero)


class ShardedScorer(Scorer):
    """The scorer with its model sharded: loading a version and scoring are collectives (rank 0 gets the draws).
    Only rank 0 deletes version files; every rank forgets the same ones."""

    def __init__(self, ranks: Ranks, *args: Any) -> None:
        self.ranks = ranks
        super().__init__(*args)

    def _load_model(self, model_dir: Path) -> torch.nn.Module:
        mesh = self.ranks.mesh
        return in_turn(self.ranks, lambda: shard(load_model(model_dir, self.precision.scoring, "cpu").eval(), mesh))

    def forget_older_than(self, version: int) -> None:
        if self.ranks.rank == 0:
            super().forget_older_than(version)
        elif self._loaded is not None and not version - self.keep < self._loaded <= version:
            self._loaded = None

    @torch.no_grad()
    def score(
        self, version: int, prompts: list[list[int]], completions: list[list[int]], temperature: float, top_p: float
    ) -> list[list[TokenDraw]] | None:
        rank, world = self.ranks.rank, self.ranks.world
        with self._lock:
            if self._loaded != version:
                load_shards_into(self.model, self.path(version), rank, world)
                self._loaded = version
                self.switches += 1
            lengths = [len(p) + len(c) for p, c in zip(prompts, completions, strict=True)]
            mine: dict[int, list[TokenDraw]] = {}
            for rows in rank_micro_batches(lengths, world, self.token_budget)[rank]:
                if not rows:
                    idle_forward(self.model, self.precision.device)
                    continue
                with self.precision.autocast():
                    logits, _, _, targets = completion_logits(
                        self.model, [prompts[i] for i in rows], [completions[i] for i in rows]
                    )
                draws = split_draws(
                    token_draws(logits, targets, temperature, top_p), [len(completions[i]) for i in rows]
                )
                mine.update(zip(rows, draws, strict=True))
            resharded(self.model)
            parts: list[Any] | None = [None] * world if rank == 0 else None
            dist.gather_object(mine, parts, dst=0, group=self.ranks.control)
        if parts is None:
            return None
        out: list[list[TokenDraw]] = [[] for _ in completions]
        for part in parts:
            for i, row in part.items():
                out[i] = row
        return out


class ShardedLearner(Learner):
    """One rank's shard of the learner. Every method that touches the model is a collective: call it on every
    rank at once, in the same order (trainer/leader.py sees to that)."""

    def __init__(
        self, ranks: Ranks, model_dir: Path, settings: LearnerSettings, keep_versions: int, work_dir: Path
    ) -> None:
        self.ranks = ranks
        super().__init__(model_dir, settings, keep_versions, work_dir)

    # -- the model, sharded ------------------------------------------------------------------------------
    def _load_policy(self, model_dir: Path) -> tuple[PreTrainedModel, torch.nn.Module]:
        mp, mesh = None, self.ranks.mesh
        if self.precision.compute != torch.float32:
            mp = MixedPrecisionPolicy(param_dtype=self.precision.compute, reduce_dtype=torch.float32)

        def build() -> tuple[PreTrainedModel, torch.nn.Module]:
            model = load_model(model_dir, torch.float32, "cpu").eval()
            if self.settings.activation_checkpointing:
                model.activation_checkpointing_enable()
                model.config.use_cache = False
            return model, shard(model, mesh, mp)

        return in_turn(self.ranks, build)

    def _load_reference(self, model_dir: Path) -> torch.nn.Module:
        mesh = self.ranks.mesh
        return in_turn(self.ranks, lambda: shard(load_model(model_dir, self.precision.scoring, "cpu").eval(), mesh))

    def _make_scorer(self, model_dir: Path, keep: int, root: Path) -> Scorer:
        return ShardedScorer(self.ranks, model_dir, self.precision, keep, root, self.settings.micro_batch_tokens)

    # -- training ----------------------------------------------------------------------------------------
    def _micro_batches(self, lengths: list[int]) -> list[list[int]]:
        """This rank's share of the batch's micro-batches (as many on every rank; some may be empty)."""
        return rank_micro_batches(lengths, self.ranks.world, self.settings.micro_batch_tokens)[self.ranks.rank]

    def _batch_stats(self, totals: list[float]) -> LossStats:
        """The stats summed over ranks (the whole batch's)."""
        summed = torch.tensor(totals, dtype=torch.float64)
        dist.all_reduce(summed, group=self.ranks.control)
        return LossStats(*summed.tolist())

    def _idle_pass(self) -> None:
        device = self.precision.device
        with self.precision.autocast():
            loss = idle_forward(self.policy, device).sum() * 0.0
            if self.ref_model is not None:
                with torch.no_grad():
                    idle_forward(self.ref_model, device)
        loss.backward()

    def _clip_gradients(self) -> float:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads, 2.0)
        if isinstance(total, DTensor):
            total = total.full_tensor()
        coef = torch.clamp(self.settings.grad_clip / (total + 1e-6), max=1.0).item()
        for g in grads:
            g.mul_(coef)
        return total.item()

    # -- versions ----------------------------------------------------------------------------------------
    def write_version(self, version: int) -> Path:
        try:
            if self.ranks.rank != 0:
                self.version = version  # only rank 0 names versions
            if version != self.version:
                raise ValueError(f"version {version} is not the one named last ({self.version})")
            path = self.scorer.path(version)
            write_sharded_weights(self.policy, path, self.precision.publish, self.ranks.rank == 0)
            self.scorer.forget_older_than(version)
            return path
        finally:
            self._written.set()

    # -- evaluation --------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Greedy completions of equal-length prompts, ``max_tokens`` forwards on every rank (no early stop, so
        every rank runs the same collectives)."""
        self.model.eval()
        device = self.precision.device
        ids = torch.tensor(prompts, dtype=torch.long, device=device)
        batch = torch.arange(len(prompts), device=device)
        for _ in range(max_tokens):
            last = torch.full((len(prompts),), ids.shape[1] - 1, device=device)
            with self.precision.autocast():
                logits = self.policy(ids, torch.ones_like(ids), batch, last)
            ids = torch.cat([ids, logits.argmax(-1)[:, None]], dim=1)
        resharded(self.policy)
        return ids[:, len(prompts[0]) :].tolist()

    def evaluate(self, task: Task, n: int, max_tokens: int) -> dict[str, float]:
        return evaluate_with(lambda prompts: self.generate(prompts, max_tokens), task, self.codec, n)

    # -- checkpoints -------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        raise NotImplementedError("a sharded learner checkpoints into a directory: save_state(directory)")

    def save_state(self, directory: Path) -> dict[str, Any]:
        """Model and optimizer as a DCP checkpoint in ``directory`` (written whole or not at all)."""
        save_sharded(self.policy, self.optimizer, Path(directory), self.ranks)
        return {"dcp": str(directory), "version": self.version, "step": self.steps}

    def restore(self, state: dict[str, Any], path: Path | None = None) -> None:
        """From a DCP checkpoint (any world size), or from a single-rank checkpoint (``state`` itself, or the file
        at ``path``, memory-mapped)."""
        if "dcp" in state:
            load_sharded(self.policy, self.optimizer, Path(state["dcp"]), self.ranks.control)
        else:
            full = state if "model" in state else load_checkpoint(Path(path), mmap=True)
            load_full(self.policy, self.optimizer, full)
        self.steps = state["step"]
        self._name_version(state["version"])
