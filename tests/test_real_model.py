"""A real local checkpoint end to end: a Llama with its own byte-level BPE tokenizer and chat template, a JSON-lines
dataset task, bf16 mixed precision on the trainer, an MLX int8 sampler; every group verified, steps taken, the
published versions open in stock transformers and mlx-lm."""

from __future__ import annotations

import json
import shutil

import pytest
import trio

from tests.helpers import build_llama_bpe, start_bootstrap, start_sampler, start_trainer, wait_until
from trainer.errors import UserError
from trainer.model import load_tokenizer
from trainer.model_dir import inspect_model_dir


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return build_llama_bpe(tmp_path_factory.mktemp("llama") / "model")


def write_dataset(path):
    with open(path, "w") as fh:
        for a in range(30):
            for b in range(0, 30, 7):
                fh.write(json.dumps({"prompt": f"What is {a} plus {b}?", "answer": a + b}) + "\n")
    return path


@pytest.mark.slow
async def test_llama_bpe_chat_dataset_bf16_trainer_mlx_int8_sampler(tmp_path, llama_dir):
    data = write_dataset(tmp_path / "sums.jsonl")
    async with trio.open_nursery() as nursery:
        boot = await start_bootstrap(nursery, tmp_path)
        trainer = await start_trainer(
            nursery,
            tmp_path,
            boot,
            llama_dir,
            task=f"jsonl:{data}",
            reward="numeric",
            chat_template=True,
            dtype="bf16",
            device="cpu",
            group_size=4,
            batch_groups=4,
            max_tokens=8,
            max_steps=3,
            eval_every=3,
            eval_size=8,
            linger=30.0,
            micro_batch_tokens=64,
        )
        sampler = await start_sampler(nursery, tmp_path, "s0", boot, engine="mlx", bits="8")
        role = trainer.role
        await wait_until(lambda: role.finished.is_set(), 300, what="3 training steps on the Llama")
        ledger = role.intake.ledger
        assert role.learner.steps == 3 and ledger.groups_trained >= 12
        # every group the int8 sampler sent passed the logprob check against the trainer's bf16 version
        assert role.intake.forged == 0 and ledger.rollouts_accepted > 0
        await wait_until(lambda: sampler.role.versions.engine >= 1, 60, what="the sampler to swap to a new version")
        version_dir = sampler.role.store.versions_dir / f"v{sampler.role.versions.engine}"
        config = json.loads((version_dir / "config.json").read_text())
        assert config["dtype"] == "bfloat16" and config["model_type"] == "llama"
        nursery.cancel_scope.cancel()

    import mlx_lm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.model import LOAD_LOCK

    with LOAD_LOCK:
        AutoModelForCausalLM.from_pretrained(version_dir)
    assert AutoTokenizer.from_pretrained(version_dir).chat_template
    mlx_lm.load(str(version_dir))


@pytest.mark.slow
async def test_honest_mac_samplers_are_never_struck_on_a_trained_model(tmp_path, realistic_model_dir):
    """Issue 24: on a trained (peaked) model an honest MLX int8 sampler computing in bf16, as a Mac does on a bf16
    version, was banned as a forger. Here the trainer publishes bf16 and scores in fp32 (the tight path); MLX int8
    samplers compute in bf16 and in fp16, beside a torch fp32 one: every group they send is accepted, no strike."""
    from trainer.realistic_model import DATASET

    async with trio.open_nursery() as nursery:
        boot = await start_bootstrap(nursery, tmp_path)
        trainer = await start_trainer(
            nursery,
            tmp_path,
            boot,
            realistic_model_dir,
            task=f"jsonl:{realistic_model_dir / DATASET}",
            reward="numeric",
            chat_template=True,
            publish_dtype="bf16",
            device="cpu",
            group_size=8,
            batch_groups=4,
            max_tokens=16,
            max_steps=4,
            eval_every=100,
            eval_size=8,
            linger=30.0,
        )
        samplers = [
            await start_sampler(nursery, tmp_path, "mac-bf16", boot, engine="mlx", bits="8", compute="auto"),
            await start_sampler(nursery, tmp_path, "mac-fp16", boot, engine="mlx", bits="8", compute="fp16"),
            await start_sampler(nursery, tmp_path, "linux", boot, engine="torch", bits="none"),
        ]
        role = trainer.role
        await wait_until(lambda: role.finished.is_set(), 600, what="4 training steps on the trained Llama")
        intake = role.intake
        assert intake.forged == 0 and not intake.strikes.counts, intake.verifier.last_limits
        modes = {str(m) for m in intake.verifier.modes.values()}
        assert {"mlx/bf16/q8", "mlx/fp16/q8", "torch/fp32/none"} <= modes, modes
        for s in samplers:
            status = s.role.status()
            assert status["strikes"] == 0 and status["rollouts_accepted"] > 0, (s.role.mode(), status["last_error"])
        nursery.cancel_scope.cancel()


def test_a_model_dir_without_tokenizer_files_says_so(tmp_path, llama_dir):
    """Issue 24: transformers said "You need to have sentencepiece or tiktoken installed" (a Qwen2 silently got a
    one-token tokenizer); the error names the directory and the files it lacks."""
    bare = tmp_path / "bare"
    shutil.copytree(llama_dir, bare, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens_map.json"))
    for check in (inspect_model_dir, load_tokenizer):
        with pytest.raises(UserError, match=rf"{bare} has no tokenizer files \(tokenizer\.json, or tokenizer\.model"):
            check(bare)
    (bare / "tokenizer.model").write_bytes(b"a sentencepiece model")
    for check in (inspect_model_dir, load_tokenizer):
        with pytest.raises(UserError, match=rf"{bare} has no tokenizer\.json, only tokenizer\.model"):
            check(bare)
    shutil.copy(llama_dir / "tokenizer.json", bare / "tokenizer.json")
    assert inspect_model_dir(bare).model_type == "llama" and len(load_tokenizer(bare)) > 100
