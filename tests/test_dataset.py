"""JSON-lines dataset tasks: rows become prompts by seed with a held-out split, rewards score completions, and a bad
row is a clear error naming its line."""

from __future__ import annotations

import json

import pytest

from trainer.errors import UserError
from trainer.tasks import EVAL_SEED_BASE, load_task
from trainer.tasks.dataset import exact_reward, numeric_reward


def write(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return f"jsonl:{path}"


def test_rows_prompts_and_the_held_out_split(tmp_path):
    task = load_task(write(tmp_path / "d.jsonl", [{"prompt": f"q{i}", "answer": i} for i in range(30)]))
    train = {task.prompt(s) for s in range(100)}
    held = {task.prompt(EVAL_SEED_BASE + i) for i in range(10)}
    assert held == {"q0", "q10", "q20"} and not (train & held) and len(train) == 27
    assert task.answer(EVAL_SEED_BASE + 1) == "10"  # numbers become strings
    assert task.name == "jsonl:d.jsonl"


def test_exact_and_numeric_rewards():
    assert exact_reward("  Paris. ", "paris") == 1.0 and exact_reward("Lyon", "Paris") == 0.0
    assert exact_reward("New   York", "new york") == 1.0
    assert numeric_reward("so the total is 1,234.", "1234") == 1.0
    assert numeric_reward("7 then 8", "8") == 1.0 and numeric_reward("8 then 7", "8") == 0.0
    assert numeric_reward("no number", "3") == 0.0 and numeric_reward("-2.50", "-2.5") == 1.0


def test_a_user_reward_function_plugs_in(tmp_path):
    module = tmp_path / "myreward.py"
    module.write_text("def score(completion, answer):\n    return 0.5 if answer in completion else 0.0\n")
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        task = load_task(write(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "x"}] * 3), reward="myreward:score")
        assert task.reward(1, "yxz") == 0.5 and not task.solved(1, "yxz")
    finally:
        sys.path.remove(str(tmp_path))


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"prompt": "a", "answer": 1}, "{not json"], r"d.jsonl:2: not valid JSON"),
        ([{"prompt": "a", "answer": 1}, {"prompt": "", "answer": 1}], r"d.jsonl:2: 'prompt' must be a non-empty"),
        ([{"prompt": "a", "answer": 1}, {"prompt": "b", "answer": [1]}], r"d.jsonl:2: 'answer' must be a string"),
        ([[1, 2], {"prompt": "b", "answer": 1}], r"d.jsonl:1: each line must be a JSON object"),
        ([{"prompt": "a", "answer": 1}], "at least 2 rows"),
    ],
)
def test_bad_rows_are_clear_errors_naming_the_line(tmp_path, rows, message):
    with pytest.raises(UserError, match=message):
        load_task(write(tmp_path / "d.jsonl", rows))


def test_missing_file_and_unknown_reward(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_task(f"jsonl:{tmp_path / 'nope.jsonl'}")
    with pytest.raises(UserError, match="unknown reward"):
        load_task(write(tmp_path / "d.jsonl", [{"prompt": "a", "answer": 1}] * 2), reward="fuzzy")
