"""The tests' own waiting rule (tests/helpers.py): deadlines stretch by the slowdown, and a timeout names what is
missing in one line and leaves the full state in a file."""

from __future__ import annotations

import json
import re

import pytest
import trio

from tests import helpers
from tests.helpers import below, leaf_exceptions, slowdown, wait_for, wait_until


def test_the_slowdown_is_pinned_by_the_environment_and_never_below_one(monkeypatch):
    monkeypatch.setenv("SWARMRL_TEST_SLOWDOWN", "2.5")
    assert slowdown() == 2.5
    monkeypatch.setenv("SWARMRL_TEST_SLOWDOWN", "0.2")
    assert slowdown() == 1.0
    monkeypatch.delenv("SWARMRL_TEST_SLOWDOWN")
    assert 1.0 <= slowdown() <= 4.0


async def test_a_deadline_stretches_by_the_slowdown(autojump_clock, monkeypatch):
    monkeypatch.setenv("SWARMRL_TEST_SLOWDOWN", "3")
    start = trio.current_time()
    with pytest.raises(TimeoutError, match=r"timed out after 30 s \(10 s x slowdown 3\.0\) waiting for x"):
        await wait_until(lambda: False, 10, 0.5, what="x")
    assert 30 <= trio.current_time() - start <= 30.5
    ticks = iter(range(100))
    await wait_until(lambda: next(ticks) >= 50, 10, 0.5)  # 25 s: past the 10 s it was given, within 30
    assert trio.current_time() - start >= 30 + 24


def test_a_timeout_names_what_is_missing_and_writes_the_state_to_a_file(monkeypatch, tmp_path):
    monkeypatch.setenv("SWARMRL_TEST_SLOWDOWN", "1")
    monkeypatch.setattr(helpers, "FAILURES", tmp_path / "test-failures")
    state = {f"s{i}": {"weights_version": i - 2, "log": "x" * 5000} for i in range(6)}
    with pytest.raises(AssertionError) as caught:
        wait_for(
            lambda: below({n: s["weights_version"] for n, s in state.items()}, 0, "weights_version"),
            0.05,
            "every sampler's first version",
            interval=0.01,
            state=lambda: state,
        )
    message = str(caught.value)
    assert "\n" not in message and len(message) < 500
    assert "waiting for every sampler's first version: s0 weights_version -2 < 0; s1 weights_version -1 < 0" in message
    path = re.search(r"full state: (\S+\.json)\)", message).group(1)
    assert path.startswith(str(tmp_path / "test-failures" / "test_helpers.py__test_a_timeout_names"))
    assert json.loads(open(path).read()) == state


def test_a_check_holds_on_true_or_nothing_missing():
    wait_for(lambda: True, 1, "true")
    wait_for(lambda: below({"a": 3}, 3), 1, "a at 3")
    assert below({"a": 2, "b": 5}, 3, "k") == ["a k 2 < 3"]


def test_leaf_exceptions_finds_what_nested_groups_hide():
    inner, other = AssertionError("the check that failed"), ValueError("another")
    group = ExceptionGroup("host", [ExceptionGroup("host", [ExceptionGroup("host", [inner])]), other])
    assert list(leaf_exceptions(group)) == [inner, other]
    assert list(leaf_exceptions(inner)) == [inner]
