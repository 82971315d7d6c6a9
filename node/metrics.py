"""Metrics as JSON lines, and the reward/accuracy curve as a PNG."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line cut by a crash
    return out


def plot_curve(records: list[dict[str, Any]], png: Path, title: str = "swarmrl: task reward") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if "reward" in r]
    evals = [r for r in records if "eval_reward" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot([r["step"] for r in train], [r["reward"] for r in train], alpha=0.5, label="rollout reward (train)")
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_reward"] for r in evals], "o-", label="eval reward (greedy)")
        ax.plot([r["step"] for r in evals], [r["eval_accuracy"] for r in evals], "s--", label="eval exact accuracy")
    ax.set(xlabel="trainer step", ylabel="reward / accuracy", ylim=(0, 1.02), title=title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
