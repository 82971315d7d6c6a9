"""Everything tests share (no test module imports another): in-process swarms (from node.local_swarm), swarms
of `swarmrl node` processes, the CLI, a stream that delivers bytes in small pieces, and waiting for conditions
with deadlines that stretch on a loaded machine."""

from __future__ import annotations

import functools
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import trio

from node.config import write_config_file
from node.identity import load_or_create_key, peer_id_of
from node.intake import RolloutIntake
from node.local_swarm import (
    LOOPBACK,
    Running,
    node_config,
    settings,
    start,
    start_bootstrap,
    start_sampler,
    start_trainer,
    trainer_peer_id,
)
from node.rpc import request
from node.settings import TrainerSettings
from node.status import read_status as _read_status
from protocols import work
from protocols.draw import RULE, TokenDraw
from protocols.rollouts import RolloutGroup, Sample
from protocols.work import WorkLease, WorkRequest
from trainer.tasks.reverse import ReverseDigitsTask
from trainer.text import completion_text

__all__ = [
    "CLI",
    "LOOPBACK",
    "FakeStream",
    "Running",
    "below",
    "build_llama_bpe",
    "free_port",
    "node_config",
    "process_swarm",
    "publish_model",
    "read_status",
    "run_cli",
    "settings",
    "slowdown",
    "start",
    "start_bootstrap",
    "start_sampler",
    "start_trainer",
    "trainer_peer_id",
    "wait_for",
    "wait_until",
    "write_failure",
]

CLI = [sys.executable, "-P", "-m", "node.cli"]  # -P: data dirs in the cwd must not shadow packages


