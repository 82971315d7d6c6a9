"""The lockstep baseline: sample a batch with the current weights, train one step, swap the weights, repeat.

No network and no staleness: what bench/async_vs_lockstep compares the swarm against, and a quick way to tune
hyperparameters on one machine. It uses the same learner and the same engines as the swarm.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from node.engines import Engine
from node.settings import TrainerSettings
from trainer.groups import Group, has_signal
from trainer.learner import Learner
from trainer.settings import LearnerSettings
from trainer.tasks import load_task


def run_lockstep(
    model_dir: Path,
    trainer: TrainerSettings,
    learner_settings: LearnerSettings,
    steps: int,
    make_engine: Callable[[Path, int], Engine],
    work_dir: Path,
    on_step: Callable[[dict], None] | None = None,
) -> list[dict]:
    task = load_task(trainer.task, trainer.reward)
    learner = Learner(model_dir, learner_settings, keep_versions=1, work_dir=work_dir)
    codec = learner.codec
    engine = make_engine(model_dir, 0)
    records = [{"step": 0, "time": 0.0, "rollouts": 0, **learner.evaluate(task, trainer.eval_size, trainer.max_tokens)}]
    seed, rollouts, t0 = 0, 0, time.monotonic()
    for step in range(1, steps + 1):
        groups: list[Group] = []
        attempts = 0
        while len(groups) < trainer.batch_groups:
            attempts += 1
            if attempts > 50 * trainer.batch_groups:
                raise RuntimeError("the policy collapsed: no group with reward variance in many tries")
            seed += 1
            prompt = codec.encode_prompt(task.prompt(seed))
            gens = engine.generate(
                [prompt] * trainer.group_size,
                temperature=trainer.temperature,
                top_p=trainer.top_p,
                max_tokens=trainer.max_tokens,
                seed=seed,
            )
            rollouts += len(gens)
            texts = [codec.completion_text(g.completion_ids) for g in gens]
            rewards = [task.reward(seed, t) for t in texts]
            if not has_signal(rewards):
                continue
            comps = [g.completion_ids for g in gens]
            old = learner.logprobs(learner.version, [prompt] * len(comps), comps, trainer.temperature)
            assert old is not None  # the current version is always kept
            groups.append(
                Group(
                    str(seed),
                    "local",
                    learner.version,
                    task.name,
                    seed,
                    prompt,
                    comps,
                    [g.logprobs for g in gens],
                    old,
                    rewards,
                    [task.solved(seed, t) for t in texts],
                    trainer.temperature,
                )
            )
        metrics = learner.step(groups)
        learner.new_version()
        engine.swap(learner.save_model_dir(work_dir / "model"), learner.version)
        record = {"step": step, "time": time.monotonic() - t0, "rollouts": rollouts, **metrics}
        if step % trainer.eval_every == 0 or step == steps:
            record.update(learner.evaluate(task, trainer.eval_size, trainer.max_tokens))
        records.append(record)
        if on_step:
            on_step(record)
    return records
