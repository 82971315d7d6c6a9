"""A sampler does not spend compute on groups the trainer would refuse as stale: it waits for newer weights."""

from __future__ import annotations

from types import SimpleNamespace

import trio

from node.identity import load_or_create_key, peer_id_of
from node.roles.sampler import SamplerRole
from protocols.work import SamplingParams, TaskSpec, WorkLease


def lease(version: int, max_staleness: int | None, expires_in: float = 60.0) -> WorkLease:
    return WorkLease("l", version, 4, SamplingParams(1.0, 1.0, 8), [TaskSpec("reverse", 1, [1])], expires_in,
                     max_staleness)  # fmt: skip


def sampler(tmp_path, engine_version: int, announced: int | None) -> SamplerRole:
    role = SamplerRole("t", peer_id_of(load_or_create_key(tmp_path / "k")), None, tmp_path, 1.0, 1.0)
    role.engine = SimpleNamespace(version=engine_version)
    role.weights = SimpleNamespace(target=(announced, b"", None) if announced is not None else None)
    return role


def test_leases_carry_the_staleness_bound():
    assert WorkLease.from_wire(lease(3, 4).to_wire()).max_staleness == 4
    assert WorkLease.from_wire(lease(3, None).to_wire()).max_staleness is None  # older trainers: not told


async def test_waits_for_weights_when_too_far_behind(tmp_path):
    role = sampler(tmp_path, engine_version=2, announced=9)
    assert role.versions_behind(lease(5, 4)) == 7  # gossip told us of version 9
    assert await sampler(tmp_path, 2, None)._fresh_enough(lease(6, 4))  # 4 behind: fine
    done = []

    async def sample() -> None:
        done.append(await role._fresh_enough(lease(5, 4)))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sample)
        await trio.sleep(0.5)
        assert not done and role.stale_waits == 1
        role.engine.version = 5  # a newer version was installed
        role._installed.set()
        role._installed = trio.Event()
    assert done == [True]


async def test_gives_up_on_a_lease_that_expires_while_waiting(tmp_path):
    role = sampler(tmp_path, engine_version=0, announced=None)
    with trio.fail_after(5):
        assert not await role._fresh_enough(lease(10, 4, expires_in=0.3))
