"""The capacity model of docs/capacity.md section 6 (bench/swarm_scale.py): fitted on unsaturated runs it recovers
the per-host, per-version and trainer costs that made them, and its knee is where the CPU runs out."""

from __future__ import annotations

import pytest

from bench.swarm_scale import GROUPS_PER_VERSION, Capacity, fit_capacity

TRUE = Capacity(h=0.015, c_v=0.25, t=0.002, x_1=0.25, groups_per_version=GROUPS_PER_VERSION)


def run(n: int) -> dict[str, float]:
    """What an unsaturated bench window at N measures if the model is the truth."""
    x = n * TRUE.x_1
    installs = n * x / GROUPS_PER_VERSION
    return {"n": n, "groups_per_s": x, "installs_per_s": installs,
            "sampler_cores": n * TRUE.h + installs * TRUE.c_v, "trainer_cores": n * TRUE.t}  # fmt: skip


def test_fit_recovers_the_costs_of_unsaturated_runs():
    fitted = fit_capacity([run(8), run(16), run(24)], TRUE.x_1)
    assert fitted.h == pytest.approx(TRUE.h)
    assert fitted.c_v == pytest.approx(TRUE.c_v)
    assert fitted.t == pytest.approx(TRUE.t)


def test_throughput_meets_the_offer_below_the_knee_and_falls_short_past_it():
    cores, per_proc = 2.0, 16
    knee = TRUE.saturation(cores, per_proc)
    below, above = int(knee) - 1, int(knee) + 2
    assert TRUE.throughput(below, cores, -(-below // per_proc)) == pytest.approx(below * TRUE.x_1)
    past = TRUE.throughput(above, cores, -(-above // per_proc))
    assert past < above * TRUE.x_1
    # past the knee the CPU is all used: samplers' upkeep and rebuilds plus the trainer fill the cores
    used = above * (TRUE.h + TRUE.t) + above * past / GROUPS_PER_VERSION * TRUE.c_v
    assert used == pytest.approx(cores)
    # one process of 16 hosts holds at most one core: with more per process the knee comes earlier
    assert TRUE.saturation(cores, 64) < knee


def test_task_steps_charges_each_task_its_own_cpu():
    """--profile's instrument: a task that computes is charged its CPU, one that sleeps next to nothing."""
    import time

    import trio

    from bench.swarm_scale import TaskSteps

    async def busy() -> None:
        for _ in range(5):
            end = time.thread_time() + 0.02
            while time.thread_time() < end:
                pass
            await trio.sleep(0)

    async def idle() -> None:
        for _ in range(5):
            await trio.sleep(0.01)

    steps = TaskSteps()

    async def main() -> None:
        trio.lowlevel.add_instrument(steps)  # added mid-step: that step is not counted
        async with trio.open_nursery() as nursery:
            nursery.start_soon(busy, name="busy")
            nursery.start_soon(idle, name="idle")

    trio.run(main)
    totals = steps.totals()
    assert totals["busy"][0] >= 0.09 and totals["busy"][1] >= 5
    assert totals["idle"][0] < 0.01
    assert next(iter(totals)) == "busy"  # sorted by CPU, most first


def test_awaiting_says_where_each_task_of_a_tree_waits_in_its_own_code():
    """--profile's stack dump of a stuck node: every task under the root, by its innermost frames outside trio."""
    import trio
    import trio.testing

    from bench.swarm_scale import awaiting

    async def dialling() -> None:
        await trio.sleep_forever()

    async def node() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(dialling, name="dial")
            nursery.start_soon(dialling, name="dial")
            await trio.sleep_forever()

    async def main() -> dict[str, int]:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(node, name="node")
            await trio.testing.wait_all_tasks_blocked()
            waits = awaiting(next(iter(nursery.child_tasks)))
            nursery.cancel_scope.cancel()
        return waits

    waits = trio.run(main)
    by_place = {where.split(":")[0]: n for where, n in waits.items()}  # without the line numbers
    assert by_place == {"dial @ test_capacity_model.dialling": 2, "node @ test_capacity_model.node": 1}
