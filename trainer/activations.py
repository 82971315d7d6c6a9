"""Measuring activations: the bytes a micro-batch's forward keeps for its backward."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local(t: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) parameter's own shard; any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


class ActivationMeter:
    """Bytes autograd keeps for backward (the activations) while a forward runs: each storage counted once, the
    parameters' own not. What ``--micro-batch-tokens`` trades against, and what memory targets add "plus" to.

    Use as a context manager around a micro-batch's forward (and loss); ``bytes`` is then that micro-batch's total.
    """

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self._params = {local(p).untyped_storage().data_ptr() for p in params}
        self._seen: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = local(t).untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._params:
            self._seen[ptr] = storage.nbytes()
        return t

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())

    def __enter__(self) -> ActivationMeter:
        self._seen.clear()
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
