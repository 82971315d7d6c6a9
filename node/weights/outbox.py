"""A version's way out of the trainer: stage its model dir, publish it (chunks, signed manifest), announce it by
gossip (now, and again ever more rarely until the next one), drop what the store no longer needs. No torch here.

The trainer names versions as it trains (``after_step``); one is in flight at a time, so a publish slower than
``every`` steps never makes the loop wait: the versions that fall due meanwhile coalesce into the next one named
(``cadence``, a pure rule). bench/wan_node.py sends its versions through the same object (``send``).

Given a ``pusher`` (the origin's push: node/weights/server.py, OriginPush), each version is also pushed to the
samplers, and the versions are cut into pieces sized for that (``policy.piece_size``: from the last patch's size,
the whole version's and how many samplers a push reaches; kept while within ``policy.PIECE_HYSTERESIS``). The
announcement goes out once the pushed manifests are written (a peer pushed to then holds the manifest the
announcement names, and does not fetch it again). While ``announce_forever`` runs, pushes run beside it and ``send``
does not wait for them.

Other encodings (``extras``: node/weights/encodings.py): each version is also published, after the first encoding's
announcement, in every other encoding ``wanted()`` names, from the same staged model dir (hard links), each by its
own publisher into its own chain, announced (with its encoding) and pushed to the peers that run it. A failure there
costs that encoding's version only.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import trio

from node.weights import policy
from node.weights.gossip import announce_topic
from node.weights.publish import Publisher
from protocols import weights as weights_proto
from protocols.weights import Manifest, SignedManifest

log = logging.getLogger(__name__)

# seconds an announcement waits for the pushed manifests to be written out: a lane opens a stream (one round trip)
# and writes the manifest first; a peer that does not take it within this is announced to anyway
MANIFESTS_OUT_WAIT = 1.0


@dataclass(frozen=True)
class Cadence:
    """Which versions a training run names: one every ``every`` steps, or the first step after, when the last one
    named is still being published then."""

    every: int
    named_at: int = 0  # the step the last version was named at
    due: bool = False  # a version fell due and is not named yet
    coalesced: int = 0  # due versions never named: a later one went out in their place


def cadence(c: Cadence, step: int, in_flight: bool) -> tuple[Cadence, bool]:
    """After training step ``step``: the new cadence, and whether to name a version now."""
    due, coalesced = c.due, c.coalesced
    if step % c.every == 0:
        due, coalesced = True, coalesced + due  # the last due one was never named
    if due and not in_flight:
        return replace(c, named_at=step, due=False, coalesced=coalesced), True
    return replace(c, due=due, coalesced=coalesced), False


def final_due(c: Cadence, step: int) -> bool:
    """At the run's end: whether steps trained since the last version named still need one (the final version)."""
    return step > c.named_at


class Announcer(Protocol):
    async def publish(self, topic: str, message: dict[str, Any]) -> None: ...


class Pusher(Protocol):
    def audience(self) -> int: ...

    async def push(
        self, mid: bytes, signed: SignedManifest, manifest: Manifest, manifests_out: trio.Event | None = None
    ) -> int: ...


@dataclass
class Extra:
    """Another encoding of every version: its publisher (tagged: node/weights/publish.py), its pusher, and what it
    announced last."""

    publisher: Publisher
    pusher: Pusher | None = None
    published: tuple[int, bytes] | None = None
    patch_bytes: int | None = None


def link_model_dir(src: Path, dst: Path) -> None:
    """``dst`` holds ``src``'s files as hard links (copies where links fail): publishers replace files, never write
    through them, so one staged version feeds every encoding's publisher."""
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file():
            try:
                os.link(f, dst / f.name)
            except OSError:
                shutil.copyfile(f, dst / f.name)


