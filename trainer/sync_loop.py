"""The synchronous baseline: sample a batch with the current weights, train one step, repeat.

No network and no staleness: what bench/async compares the swarm against, and a quick way to tune
hyperparameters on one machine.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from node.engines import Engine
from trainer.buffer import VerifiedGroup
from trainer.evaluate import evaluate
from trainer.grpo import LossConfig, has_signal
from trainer.policy import load_model, load_tokenizer, token_logprobs
from trainer.settings import TrainerSettings
from trainer.step import train_step
from trainer.tasks import load_task


def run_sync(
    model_dir: Path,
    settings: TrainerSettings,
    steps: int,
    make_engine: Callable[[Path, int], Engine],
    work_dir: Path,
    on_step: Callable[[dict], None] | None = None,
) -> list[dict]:
    torch.manual_seed(settings.seed)
    torch.set_num_threads(settings.torch_threads)
    task = load_task(settings.task)
    tok = load_tokenizer(model_dir)
    bos, eos = tok.bos_token_id, tok.eos_token_id

    def encode(text: str) -> list[int]:
        return [bos, *tok.encode(text)]

    def decode(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=False)

    model = load_model(model_dir).eval()
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, betas=(0.9, 0.99), weight_decay=0.0)
    cfg = LossConfig(settings.clip_low, settings.clip_high, settings.tis_cap, settings.kl_beta)
    engine = make_engine(model_dir, 0)
    records = [
        {
            "step": 0,
            "time": 0.0,
            "rollouts": 0,
            **evaluate(model, task, encode, decode, (eos,), settings.eval_size, settings.max_tokens),
        }
    ]
    seed, rollouts, t0 = 0, 0, time.monotonic()
    for step in range(1, steps + 1):
        groups: list[VerifiedGroup] = []
        attempts = 0
        while len(groups) < settings.batch_groups:
            attempts += 1
            if attempts > 50 * settings.batch_groups:
                raise RuntimeError("the policy collapsed: no group with reward variance in many tries")
            seed += 1
            prompt = encode(task.prompt(seed))
            gens = engine.generate(
                [prompt] * settings.group_size,
                temperature=settings.temperature,
                top_p=settings.top_p,
                max_tokens=settings.max_tokens,
                seed=seed,
            )
            rollouts += len(gens)
            texts = [decode(g.completion_ids[:-1] if g.finish_reason == "stop" else g.completion_ids) for g in gens]
            rewards = [task.reward(seed, t) for t in texts]
            if not has_signal(rewards):
                continue
            comps = [g.completion_ids for g in gens]
            with torch.no_grad():
                old, _ = token_logprobs(model, [prompt] * len(comps), comps, settings.temperature)
            groups.append(
                VerifiedGroup(
                    str(seed),
                    "local",
                    step - 1,
                    task.name,
                    seed,
                    prompt,
                    comps,
                    [g.logprobs for g in gens],
                    [old[i, : len(c)].tolist() for i, c in enumerate(comps)],
                    rewards,
                    [task.solved(seed, t) for t in texts],
                    settings.temperature,
                )
            )
        metrics = train_step(model, opt, groups, cfg, settings.grad_clip, step - 1)
        out = work_dir / f"v{step}"
        model.save_pretrained(out)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (model_dir / name).exists():
                (out / name).write_bytes((model_dir / name).read_bytes())
        engine.load_checkpoint(out, step)
        record = {"step": step, "time": time.monotonic() - t0, "rollouts": rollouts, **metrics}
        if step % settings.eval_every == 0 or step == steps:
            record.update(evaluate(model, task, encode, decode, (eos,), settings.eval_size, settings.max_tokens))
        records.append(record)
        if on_step:
            on_step(record)
    return records