def run_cli(*args: str, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    """``swarmrl *args`` to completion, within ``timeout`` idle-machine seconds (stretched by ``slowdown()``)."""
    return subprocess.run([*CLI, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout * slowdown())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_status(data_dir: Path) -> dict:
    """A node's status.json, or {} while it has not written one (or is mid-write)."""
    try:
        return _read_status(data_dir)
    except (OSError, ValueError):
        return {}


SLOWDOWN_ENV = "SWARMRL_TEST_SLOWDOWN"
FAILURES = Path(__file__).resolve().parents[1] / "runs" / "test-failures"
# a test's own processes load the box too (a WAN swarm alone keeps ~3 of 2 cores busy): deadlines start to
# stretch only beyond this many runnable tasks per core, and never past MAX_SLOWDOWN
OWN_LOAD = 1.5
MAX_SLOWDOWN = 4.0


@functools.cache
def _session_slowdown() -> float:
    """The load measured once, at the session's first wait."""
    return _load_factor()


def _load_factor() -> float:
    """How far the 1-minute load average exceeds what the tests themselves put on the box, per core."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(MAX_SLOWDOWN, max(1.0, os.getloadavg()[0] / (OWN_LOAD * cores)))


def slowdown() -> float:
    """How many times longer than on an idle machine a wait may take: SWARMRL_TEST_SLOWDOWN if set, else the load
    measured at the session's start, or the load now if that is higher (other jobs may arrive mid-suite)."""
    if os.environ.get(SLOWDOWN_ENV):
        return max(1.0, float(os.environ[SLOWDOWN_ENV]))
    return max(_session_slowdown(), _load_factor())


def _test_name() -> str:
    current = os.environ.get("PYTEST_CURRENT_TEST", "unknown").split(" ")[0]
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", current.replace("tests/", "").replace("::", "__"))[:150]


def write_failure(state: object, name: str | None = None) -> Path:
    """Write the full state a test saw when it failed to runs/test-failures/<test>.json (kept after tmp_path is
    cleaned up); the failure message names the file instead of carrying the state."""
    FAILURES.mkdir(parents=True, exist_ok=True)
    path = FAILURES / f"{name or _test_name()}.json"
    path.write_text(json.dumps(state, indent=1, default=str, sort_keys=True))
    return path


Check = Callable[[], "bool | list[str]"]


def leaf_exceptions(exc: BaseException) -> Iterator[BaseException]:
    """The exceptions inside an exception group, however deeply nested (itself if it is none)."""
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from leaf_exceptions(inner)
    else:
        yield exc


def _done(result: bool | list[str]) -> bool:
    """A check holds when it returns True, or an empty list of what is still missing."""
    return result is True or (isinstance(result, list) and not result)


def _timeout_message(timeout: float, factor: float, what: str, result: object, state: Callable[[], object] | None):
    missing = "; ".join(result[:4]) + (f"; +{len(result) - 4} more" if len(result) > 4 else "") if result else ""
    line = f"timed out after {timeout * factor:.0f} s ({timeout:.0f} s x slowdown {factor:.1f}) waiting for {what}"
    line += f": {missing}" if missing else ""
    if state is not None:
        line += f" (full state: {write_failure(state())})"
    return line


def accepts(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something listens on ``host:port`` (a node process that has started its host)."""
    try:
        socket.create_connection((host, port), timeout=1).close()
        return True
    except OSError:
        return False


def wait_for(
    predicate: Check,
    timeout: float,
    what: str,
    procs: list[subprocess.Popen] | None = None,
    log: Path | None = None,
    interval: float = 0.5,
    state: Callable[[], object] | None = None,
) -> None:
    """Wait (blocking) for ``predicate`` over node processes, at most ``timeout`` idle-machine seconds (stretched
    by ``slowdown()``). The predicate returns a bool, or a list of what is still missing ("s3 weights_version -1 <
    0"): the failure message is one line naming it, and ``state()`` (every node's status, say) goes to a file
    whose path it gives. Fails early with the log's tail if a process dies first."""
    factor = slowdown()
    deadline = time.monotonic() + timeout * factor
    while not _done(result := predicate()):
        dead = [p for p in procs or [] if p.poll() is not None]
        if dead:
            tail = log.read_text()[-2000:] if log and log.exists() else ""
            raise AssertionError(f"a node exited with code {dead[0].returncode} while waiting for {what}\n{tail}")
        if time.monotonic() > deadline:
            raise AssertionError(_timeout_message(timeout, factor, what, result, state))
        time.sleep(interval)


async def wait_until(
    predicate: Check,
    timeout: float,
    interval: float = 0.2,
    what: str = "condition",
    state: Callable[[], object] | None = None,
) -> None:
    """``wait_for`` for in-process swarms: poll state owned by other tasks on the trio loop."""
    factor = slowdown()
    deadline = trio.current_time() + timeout * factor
    while not _done(result := predicate()):
        if trio.current_time() > deadline:
            raise TimeoutError(_timeout_message(timeout, factor, what, result, state))
        await trio.sleep(interval)


def below(values: dict[str, object], want: object, key: str = "") -> list[str]:
    """What is still missing in a "every x reached want" check: "name key got < want" for each short one."""
    label = f" {key}" if key else ""
    return [f"{n}{label} {v} < {want}" for n, v in values.items() if not v >= want]  # type: ignore[operator]


def process_swarm(tmp_path: Path, swarm: str, model_dir: Path):
    """Keys and a bootstrap.toml for a swarm of `swarmrl node` processes on loopback, and a function that starts
    one (logs appended to <tmp_path>/<name>.log). Returns (bootstrap port, trainer peer id, spawn)."""
    port = free_port()
    boot_id = peer_id_of(load_or_create_key(tmp_path / "boot" / "identity.key"))
    trainer_id = peer_id_of(load_or_create_key(tmp_path / "trainer" / "identity.key"))
    cfg = tmp_path / "bootstrap.toml"
    write_config_file(cfg, swarm, [f"/ip4/127.0.0.1/tcp/{port}/p2p/{boot_id}"], str(trainer_id))
    common = ["--config", str(cfg), "--provide-interval", "2", "--status-interval", "0.5"]

    def spawn(role: str, name: str, *extra: str) -> subprocess.Popen:
        model = ["--model", str(model_dir)] if role == "trainer" else []  # another role's flag is an error
        return subprocess.Popen(
            [*CLI, "node", "--role", role, "--data-dir", str(tmp_path / name), *common, *model, *extra],
            cwd=tmp_path,
            stdout=open(tmp_path / f"{name}.log", "a"),
            stderr=subprocess.STDOUT,
        )

    return port, trainer_id, spawn


class FakeStream:
    """Bytes delivered in small pieces, like py-libp2p's read(); raises StreamEOF at the end."""

    def __init__(self, data: bytes, piece: int = 7) -> None:
        self.data, self.piece = data, piece

    async def read(self, n=None):
        from libp2p.network.stream.exceptions import StreamEOF

        if not self.data:
            raise StreamEOF()
        out, self.data = self.data[: min(n, self.piece)], self.data[min(n, self.piece) :]
        return out

    async def write(self, data):  # pragma: no cover - not used
        pass


def publish_model(publisher, model, version: int, tokenizer_source: Path):
    """Publish a torch model as ``version`` the way the trainer role does: model dir, then cut and sign."""
    from trainer.model import save_model_dir

    staging = save_model_dir(model, publisher.staging_dir(version), tokenizer_source)
    return publisher.publish(staging, version)


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def build_llama_bpe(out_dir: Path, seed: int = 0, hidden: int = 64, layers: int = 2) -> Path:
    """A small Llama with its own byte-level BPE tokenizer (trained here by `tokenizers`) and a chat template:
    what a real local checkpoint looks like, built deterministically without any download."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from trainer.model_dir import flatten_rope_theta

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    specials = ["<|pad|>", "<|begin|>", "<|end|>", "<|user|>", "<|assistant|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [f"What is {a} plus {b}? The answer is {a + b}." for a in range(40) for b in range(0, 40, 3)]
    corpus += ["Reverse the digits 12345: 54321.", "Say hello to the swarm."] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin|>", eos_token="<|end|>", pad_token="<|pad|>"
    )
    fast.chat_template = "<|begin|>" + CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    ids = {t: fast.convert_tokens_to_ids(t) for t in specials}
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=ids["<|begin|>"],
        eos_token_id=ids["<|end|>"],
        pad_token_id=ids["<|pad|>"],
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(out_dir)
    flatten_rope_theta(out_dir)
    return out_dir


# -- the trainer over the wire (tests/conftest.py: trainer_and_client) ------------------------------------
async def get_lease(client, trainer) -> WorkLease:
    reply = await request(
        client.host,
        trainer.swarm.peer_id,
        work.PROTOCOL_ID,
        WorkRequest(2).to_wire(),
        max_request=work.MAX_REQUEST_FRAME,
        max_reply=work.MAX_FRAME,
    )
    return WorkLease.from_wire(reply)


# -- an intake without torch or a network (test_intake, test_leases_hostile) --------------------------------
EOS = 2
CHARS = "0123456789>"


def encode(text: str) -> list[int]:
    return [1] + [10 + CHARS.index(c) for c in text]


def decode(ids: list[int]) -> str:
    return "".join(CHARS[i - 10] for i in ids)


def score(version, prompts, completions, temperature, top_p):
    """Stands in for the learner: every token has logprob -1 at every kept version, and any draw picks it."""
    return [[TokenDraw(-1.0, 0.0, 1.0) for _ in c] for c in completions]


def make_intake(tmp_path, saved: dict | None = None, **kw) -> RolloutIntake:
    """An intake journaling under ``tmp_path``, started fresh or from a checkpoint's ``saved`` state."""
    settings = TrainerSettings(group_size=2, max_tokens=8, max_staleness=2, **kw)
    intake = RolloutIntake(
        ReverseDigitsTask(),
        encode,
        lambda ids: completion_text(ids, (EOS,), decode),
        (EOS,),
        score,
        tmp_path / "journal",
        settings,
    )
    intake.start(saved)
    return intake


def group_for(intake: RolloutIntake, peer: str, spec, lease, answers: list[str], version: int = 0) -> dict:
    samples = [
        Sample(f"{lease.lease_id}/{spec.seed}/{k}", [*encode(a)[1:], EOS], [-1.0] * (len(a) + 1), "stop")
        for k, a in enumerate(answers)
    ]
    return RolloutGroup(
        f"{lease.lease_id}/{spec.seed}",
        lease.lease_id,
        spec.task_id,
        spec.seed,
        version,
        peer,
        spec.prompt_ids,
        1.0,
        1.0,
        "none",
        samples,
        RULE,
    ).to_wire()


async def rejoin(client, server) -> None:
    """Connect ``client`` (a Swarm) to ``server`` (a Swarm) again once the server has hung up on it: a peer that
    announces a frame over its protocol's limit loses its connection (node/connmgr.py, oversized frames)."""
    from libp2p.peer.peerinfo import info_from_p2p_addr

    peer = server.peer_id
    await wait_until(lambda: not client.host.get_network().get_connections(peer), 10, what="the server to hang up")
    await client.connect(info_from_p2p_addr(server.addrs()[0]))