class Outbox:
    """``stage(version, path)`` (blocking, run in a thread) writes a version's model dir where the publisher takes
    it; ``on_published(version, manifest)`` runs after each publish, before the announcement; ``keep`` is the store's
    gc (None: no gc). ``run_sync`` is where blocking work runs (a worker thread)."""

    name: Callable[[], int]  # these three: ``start``
    write: Callable[[int], object]
    sent: Callable[[dict[str, Any]], None]

    def __init__(
        self,
        publisher: Publisher,
        stage: Callable[[int, Path], object],
        gossip: Announcer,
        swarm_name: str,
        keep: int | None = None,
        on_published: Callable[[int, Manifest], None] = lambda version, manifest: None,
        run_sync: Callable[..., Awaitable[Any]] = trio.to_thread.run_sync,
        pusher: Pusher | None = None,
        extras: Mapping[str, Extra] | None = None,
        wanted: Callable[[], Iterable[str]] = lambda: (),
    ) -> None:
        """``extras``: other encodings by name, each published while ``wanted()`` names it."""
        self.publisher, self.stage, self.gossip, self.topic = publisher, stage, gossip, announce_topic(swarm_name)
        self.extras, self.wanted = dict(extras or {}), wanted
        self.keep, self.on_published, self.run_sync = keep, on_published, run_sync
        self.published: tuple[int, bytes] | None = None  # (version, manifest id) announced last
        self.update_bytes = 0  # what the last version published costs to fetch (a patch's size, if it has one)
        self.cadence = Cadence(1)
        self.in_flight = False
        self.pusher = pusher
        # the configured chunk size: pieces are never larger
        self.max_chunk = publisher.chunk_size if pusher is not None else 0
        self.patch_bytes: int | None = None  # the last patch published (what the next update will likely weigh)
        self.pushed = 0  # chunks the pushes placed, all versions together
        self._background: trio.Nursery | None = None
        self._fresh = trio.Event()  # set when a version is published: the re-announcements start over

    async def send(self, version: int) -> Manifest:
        """Stage, publish and announce ``version``; then gc the store."""
        staging = self.publisher.staging_dir(version)
        await self.run_sync(self.stage, version, staging)
        wanted = set(self.wanted())
        extras = [(enc, x) for enc, x in self.extras.items() if enc in wanted]
        for _enc, x in extras:
            await self.run_sync(link_model_dir, staging, x.publisher.staging_dir(version))
        if self.pusher is not None:
            self.publisher.chunk_size = self.piece_size()
        mid, signed, manifest = await self.run_sync(self.publisher.publish, staging, version)
        if manifest.patch is not None:
            self.patch_bytes = manifest.patch.size
        self.published, self.update_bytes = (version, mid), manifest.update_size
        self._fresh.set()
        log.info(
            "published version %d (%d chunks, %.1f MB%s)",
            version,
            len(manifest.all_chunks()),
            manifest.total_size / 1e6,
            f"; patch {manifest.patch.size / 1e6:.2f} MB" if manifest.patch is not None else "",
        )
        self.on_published(version, manifest)
        await self._announce_and_push(self.pusher, mid, signed, manifest)
        for enc, x in extras:
            await self._send_extra(enc, x, version)
        if self.keep is not None:
            await self.run_sync(self.publisher.store.gc, self.keep)
        return manifest

    async def _announce_and_push(
        self, pusher: Pusher | None, mid: bytes, signed: SignedManifest, manifest: Manifest
    ) -> None:
        """Push (when there is a pusher), and announce once the pushed manifests are written out (at most
        ``MANIFESTS_OUT_WAIT``): the announcement reaches the peers pushed to after the manifest it names."""
        if pusher is None:
            await self.announce()
            return
        out = trio.Event()
        async with trio.open_nursery() as nursery:
            (self._background or nursery).start_soon(self._push, pusher, mid, signed, manifest, out)
            with trio.move_on_after(MANIFESTS_OUT_WAIT):
                await out.wait()
            await self.announce()

    async def _send_extra(self, encoding: str, x: Extra, version: int) -> None:
        """Publish ``version`` (staged for ``x`` already) in another encoding, announce and push it."""
        try:
            if x.pusher is not None:
                x.publisher.chunk_size = self._piece_size(x.publisher, x.pusher, x.patch_bytes)
            mid, signed, manifest = await self.run_sync(x.publisher.publish, x.publisher.staging_dir(version), version)
        except Exception as exc:  # this encoding's samplers wait for the next version; the others have theirs
            log.warning("publishing version %d as %s failed: %s: %s", version, encoding, type(exc).__name__, exc)
            return
        if manifest.patch is not None:
            x.patch_bytes = manifest.patch.size
        x.published = (version, mid)
        log.info("published version %d as %s (%.2f MB to fetch)", version, encoding, manifest.update_size / 1e6)
        await self._announce_and_push(x.pusher, mid, signed, manifest)

    def piece_size(self) -> int:
        """The chunk size the next version is cut with (``policy.piece_size``, kept within its hysteresis)."""
        assert self.pusher is not None
        return self._piece_size(self.publisher, self.pusher, self.patch_bytes)

    def _piece_size(self, publisher: Publisher, pusher: Pusher, patch_bytes: int | None) -> int:
        stats = publisher.last_stats
        if patch_bytes is None or stats is None:
            return publisher.chunk_size  # no patch seen yet: nothing to size pieces by
        proposed = policy.piece_size(patch_bytes, pusher.audience(), stats.full_bytes, self.max_chunk)
        return policy.keep_piece_size(publisher.chunk_size, proposed)

    async def _push(
        self, pusher: Pusher, mid: bytes, signed: SignedManifest, manifest: Manifest, out: trio.Event
    ) -> None:
        try:
            self.pushed += await pusher.push(mid, signed, manifest, out)
        except Exception as exc:  # a push only saves round trips: the version is announced and served anyway
            log.warning("pushing version %d failed: %s: %s", manifest.version, type(exc).__name__, exc)
        finally:
            out.set()

    async def announce(self) -> None:
        """Announce the newest version of each encoding (with its encoding named, where the publisher says it)."""
        heads = [(getattr(self.publisher, "encoding", None), self.published)]
        heads += [(enc, x.published) for enc, x in self.extras.items()]
        for encoding, published in heads:
            if published is not None:
                version, mid = published
                try:
                    await self.gossip.publish(self.topic, weights_proto.announce(version, mid, encoding))
                except Exception as exc:
                    log.debug("announce failed: %s", exc)

    async def announce_forever(self, interval: float) -> None:
        """Announce the latest version again after ``interval`` seconds, then ever more rarely
        (``policy.reannounce_delay``), starting over with each version: nodes that join late, or missed it, hear.
        Pushes of the versions sent meanwhile run here, beside it."""
        async with trio.open_nursery() as nursery:
            self._background = nursery
            try:
                repeats = 0
                while True:
                    with trio.move_on_after(policy.reannounce_delay(interval, repeats)):
                        await self._fresh.wait()
                    if self._fresh.is_set():  # announced as it was published: its repeats start over
                        self._fresh, repeats = trio.Event(), 0
                        continue
                    await self.announce()
                    repeats += 1
            finally:
                self._background = None

    # -- versions named while training -------------------------------------------------------------------
    def start(
        self,
        every: int,
        step: int,
        name: Callable[[], int],
        write: Callable[[int], object],
        sent: Callable[[dict[str, Any]], None] = lambda record: None,
    ) -> None:
        """A training run begins after step ``step``, due to name a version every ``every`` steps: ``name()`` names
        one (quickly, in the loop), ``write(version)`` writes its weights (blocking, in the background, while the
        next step trains); once it is announced, ``sent`` gets its record: the version, the seconds since it was
        named, the bytes that travel and the time spent building its patch."""
        self.cadence, self.name, self.write, self.sent = Cadence(every, named_at=step), name, write, sent

    def after_step(self, nursery: trio.Nursery, step: int) -> None:
        """Training step ``step`` is done: when a version is due and none is in flight, name one now, and write and
        send it in the background (in ``nursery``)."""
        self.cadence, now = cadence(self.cadence, step, self.in_flight)
        if now:
            self.in_flight = True
            nursery.start_soon(self._write_and_send, self.name())

    async def finish(self, step: int) -> None:
        """The run's end (nothing in flight): the last steps' weights go out too, as its final version."""
        if final_due(self.cadence, step):
            self.cadence = replace(self.cadence, named_at=step)
            await self._write_and_send(self.name())

    async def _write_and_send(self, version: int) -> None:
        t0 = trio.current_time()
        try:
            await self.run_sync(self.write, version)
            await self.send(version)
        finally:
            self.in_flight = False
        stats = self.publisher.last_stats
        self.sent(
            {
                "published": version,
                "publish_seconds": trio.current_time() - t0,
                **({"publish_bytes": self.update_bytes, "publish_patch_seconds": stats.patch_seconds} if stats else {}),
            }
        )
