"""The outbox: which versions a training run names (a pure rule), and, under trio's mock clock, that one version is
in flight at a time while the ones falling due meanwhile coalesce; each version goes out staged, published,
announced (and announced again), then the store is collected."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio

from node.weights.outbox import MANIFESTS_OUT_WAIT, Cadence, Outbox, cadence, final_due
from protocols.weights import parse_announce


def schedule(every: int, steps: int, busy: set[int] = frozenset()) -> tuple[list[int], Cadence]:
    """The steps a version is named after, when publishing is in flight after the steps in ``busy``."""
    c, named = Cadence(every), []
    for step in range(1, steps + 1):
        c, now = cadence(c, step, step in busy)
        if now:
            named.append(step)
    return named, c


def test_a_version_every_publish_every_steps_when_publishing_keeps_up():
    assert schedule(1, 4) == ([1, 2, 3, 4], Cadence(1, named_at=4))
    assert schedule(3, 10) == ([3, 6, 9], Cadence(3, named_at=9))


def test_a_due_version_waits_for_the_one_in_flight_and_later_ones_coalesce_into_it():
    # due after steps 2, 4, 6 and 8; one in flight through steps 3-7: the version due after 4 waits, the one due
    # after 6 replaces it, and the one due after 8 replaces that and is named (two coalesced)
    named, c = schedule(2, 9, busy={3, 4, 5, 6, 7})
    assert named == [2, 8]
    assert c.coalesced == 2 and not c.due
    # due but not yet named: it stays due, named the first step nothing is in flight (off the publish cadence)
    named, c = schedule(2, 5, busy={3, 4})
    assert named == [2, 5] and c.coalesced == 0


def test_the_run_ends_with_a_version_of_its_last_steps():
    assert final_due(Cadence(4, named_at=8), 9)
    assert not final_due(Cadence(4, named_at=8), 8)
    c, now = cadence(Cadence(2, named_at=10), 11, False)  # a resumed run counts from where it began
    assert not now and final_due(c, 11)


@dataclass
class FakeManifest:
    version: int
    total_size: int = 1000
    update_size: int = 100
    patch: Any = None

    def all_chunks(self) -> list[bytes]:
        return [b"c"]


@dataclass
class FakeStats:
    patch_seconds: float = 0.25


@dataclass
class FakeStore:
    gc_calls: list[tuple[float, int]] = field(default_factory=list)

    def gc(self, keep: int) -> None:
        self.gc_calls.append((trio.current_time(), keep))


class FakePublisher:
    """Publishing takes ``seconds`` (of the test's clock); counts how many publish at once."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.store, self.last_stats = seconds, FakeStore(), None
        self.publishing = self.most_at_once = 0
        self.staged: list[int] = []

    def staging_dir(self, version: int) -> Path:
        return Path(f"/nowhere/publish-v{version}")

    def publish(self, staging: Path, version: int) -> tuple[bytes, None, FakeManifest]:
        assert version in self.staged and staging == self.staging_dir(version)
        self.last_stats = FakeStats()
        return bytes([version]) * 32, None, FakeManifest(version)


class FakeGossip:
    def __init__(self) -> None:
        self.heard: list[tuple[float, int]] = []

    async def publish(self, topic: str, message: dict[str, Any]) -> None:
        assert topic == "/swarmrl/test/weights/announce"
        version, mid = parse_announce(message)
        assert mid == bytes([version]) * 32
        self.heard.append((trio.current_time(), version))


def outbox_for(publisher: FakePublisher, gossip: FakeGossip, keep: int | None = 3) -> tuple[Outbox, list[int]]:
    """An outbox over the fakes, and the versions its ``on_published`` saw."""

    async def run_sync(fn: Any, *args: Any) -> Any:
        """Blocking work inline; publishing costs its seconds on the (mock) clock."""
        if fn == publisher.publish:
            publisher.publishing += 1
            publisher.most_at_once = max(publisher.most_at_once, publisher.publishing)
            await trio.sleep(publisher.seconds)
            publisher.publishing -= 1
        return fn(*args)

    def stage(version: int, staging: Path) -> None:
        assert staging == publisher.staging_dir(version)
        publisher.staged.append(version)

    published: list[int] = []
    box = Outbox(publisher, stage, gossip, "test", keep, lambda v, m: published.append(v), run_sync)  # type: ignore[arg-type]
    return box, published


async def test_one_version_in_flight_the_rest_coalesce_and_the_loop_never_waits(autojump_clock):
    publisher, gossip = FakePublisher(2.5), FakeGossip()
    outbox, published = outbox_for(publisher, gossip)
    named: list[tuple[float, int]] = []
    written: list[int] = []
    sent: list[dict[str, Any]] = []

    def name() -> int:
        named.append((trio.current_time(), len(named) + 1))
        return len(named)

    outbox.start(1, 0, name, written.append, sent.append)
    steps_at = []
    async with trio.open_nursery() as background:
        for step in range(1, 9):
            await trio.sleep(1.0)  # a training step
            steps_at.append(trio.current_time())
            outbox.after_step(background, step)
    assert steps_at == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]  # training never waited for a publish
    await outbox.finish(8)

    # each publish takes 2.5 s: named after steps 1, 4 and 7 (the first free step), and the run's final one
    assert named == [(1.0, 1), (4.0, 2), (7.0, 3), (9.5, 4)]
    assert written == publisher.staged == published == [1, 2, 3, 4]
    assert gossip.heard == [(3.5, 1), (6.5, 2), (9.5, 3), (12.0, 4)]
    assert publisher.most_at_once == 1
    assert outbox.cadence.coalesced == 4  # the ones due after steps 2, 3, 5 and 6: named later, as 2 and 3
    assert [r["published"] for r in sent] == [1, 2, 3, 4]
    assert all(r["publish_seconds"] == 2.5 and r["publish_bytes"] == 100 for r in sent)
    assert sent[0]["publish_patch_seconds"] == 0.25
    assert publisher.store.gc_calls == [(3.5, 3), (6.5, 3), (9.5, 3), (12.0, 3)]  # after each announcement
    assert outbox.published == (4, bytes([4]) * 32) and outbox.update_bytes == 100


