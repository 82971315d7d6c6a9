"""bench/journal: what durable acks cost. The rollout intake (real verification, journal and buffer; a scoring
function that returns at once, so the journal is what is measured) takes groups from concurrent submitters for a
few seconds, with ``durable_acks`` off (records flushed to the OS: they survive a killed process) and on (group
commit: fsync before the ack: they survive a lost machine). Prints accepted groups per second for both, the ratio,
and fsyncs per accepted group.

    .venv/bin/python bench/journal.py [--seconds 5] [--submitters 32]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from tempfile import TemporaryDirectory

import trio

from node.intake import RolloutIntake
from node.settings import TrainerSettings
from protocols.draw import RULE, TokenDraw
from protocols.rollouts import RolloutGroup, Sample
from protocols.work import WorkRequest
from trainer.tasks.reverse import ReverseDigitsTask
from trainer.text import completion_text

EOS, CHARS = 2, "0123456789>"


def encode(text: str) -> list[int]:
    return [1] + [10 + CHARS.index(c) for c in text]


def score(version, prompts, completions, temperature, top_p):
    return [[TokenDraw(-1.0, 0.0, 1.0) for _ in c] for c in completions]


async def run(root: Path, durable: bool, seconds: float, submitters: int) -> tuple[float, int, int]:
    settings = TrainerSettings(
        group_size=8,
        max_tokens=8,
        durable_acks=durable,
        rollout_rate=1e9,
        rollout_burst=1e9,
        work_rate=1e9,
        work_burst=1e9,
        groups_per_lease=64,
        max_buffered=1 << 30,
    )
    intake = RolloutIntake(
        ReverseDigitsTask(),
        encode,
        lambda ids: completion_text(ids, (EOS,), lambda x: "1"),
        (EOS,),
        score,
        root / "journal",
        settings,
    )
    intake.start(None)
    accepted = 0
    deadline = trio.current_time() + seconds

    async def submitter(k: int) -> None:
        nonlocal accepted
        while trio.current_time() < deadline:
            peer = f"peer{k}"
            lease = intake.lease(WorkRequest(64), peer, 0)
            for spec in lease.tasks:
                samples = [
                    Sample(f"{lease.lease_id}/{spec.seed}/{j}", [10 + j, EOS], [-1.0, -1.0], "stop") for j in range(8)
                ]
                g = RolloutGroup(
                    f"{lease.lease_id}/{spec.seed}",
                    lease.lease_id,
                    spec.task_id,
                    spec.seed,
                    0,
                    peer,
                    spec.prompt_ids,
                    1.0,
                    1.0,
                    "none",
                    samples,
                    RULE,
                )
                ack = await intake.submit(g.to_wire(), peer, 0)
                accepted += bool(ack.accepted)
                if trio.current_time() >= deadline:
                    return

    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for k in range(submitters):
            nursery.start_soon(submitter, k)
    return accepted / (time.perf_counter() - t0), accepted, intake.journal.fsyncs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--submitters", type=int, default=32)
    args = ap.parse_args()
    with TemporaryDirectory(dir=Path.cwd()) as tmp:  # the working directory's disk, not a tmpfs
        flushed = trio.run(run, Path(tmp) / "flush", False, args.seconds, args.submitters)
        durable = trio.run(run, Path(tmp) / "fsync", True, args.seconds, args.submitters)
    print(f"flush only : {flushed[0]:8.0f} groups/s ({flushed[1]} accepted)")
    print(
        f"fsync+group: {durable[0]:8.0f} groups/s ({durable[1]} accepted, {durable[2]} fsyncs, "
        f"{durable[2] / max(durable[1], 1):.3f} per group)"
    )
    print(f"durable / flush-only throughput: {durable[0] / flushed[0]:.2f}")


if __name__ == "__main__":
    main()
