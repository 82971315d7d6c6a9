"""Locks that take a free lock without a pass of the scheduler (a row of node/libp2p/patches.py PATCHES).

trio's ``Lock.acquire`` and ``Semaphore.acquire`` yield to the scheduler even when nobody holds the lock (a
"checkpoint", for fairness and cancellation). py-libp2p 0.8.1 takes one at almost every step of a stream: the swarm's
stream semaphore and yamux's backlog semaphore and ``streams_lock`` to open one; ``NetStream``'s state lock, the
stream's ``rw_lock`` and ``window_lock``, the connection's write lock and the TCP stream's write lock for each write;
the state lock, ``streams_lock`` (twice) and ``window_lock`` for each read. A DHT lookup at a peer thus waits about 25
passes of its loop for locks nobody held. On an idle box a pass is microseconds. At N = 256 samplers on one box
(bench/swarm_scale.py) a sampler's loop was 0.4-0.6 s behind, and a lookup took ~20 s, most of it in those passes
(bench/lookup_steps.py, docs/capacity.md).

``EagerLock`` and ``EagerSemaphore`` keep trio's semantics but one: a free lock is taken without yielding. The acquire
is still a cancellation point (a cancelled caller gets ``Cancelled`` there, free lock or not: a cancelled close still
sends nothing, as upstream's), and a taken lock queues its waiters first in, first out, cancellably, as trio's does.
No caller in the patched modules relies on the acquire to yield for fairness: every loop that takes one also reads a
socket or waits on an event, and both yield.

``EAGER_TRIO`` is what those modules see as ``trio``: the real module except ``Lock`` and ``Semaphore``. Locks made
while patched keep being eager after ``unapply()``."""

from __future__ import annotations

import types
from typing import Any

import trio


class EagerLock:
    """A ``trio.Lock`` whose acquire of a free lock takes it without yielding."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = trio.Lock()

    async def acquire(self) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()  # a cancellation point that yields only when cancelled
        try:
            self._lock.acquire_nowait()
        except trio.WouldBlock:
            await self._lock.acquire()

    def acquire_nowait(self) -> None:
        self._lock.acquire_nowait()

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def statistics(self) -> Any:
        return self._lock.statistics()

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self.release()


class EagerSemaphore:
    """A ``trio.Semaphore`` whose acquire of a free slot takes it without yielding."""

    __slots__ = ("_sem",)

    def __init__(self, initial_value: int, *, max_value: int | None = None) -> None:
        self._sem = trio.Semaphore(initial_value, max_value=max_value)

    @property
    def value(self) -> int:
        return self._sem.value

    @property
    def max_value(self) -> int | None:
        return self._sem.max_value

    async def acquire(self) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()  # a cancellation point that yields only when cancelled
        try:
            self._sem.acquire_nowait()
        except trio.WouldBlock:
            await self._sem.acquire()

    def acquire_nowait(self) -> None:
        self._sem.acquire_nowait()

    def release(self) -> None:
        self._sem.release()

    def statistics(self) -> Any:
        return self._sem.statistics()

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self.release()


class _EagerTrio(types.ModuleType):
    """The ``trio`` module as a patched py-libp2p module sees it: eager locks, everything else trio's own."""

    Lock = EagerLock
    Semaphore = EagerSemaphore

    def __getattr__(self, name: str) -> Any:
        return getattr(trio, name)


EAGER_TRIO = _EagerTrio("trio", "trio, with locks that take a free lock without yielding (node/libp2p/locks.py)")
