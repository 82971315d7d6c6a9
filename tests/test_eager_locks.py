"""node/libp2p/locks.py: a free lock is taken without a pass of the scheduler; a held one behaves as trio's does
(waiters served first in, first out, a waiter cancellable, the owner checked)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from node.libp2p.locks import EAGER_TRIO, EagerLock, EagerSemaphore
from tests.helpers import yields_of


async def test_a_free_lock_or_slot_is_taken_without_a_yield_and_trios_takes_one():
    async def hold(lock) -> None:  # type: ignore[no-untyped-def]
        async with lock:
            pass

    assert await yields_of(lambda: hold(EagerLock())) == 0
    assert await yields_of(lambda: hold(EagerSemaphore(1))) == 0
    assert await yields_of(lambda: hold(trio.Lock())) == 1
    assert await yields_of(lambda: hold(trio.Semaphore(1))) == 1


@pytest.mark.parametrize("make", [EagerLock, lambda: EagerSemaphore(1)], ids=["lock", "semaphore"])
async def test_a_cancelled_caller_is_refused_a_free_lock_as_by_trios(make):
    lock = make()
    with trio.CancelScope() as scope:
        scope.cancel()
        await lock.acquire()
    assert scope.cancelled_caught
    lock.acquire_nowait()  # it was never taken


@pytest.mark.parametrize("make", [EagerLock, lambda: EagerSemaphore(1)], ids=["lock", "semaphore"])
async def test_a_held_lock_serves_its_waiters_in_order_and_lets_a_waiter_go_when_cancelled(make):
    lock, order = make(), []

    async def waiter(name: str) -> None:
        async with lock:
            order.append(name)

    await lock.acquire()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter, "first")
        await trio.testing.wait_all_tasks_blocked()
        cancelled = trio.CancelScope()

        async def impatient() -> None:
            with cancelled:
                await waiter("never")

        nursery.start_soon(impatient)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(waiter, "second")
        await trio.testing.wait_all_tasks_blocked()
        assert lock.statistics().tasks_waiting == 3
        cancelled.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert lock.statistics().tasks_waiting == 2
        lock.release()
    assert order == ["first", "second"]


async def test_a_lock_refuses_a_second_acquire_by_its_owner_and_a_release_by_another_task():
    lock = EagerLock()
    await lock.acquire()
    assert lock.locked()
    with pytest.raises(RuntimeError):
        await lock.acquire()

    async def other() -> None:
        with pytest.raises(trio.WouldBlock):
            lock.acquire_nowait()
        with pytest.raises(RuntimeError):
            lock.release()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other)
    lock.release()
    assert not lock.locked()


async def test_a_semaphore_counts_its_slots_and_refuses_a_release_past_its_maximum():
    sem = EagerSemaphore(2, max_value=2)
    await sem.acquire()
    sem.acquire_nowait()
    assert (sem.value, sem.max_value) == (0, 2)
    with pytest.raises(trio.WouldBlock):
        sem.acquire_nowait()
    sem.release()
    sem.release()
    with pytest.raises(ValueError):
        sem.release()


def test_the_patched_modules_trio_is_trio_but_for_its_locks():
    assert EAGER_TRIO.Lock is EagerLock and EAGER_TRIO.Semaphore is EagerSemaphore
    for name in ("open_nursery", "Event", "CancelScope", "CapacityLimiter", "lowlevel", "sleep", "Cancelled"):
        assert getattr(EAGER_TRIO, name) is getattr(trio, name)
