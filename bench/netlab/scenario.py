"""Driving a WanSwarm through timed steps (the WAN fault test's ``Scenario``, here for benches): samplers join on
a schedule, every node's state is sampled all along, a dead process fails the wait with its log's tail.

Waits are bench waits (no load stretching): pass ``wait=tests.helpers.wait_for`` from a test for its deadlines
and its failure files.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.netlab.swarm import WanSwarm


def machine_busy_seconds() -> float:
    """CPU seconds the machine's cores have been busy so far, whoever used them (steal included: a hypervisor's
    other guests), from /proc/stat."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = (
        int(x) for x in Path("/proc/stat").read_text().split()[1:9]
    )
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def missing(result: Any) -> bool:
    """A check's result still says no: False, or a non-empty list of what is missing."""
    return not result if isinstance(result, bool) else bool(result)


def bench_wait(
    until: Callable[[], Any],
    timeout: float,
    what: str,
    interval: float = 0.5,
    state: Callable[[], object] | None = None,
) -> None:
    """Wait for ``until()`` (True, or an empty list of what is missing) at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while missing(result := until()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}: {result}")
        time.sleep(interval)


class Scenario:
    """Drives a WanSwarm through timed steps, sampling every node's state all along."""

    def __init__(self, swarm: WanSwarm, joins: dict[str, float], wait: Callable[..., None] = bench_wait) -> None:
        self.swarm = swarm
        self.joins = dict(joins)  # sampler -> time (s after start) it joins
        self.down: set[str] = set()
        self.wait = wait
        self.spent: list[tuple[str, float]] = []  # each wait and its seconds: where a run's time went

    def pump(self, until, timeout: float, what: str) -> None:
        """Run the scenario until ``until()`` holds (True, or an empty list of what is missing); on a timeout the
        message names what is missing."""

        def step():
            now = time.time() - self.swarm.t0
            for name, at in list(self.joins.items()):
                if now >= at:
                    self.swarm.start(name)
                    del self.joins[name]
            self.swarm.sample_timeline()
            self.swarm.check_alive(*[n for n in self.swarm.procs if n not in self.down])
            return until()

        t0 = time.monotonic()
        try:
            self.wait(
                step, timeout, what, interval=0.1, state=lambda: {n: self.swarm.status(n) for n in self.swarm.procs}
            )
        finally:
            self.spent.append((what, time.monotonic() - t0))

    def timings(self) -> str:
        """Where the waits' time went, one line per wait, the longest first."""
        return "\n".join(f"{sec:6.1f} s  {what}" for what, sec in sorted(self.spent, key=lambda x: -x[1]))

    def versions(self, names) -> dict[str, int]:
        return {n: self.version(n) for n in names}

    def counters(self, names, key: str) -> dict[str, int]:
        return {n: self.swarm.status(n).get(key, 0) for n in names}

    def version(self, name: str) -> int:
        return int(self.swarm.status(name).get("weights_version", -1))

    def trainer(self) -> dict:
        return self.swarm.status("trainer")
