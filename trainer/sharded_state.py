"""A sharded learner's checkpoint: model and optimizer state in a DCP directory (torch.distributed.checkpoint), one
directory per checkpoint, which N ranks write and M ranks (M = 1 included) read back.

Keys are the fully qualified names under a ``LogitsAt`` root ("lm." + the model's own names) on every side: a sharded
learner's root is one, and a single-rank learner wraps its model in one to read or write these. A directory is
written as ``<name>.tmp`` and renamed when every rank has finished, so a crash leaves the previous one whole; the
two newest are kept (the node's checkpoint file names the newest only once it is written itself).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from trainer.model import LogitsAt

KEEP = 2


def dcp_state(policy: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    model, optim = get_state_dict(policy, optimizer)
    return {"model": model, "optim": optim}


def save_sharded(policy: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path, ranks: Any) -> None:
    """Every rank writes its shards; rank 0 renames the finished directory into place and drops older ones."""
    tmp = directory.with_name(directory.name + ".tmp")
    if ranks.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.parent.mkdir(parents=True, exist_ok=True)
    dist.barrier(group=ranks.control)
    dcp.save(dcp_state(policy, optimizer), checkpoint_id=tmp, process_group=ranks.control)
    dist.barrier(group=ranks.control)
    if ranks.rank == 0:
        os.replace(tmp, directory)
        prune(directory.parent, KEEP)


def prune(root: Path, keep: int) -> None:
    """Keep the ``keep`` newest checkpoint directories in ``root`` (names sort by step, then time)."""
    done = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.endswith(".tmp"))
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def load_sharded(policy: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path, group: Any) -> None:
    """A DCP checkpoint of any world size into this sharded learner (DCP reshards as it reads)."""
    state = dcp_state(policy, optimizer)
    dcp.load(state, checkpoint_id=directory, process_group=group)
    set_state_dict(policy, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def load_unsharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """A DCP checkpoint that N ranks wrote into one unsharded learner (no process group needed)."""
    policy = LogitsAt(model)
    state = dcp_state(policy, optimizer)
    dcp.load(state, checkpoint_id=directory, no_dist=True)
    set_state_dict(policy, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def load_full(policy: torch.nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """A single-rank checkpoint (full state dicts; the optimizer's keyed by parameter index) into a sharded learner:
    every rank keeps its own slices."""
    names = [name for name, _ in policy.named_parameters()]
    osd = saved["optimizer"]
    optim = {
        "state": {names[i]: s for i, s in osd["state"].items()},
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in osd["param_groups"]],
    }
    model = {f"lm.{k}": v for k, v in saved["model"].items()}
    options = StateDictOptions(full_state_dict=True)
    set_state_dict(policy, optimizer, model_state_dict=model, optim_state_dict=optim, options=options)
