"""The policy as a transformers causal LM: loading it, writing its weights as a version, and the per-token
logprobs GRPO and verification need, in micro-batches under a token budget.

Logits are computed only at completion positions (hidden states gathered, then the output head), in fp32 for
the log-softmax: a 150k-token vocabulary times every prompt position would dominate memory otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from protocols.weights_file import PT_METADATA, encode_header, read_layout, read_span
from trainer.errors import UserError
from trainer.model_dir import TOKENIZER_FILES, flatten_rope_theta, inspect_model_dir, require_tokenizer

transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()

WEIGHTS_FILE = "model.safetensors"
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# transformers' from_pretrained is not thread-safe: it builds the model under process-wide patches (the default
# dtype, torch.nn.init, tie_weights) entered and left per call, so two loads in two threads (a demo or a test
# swarm: the trainer and samplers' engines in one process) interleave them and one gets a model left on the meta
# device ("Cannot copy out of meta tensor"). Every load in this process goes through this lock.
LOAD_LOCK = threading.Lock()


def from_pretrained(model_dir: Path, dtype: torch.dtype) -> PreTrainedModel:
    """``AutoModelForCausalLM.from_pretrained`` one at a time per process, failures as a UserError."""
    with LOAD_LOCK:
        try:
            return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        except Exception as exc:
            raise UserError(f"transformers could not load {model_dir}: {exc}") from None


def load_model(
    model_dir: Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> PreTrainedModel:
    inspect_model_dir(model_dir)
    return from_pretrained(model_dir, dtype).to(device)


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    require_tokenizer(Path(model_dir))
    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except Exception as exc:
        raise UserError(f"cannot load the tokenizer in {model_dir}: {exc}") from None


def tied_keys(model: PreTrainedModel) -> set[str]:
    """State-dict keys that alias another tensor (save_pretrained leaves them out; loaders re-tie them)."""
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return set(tied) if model.config.tie_word_embeddings else set()


SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
TORCH_DTYPES = {v: k for k, v in SAFETENSORS_DTYPES.items()}


def published_state(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """What a version file holds: the state dict by name, tied aliases left out (as save_pretrained does)."""
    skip = tied_keys(model)
    return {k: v for k, v in sorted(model.state_dict().items()) if k not in skip}


def weights_header(state: dict[str, torch.Tensor], dtype: torch.dtype):
    """The safetensors header of ``state`` in ``dtype`` (shapes only: a sharded tensor's are its global ones)."""
    return encode_header([(name, SAFETENSORS_DTYPES[dtype], list(t.shape)) for name, t in state.items()], PT_METADATA)


def write_weights(model: PreTrainedModel, path: Path, dtype: torch.dtype) -> None:
    """The model's weights as one safetensors file in ``dtype`` (atomically; tied aliases left out, as
    save_pretrained does). Streamed tensor by tensor: the safetensors library would first serialise the whole
    model into one bytes object, a full extra copy at the trainer's peak."""
    state = published_state(model)
    layout = weights_header(state, dtype)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as fh:
        fh.write(layout.head)
        for t in state.values():
            cpu = t.detach().to("cpu", dtype).contiguous()
            if cpu.numel():
                fh.write(cpu.view(torch.uint8).numpy().data)
    os.replace(tmp, path)


def load_weights_into(model: PreTrainedModel, path: Path) -> None:
    """Copy a weights file into ``model`` tensor by tensor through one tensor-sized buffer (neither a second copy
    of the model nor a memory map that would count the whole file as resident)."""
    params = model.state_dict()
    _head, tensors = read_layout(path)
    with open(path, "rb") as fh:
        for t in tensors:
            if not t.nbytes:
                continue
            src = torch.from_numpy(read_span(fh, t.offset, t.nbytes)).view(TORCH_DTYPES[t.dtype]).reshape(t.shape)
            with torch.no_grad():
                params[t.name].copy_(src)
    if model.config.tie_word_embeddings:
        model.tie_weights()


def write_model_dir(
    model: PreTrainedModel, weights: Path, out: Path, tokenizer_source: Path, dtype: torch.dtype
) -> Path:
    """A model directory that stock transformers and mlx-lm open: config (with ``dtype``), generation config,
    tokenizer files from ``tokenizer_source``, and ``weights`` hard-linked in (copied across filesystems)."""
    out = Path(out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    model.config.save_pretrained(out)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["dtype"] = DTYPE_NAMES[dtype]
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True))
    for name in TOKENIZER_FILES:
        if (tokenizer_source / name).exists() and not (out / name).exists():
            shutil.copy(tokenizer_source / name, out / name)
    try:
        os.link(weights, out / WEIGHTS_FILE)
    except OSError:
        shutil.copy(weights, out / WEIGHTS_FILE)
    flatten_rope_theta(out)
    return out


