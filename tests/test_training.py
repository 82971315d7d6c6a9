"""The trainer end to end: a short swarm run learns, and a killed trainer resumes where it left off."""

from __future__ import annotations

import signal
import time

import pytest
import trio

from node.metrics import read_jsonl
from tests.helpers import (
    process_swarm,
    read_status,
    start_bootstrap,
    start_sampler,
    start_trainer,
    wait_for,
    wait_until,
)
from trainer.checkpoint import load_checkpoint


@pytest.mark.slow
async def test_short_swarm_run_beats_the_untrained_model(tmp_path, tiny_model_dir):
    async with trio.open_nursery() as nursery:
        boot = await start_bootstrap(nursery, tmp_path)
        trainer = await start_trainer(
            nursery,
            tmp_path,
            boot,
            tiny_model_dir,
            max_tokens=6,
            batch_groups=8,
            max_steps=24,
            lr=3e-3,  # the random-init tiny model (the embedded base model is pretrained and wants 3e-4)
            eval_every=8,
            eval_size=64,
            linger=0.0,
        )
        # publishing is made slower than training, whatever a step costs on this box (a fixed delay was not,
        # under a loaded suite): each publish waits for two more steps. Training must not wait for it.
        publish = trainer.role.outbox.publisher.publish
        publish_seconds: list[float] = []

        def slow_publish(*args):
            learner, started = trainer.role.learner, time.monotonic()
            steps = learner.steps
            while learner.steps < steps + 2 and time.monotonic() < started + 2.0:
                time.sleep(0.02)  # the slowness under test (in the publisher's thread), not a wait in the test
            out = publish(*args)
            publish_seconds.append(time.monotonic() - started)
            return out

        trainer.role.outbox.publisher.publish = slow_publish
        for i in range(2):
            await start_sampler(nursery, tmp_path, f"s{i}", boot)
        await wait_until(lambda: trainer.role.finished.is_set(), 400, 0.5, what="24 training steps")
        nursery.cancel_scope.cancel()
    records = read_jsonl(tmp_path / "trainer" / "metrics.jsonl")
    evals = [r for r in records if "eval_reward" in r]
    train = [r for r in records if "reward" in r]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 24
    assert evals[-1]["eval_reward"] > evals[0]["eval_reward"] + 0.05
    first, last = train[:6], train[-6:]
    assert sum(r["reward"] for r in last) / 6 > sum(r["reward"] for r in first) / 6
    # the loop never waited for the slow publisher: versions coalesced instead (one in flight at a time). A loop
    # that waited would spend a whole publish (two of its own steps, or 2 s) in it; measured in this run, so a
    # slower machine stretches both sides
    waited = [round(r["time_publish"], 3) for r in train]
    assert max(waited) < min(publish_seconds), (waited, [round(t, 3) for t in publish_seconds])
    published = [r["published"] for r in records if "published" in r]
    assert published == sorted(set(published)) and len(published) >= 3
    assert records[-1].get("finished") and records[-1]["version"] == published[-1]  # the run's end, published
    status = trainer.role.status()
    assert status["finished"] and status["version"] == published[-1] and status["step"] == 24
    # every trained rollout was scored once at its version first (verification scores more: some go stale)
    assert sum(r["verify_tokens"] for r in train) >= sum(r["forward_tokens"] for r in train) > 0
    assert train[-1]["versions_coalesced"] > 0 and train[-1]["version"] < train[-1]["step"]
    assert max(r["staleness"] for r in train) <= 4
    assert (tmp_path / "trainer" / "reward_curve.png").stat().st_size > 1000


