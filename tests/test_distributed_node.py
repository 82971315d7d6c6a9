"""`swarmrl node --role trainer --nproc 2` in a loopback swarm of processes: it trains like one rank (the eval
reward rises), a killed rank stops it with that rank named, and a restart resumes from the (DCP) checkpoint with
the ledger balanced."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from node.metrics import read_jsonl
from tests.helpers import process_swarm, read_status, wait_for
from trainer.checkpoint import load_checkpoint


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


@pytest.mark.slow
def test_a_two_rank_trainer_learns_names_a_dead_rank_and_resumes(tmp_path, tiny_model_dir):
    port, _, spawn = process_swarm(tmp_path, "ranks", tiny_model_dir)
    trainer_args = (
        *("--listen", "/ip4/127.0.0.1/tcp/0", "--nproc", "2", "--max-tokens", "6", "--batch-groups", "8"),
        *("--lr", "3e-3", "--eval-every", "6", "--eval-size", "64", "--checkpoint-every", "6", "--dashboard", "off"),
    )
    procs = [spawn("bootstrap", "boot", "--listen", f"/ip4/127.0.0.1/tcp/{port}")]
    metrics, ckpt, log = (
        tmp_path / "trainer" / "metrics.jsonl",
        tmp_path / "trainer" / "trainer.ckpt",
        tmp_path / "trainer.log",
    )
    try:
        wait_for(lambda: bool(read_status(tmp_path / "boot")), 60, "the bootstrap node", procs, tmp_path / "boot.log")
        trainer = spawn("trainer", "trainer", *trainer_args)
        procs += [trainer, *(spawn("sampler", f"s{i}", "--listen", "/ip4/127.0.0.1/tcp/0") for i in range(2))]

        def evals() -> list[dict]:
            return [r for r in read_jsonl(metrics) if "eval_reward" in r] if metrics.exists() else []

        def lifted() -> bool:  # as the single-rank swarm test asks of 24 steps, here by step 12
            e = evals()
            return len(e) >= 3 and e[-1]["eval_reward"] > e[0]["eval_reward"] + 0.05 and ckpt.exists()

        wait_for(lifted, 400, "the eval reward to rise by step 12, and a checkpoint", [trainer], log, interval=1.0)
        saved = load_checkpoint(ckpt)
        assert os.path.isdir(saved["dcp"])  # the learner's state: a DCP directory the checkpoint names
        (rank1,) = children(trainer.pid)
        os.kill(rank1, signal.SIGKILL)
        assert trainer.wait(timeout=60) != 0
        assert re.search(rf"rank 1 \(pid {rank1}, killed by signal 9\)", log.read_text())
        saved = load_checkpoint(ckpt)

        t_restart = time.time()
        trainer = spawn("trainer", "trainer", *trainer_args)
        procs.append(trainer)

        def trained_after_restart() -> bool:
            later = [r for r in read_jsonl(metrics) if "reward" in r and r["time"] > t_restart]
            return any(r["step"] >= saved["step"] + 2 for r in later)

        wait_for(trained_after_restart, 240, "the restarted trainer to train", [trainer], log, interval=1.0)
        assert f"resumed from {ckpt} at step {saved['step']}, version {saved['version']}" in log.read_text()
        later = [r for r in read_jsonl(metrics) if "reward" in r and r["time"] > t_restart]
        assert later[0]["step"] == saved["step"] + 1
        after = read_status(tmp_path / "trainer")
        assert after["groups_accepted"] == (
            after["groups_trained"] + after["groups_stale"] + after["groups_no_signal"] + after["groups_buffered"]
        )
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)
