"""The rollout journal: what was acknowledged survives a crash at any point around a checkpoint."""

from __future__ import annotations

from node.intake.journal import RolloutJournal
from trainer.groups import Group


def group(i: int) -> Group:
    return Group(
        f"g{i}", "peer", 1, "reverse", i, [1, 2], [[3, 4]], [[-0.5, -0.25]], [[-0.5, -0.3]], [0.5], [False], 1.0
    )


def ids(i: int) -> list[str]:
    return [f"g{i}/0"]


def test_replay_restores_the_checkpoint_snapshot_and_everything_accepted_after(tmp_path):
    j = RolloutJournal(tmp_path)
    j.start_segment(0, [])
    buffered = []
    for i in range(5):
        j.append(group(i), ids(i))
        buffered.append((group(i), ids(i)))
    buffered = buffered[2:]  # g0, g1 trained
    j.start_segment(1, buffered)  # checkpoint 1: g2..g4 buffered
    for i in range(5, 8):
        j.append(group(i), ids(i))
        buffered.append((group(i), ids(i)))
    j.start_segment(2, buffered)  # a checkpoint that never finished saving...
    j.append(group(8), ids(8))
    j.close()

    snapshot, new = RolloutJournal(tmp_path).replay(1)  # ...so the trainer restarts from checkpoint 1
    assert [g.group_id for g, _ in snapshot] == ["g2", "g3", "g4"]
    assert [g.group_id for g, _ in new] == ["g5", "g6", "g7", "g8"]
    assert snapshot[0][0] == group(2) and snapshot[0][1] == ids(2)
    snapshot, new = RolloutJournal(tmp_path).replay(2)
    assert [g.group_id for g, _ in snapshot] == [f"g{i}" for i in range(2, 8)]
    assert [g.group_id for g, _ in new] == ["g8"]


def test_a_torn_last_record_is_ignored_and_old_segments_are_dropped(tmp_path):
    j = RolloutJournal(tmp_path)
    j.start_segment(3, [(group(0), ids(0))])
    j.append(group(1), ids(1))
    j.append(group(2), ids(2))
    j.close()
    path = next(tmp_path.glob("journal-*.bin"))
    path.write_bytes(path.read_bytes()[:-7])  # the process died mid-write
    snapshot, new = RolloutJournal(tmp_path).replay(3)
    assert [g.group_id for g, _ in snapshot] == ["g0"] and [g.group_id for g, _ in new] == ["g1"]
    j = RolloutJournal(tmp_path)
    assert j.last_epoch() == 3
    j.start_segment(4, [])
    j.drop_before(4)
    assert [p.name for p in tmp_path.glob("journal-*.bin")] == ["journal-00000004.bin"]