def save_model_dir(
    model: PreTrainedModel, out: Path, tokenizer_source: Path, dtype: torch.dtype = torch.float32
) -> Path:
    """Write ``model`` as a complete model directory in ``dtype``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    weights = out.parent / f".{out.name}.weights"
    write_weights(model, weights, dtype)
    try:
        return write_model_dir(model, weights, out, tokenizer_source, dtype)
    finally:
        weights.unlink(missing_ok=True)


def micro_batches(lengths: list[int], token_budget: int) -> Iterator[list[int]]:
    """Row indices grouped so that each group's padded size (rows x longest row) stays within ``token_budget``;
    rows are taken longest first, so rows of similar length share a micro-batch (little padding). A row longer
    than the budget goes alone."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batch: list[int] = []
    for i in order:
        width = max(lengths[j] for j in [*batch, i]) if batch else lengths[i]
        if batch and width * (len(batch) + 1) > token_budget:
            yield batch
            batch = []
        batch.append(i)
    if batch:
        yield batch


def completion_logits(
    model: PreTrainedModel, prompts: list[list[int]], completions: list[list[int]]
) -> tuple[torch.Tensor, list[int], list[int], list[int]]:
    """One forward pass over right-padded prompt+completion rows: the fp32, untempered logits at every completion
    position [Ntok, V] (the output head applied only there), with each one's (row, slot in the completion, target
    token). Padding after a sequence never changes a causal model's logits."""
    device = next(model.parameters()).device
    width = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    attn = torch.zeros(len(prompts), width, dtype=torch.long)
    rows, cols, slots, targets = [], [], [], []
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        attn[i, : len(p) + len(c)] = 1
        rows += [i] * len(c)
        cols += range(len(p) - 1, len(p) - 1 + len(c))  # the position whose logits predict completion token t
        slots += range(len(c))
        targets += c
    r, c = torch.tensor(rows, device=device), torch.tensor(cols, device=device)
    return logits_at(model, ids.to(device), attn.to(device), r, c).float(), rows, slots, targets


def logits_at(
    model: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor
) -> torch.Tensor:
    """The output head's logits at (rows, cols) only. A ``LogitsAt`` wrapper runs it as its own forward."""
    if isinstance(model, LogitsAt):
        return model(ids, attn, rows, cols)
    hidden = model.base_model(input_ids=ids, attention_mask=attn).last_hidden_state
    return model.get_output_embeddings()(hidden[rows, cols])


class LogitsAt(torch.nn.Module):
    """A causal LM whose ``forward`` is ``logits_at``: sharded (FSDP2), the root's parameters (embeddings, final norm,
    output head) are gathered around a module's ``forward`` only, and the logits must not come from the HF forward,
    which computes them at every position."""

    def __init__(self, lm: PreTrainedModel) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor, attn: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        return logits_at(self.lm, ids, attn, rows, cols)


def token_logprobs(
    model: PreTrainedModel,
    prompts: list[list[int]],
    completions: list[list[int]],
    temperature: float | list[float] = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of each completion token under ``model`` at ``temperature``: ([B, Lmax], mask [B, Lmax]), on the
    model's device. One forward pass: call it per micro-batch."""
    logits, rows, slots, targets = completion_logits(model, prompts, completions)
    device = logits.device
    temperatures = temperature if isinstance(temperature, list) else [temperature] * len(prompts)
    temps = torch.tensor([temperatures[r] for r in rows], device=device)
    lp = torch.log_softmax(logits / temps[:, None], dim=-1).gather(-1, torch.tensor(targets, device=device)[:, None])
    out = torch.zeros(len(prompts), max(len(c) for c in completions), device=device)
    mask = torch.zeros_like(out)
    r, s = torch.tensor(rows, device=device), torch.tensor(slots, device=device)
    out = out.index_put((r, s), lp.squeeze(-1))
    mask[r, s] = 1.0
    return out, mask


def rank_micro_batches(lengths: list[int], world: int, token_budget: int) -> list[list[list[int]]]:
    """Each rank's micro-batches (row indices) for one data-parallel pass: rows dealt longest first, round robin (so
    every rank gets about the same tokens), each rank's cut by ``micro_batches``; every rank gets the same number of
    micro-batches, padded with empty ones (a rank with none left still runs the collectives: an idle pass)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    mine = [order[r::world] for r in range(world)]
    plans = [
        [[rows[i] for i in idx] for idx in micro_batches([lengths[i] for i in rows], token_budget)] for rows in mine
    ]
    count = max((len(p) for p in plans), default=0)
    return [p + [[] for _ in range(count - len(p))] for p in plans]
