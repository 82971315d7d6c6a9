"""The trainer's run log (node/runlog.py): what a restarted trainer reads back from it."""

from __future__ import annotations

from node.runlog import RunLog


def test_the_highest_version_logged_survives_the_process_and_a_cut_line(tmp_path):
    """A restarted trainer continues after every version number a dead process logged, even one it named but never
    wrote (the write follows the name off the loop): burner run e1 logged step 5 at version 5 twice."""
    path = tmp_path / "metrics.jsonl"
    assert RunLog(path).highest_version() == -1  # nothing logged yet
    log = RunLog(path)
    for step, version in ((1, 0), (2, 1), (3, 1), (4, 2)):
        log.record(step, version, {"reward": 0.5})
    with path.open("a") as f:
        f.write('{"time": 1, "step": 5, "version": 9')  # a line cut by a kill: not a record
    assert RunLog(path).highest_version() == 2