async def test_send_then_announce_again_ever_more_rarely(autojump_clock):
    publisher, gossip = FakePublisher(1.0), FakeGossip()
    outbox, published = outbox_for(publisher, gossip, keep=None)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(outbox.announce_forever, 2.0)  # nothing published yet: nothing announced
        await trio.sleep(5.0)
        await outbox.send(0)  # done at t=6
        await trio.sleep(16.5)
        await outbox.send(1)  # done at t=23.5: its repeats start over
        await trio.sleep(3.0)
        nursery.cancel_scope.cancel()
    assert gossip.heard == [(6.0, 0), (8.0, 0), (12.0, 0), (20.0, 0), (23.5, 1), (25.5, 1)]
    assert published == [0, 1] and publisher.store.gc_calls == []  # keep=None: no gc (bench/wan_node's origin)


class FakePusher:
    """Writes the manifests to its peers ``out_after`` seconds into a push (None: never), then the rest."""

    def __init__(self, out_after: float | None, lasts: float) -> None:
        self.out_after, self.lasts = out_after, lasts
        self.manifests_out_at: float | None = None

    def audience(self) -> int:
        return 3

    async def push(self, mid: bytes, signed: Any, manifest: Any, manifests_out: trio.Event | None = None) -> int:
        started = trio.current_time()
        if self.out_after is not None:
            await trio.sleep(self.out_after)
            self.manifests_out_at = trio.current_time()
            assert manifests_out is not None
            manifests_out.set()
        await trio.sleep(max(0.0, started + self.lasts - trio.current_time()))
        return 1


@pytest.mark.parametrize(("out_after", "announced_at"), [(0.3, 1.3), (None, 1.0 + MANIFESTS_OUT_WAIT)])
async def test_a_pushed_version_is_announced_once_its_manifests_are_out(autojump_clock, out_after, announced_at):
    """Announced after the pushed manifests are written (a peer pushed to then holds the manifest the announcement
    names, and does not fetch it again), or after ``MANIFESTS_OUT_WAIT`` when a lane cannot write its manifest; the
    push goes on after the announcement either way."""
    publisher, gossip = FakePublisher(1.0), FakeGossip()
    outbox, _ = outbox_for(publisher, gossip, keep=None)
    pusher = FakePusher(out_after, lasts=5.0)
    outbox.pusher = pusher
    publisher.chunk_size = 1 << 20  # type: ignore[attr-defined]  # pieces are cut by it when pushing
    await outbox.send(1)  # published at 1.0 s; no announce_forever running: send waits for the push
    assert gossip.heard == [(announced_at, 1)]
    assert trio.current_time() == pytest.approx(6.0)  # the push's 5 s