@pytest.mark.slow
def test_killed_trainer_resumes_and_samplers_reconnect(tmp_path, tiny_model_dir):
    port, _, spawn = process_swarm(tmp_path, "resume", tiny_model_dir)
    trainer_args = (
        "--listen",
        "/ip4/127.0.0.1/tcp/0",
        "--max-tokens",
        "6",
        "--batch-groups",
        "4",
        "--checkpoint-every",
        "4",
        "--eval-every",
        "1000",
    )
    procs = [spawn("bootstrap", "boot", "--listen", f"/ip4/127.0.0.1/tcp/{port}")]
    try:
        wait_for(lambda: bool(read_status(tmp_path / "boot")), 60, "the bootstrap node", procs, tmp_path / "boot.log")
        procs.append(spawn("sampler", "s0", "--listen", "/ip4/127.0.0.1/tcp/0"))
        trainer = spawn("trainer", "trainer", *trainer_args)
        ckpt = tmp_path / "trainer" / "trainer.ckpt"

        def acked_after_checkpoint() -> bool:
            """A checkpoint exists, and the sampler holds acks for groups accepted after it (the journal's job)."""
            if not ckpt.exists():
                return False
            saved = load_checkpoint(ckpt)
            acked = read_status(tmp_path / "s0").get("rollouts_accepted", 0)
            return saved["step"] >= 4 and acked > saved["ledger"]["rollouts_accepted"]

        wait_for(acked_after_checkpoint, 180, "acks after a checkpoint at step 4", [trainer], tmp_path / "trainer.log")
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
        killed_at = time.time()
        wait_for(lambda: read_status(tmp_path / "s0").get("updated", 0) > killed_at, 30, "s0's status after the kill")
        accepted_before = read_status(tmp_path / "s0")["rollouts_accepted"]  # acks the sampler holds
        saved = load_checkpoint(ckpt)

        t_restart = time.time()
        trainer = spawn("trainer", "trainer", *trainer_args)
        procs.append(trainer)
        # the restarted trainer's first status, before any sampler found it again: what it remembers accepting
        wait_for(
            lambda: read_status(tmp_path / "trainer").get("updated", 0) >= t_restart,
            60,
            "the restarted trainer's first status",
            [trainer],
            tmp_path / "trainer.log",
            interval=0.05,
        )
        first = read_status(tmp_path / "trainer")
        # nothing acknowledged was lost with the process: the journal put back what the checkpoint lacked
        assert first["rollouts_accepted"] >= accepted_before > saved["ledger"]["rollouts_accepted"]

        def trained_after_restart() -> bool:
            resumed = [
                r for r in read_jsonl(tmp_path / "trainer" / "metrics.jsonl") if "reward" in r and r["time"] > t_restart
            ]
            return any(r["step"] >= saved["step"] + 3 for r in resumed) and (
                read_status(tmp_path / "s0").get("rollouts_accepted", 0) > accepted_before
            )

        wait_for(
            trained_after_restart,
            180,
            "the restarted trainer to train on new rollouts",
            [trainer],
            tmp_path / "trainer.log",
            interval=1.0,
        )
        lines = read_jsonl(tmp_path / "trainer" / "metrics.jsonl")
        resumed = [r for r in lines if "reward" in r and r["time"] > t_restart]
        after = read_status(tmp_path / "trainer")
        assert after["groups_accepted"] == (
            after["groups_trained"] + after["groups_stale"] + after["groups_no_signal"] + after["groups_buffered"]
        )
        log = (tmp_path / "trainer.log").read_text()
        assert f"resumed from {ckpt} at step {saved['step']}, version {saved['version']}" in log
        # the step counter continues from the checkpoint, and no version number is ever reused
        assert resumed[0]["step"] == saved["step"] + 1
        before = [r for r in lines if "reward" in r and r["time"] <= t_restart]
        assert resumed[0]["version"] > max(r["version"] for r in before)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=20)


def test_a_restarted_trainer_skips_versions_it_named_but_never_published(tmp_path, tiny_model_dir):
    """Versions are published in the background after they are named (and their weights file written): a trainer
    killed in between had used the number, published or not. On restart it continues after the highest named."""
    from node.local_swarm import node_config, settings
    from node.roles.trainer import TrainerRole

    cfg = node_config(tmp_path, "trainer", "trainer")
    s = settings(learner={"model_dir": tiny_model_dir})
    first = TrainerRole(cfg, s)
    for _ in range(3):
        first.learner.new_version()  # named and written, never published (no swarm)
    assert first.learner.version == 3 and first.store.latest() is None
    again = TrainerRole(cfg, s)
    assert again.learner.version == 4
