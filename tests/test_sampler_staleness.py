"""A sampler does not spend compute on groups the trainer would refuse as stale: it waits for newer weights."""

from __future__ import annotations

import trio
import trio.testing

from node.roles.sampler import VersionWatch
from protocols.work import SamplingParams, TaskSpec, WorkLease


def lease(version: int, max_staleness: int | None, expires_in: float = 60.0) -> WorkLease:
    return WorkLease(
        "l", version, 4, SamplingParams(1.0, 1.0, 8), [TaskSpec("reverse", 1, [1])], expires_in, max_staleness
    )


def test_leases_carry_the_staleness_bound():
    assert WorkLease.from_wire(lease(3, 4).to_wire()).max_staleness == 4
    assert WorkLease.from_wire(lease(3, None).to_wire()).max_staleness is None  # older trainers: not told


def test_behind_counts_from_the_newest_version_heard_of():
    watch = VersionWatch()
    watch.installed(2)
    watch.heard_of(5)  # a lease
    watch.heard_of(9)  # an announcement
    watch.heard_of(7)  # an older lease arriving late changes nothing
    assert watch.behind() == 7
    watch.installed(9)
    assert watch.behind() == 0


async def test_waits_for_weights_when_too_far_behind():
    watch = VersionWatch()
    watch.installed(2)
    watch.heard_of(9)
    done: list[bool] = []

    async def sample() -> None:
        done.append(await watch.wait_within(4, timeout=60))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sample)
        await trio.testing.wait_all_tasks_blocked()
        assert not done  # 7 behind: waiting
        watch.installed(4)  # still 5 behind
        await trio.testing.wait_all_tasks_blocked()
        assert not done
        watch.installed(5)  # 4 behind: within the bound
    assert done == [True]


async def test_gives_up_when_the_lease_expires_while_waiting(autojump_clock):
    watch = VersionWatch()
    watch.installed(0)
    watch.heard_of(10)
    start = trio.current_time()
    assert not await watch.wait_within(4, timeout=30)
    assert trio.current_time() - start == 30
