"""A write-ahead journal of accepted rollout groups, so a trainer that dies loses none of them.

A group is appended, and with durable acks fsynced, before its ack is sent: ``sync`` is a group commit, so one
fsync (in a worker thread, on a duplicate of the file descriptor) covers every record appended before it began,
and concurrent submissions share it instead of queueing one fsync each. The journal is cut into segments, one
per checkpoint: when the trainer checkpoints, it opens segment ``e`` holding a snapshot of the groups then
buffered, and the checkpoint records ``e``. On restart, segment ``e``'s snapshot plus every group accepted
after it (in ``e`` or any later segment) go back into the buffer; groups trained since the checkpoint are
trained again, which is right, because the model went back to the checkpoint too. Segments older than the
checkpoint's are deleted once it is safely on disk. A record torn by a crash ends the replay quietly.
A new segment (written at a checkpoint) is fsynced with its directory before the checkpoint names it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import msgpack
import trio

from trainer.groups import Group

log = logging.getLogger(__name__)

HEADER = struct.Struct(">I")
MAX_RECORD = 64 << 20


def _segment(root: Path, epoch: int) -> Path:
    return root / f"journal-{epoch:08d}.bin"


def _epochs(root: Path) -> list[int]:
    return sorted(int(p.stem.split("-")[1]) for p in root.glob("journal-*.bin"))


def _read(path: Path) -> list[dict]:
    """Every whole record of a segment, as written: a group ({"snap", "g", "ids"}), a compaction's header
    ({"base"}) or its tally ({"tally"})."""
    out = []
    data = path.read_bytes()
    pos = 0
    while pos + HEADER.size <= len(data):
        (n,) = HEADER.unpack_from(data, pos)
        if n > MAX_RECORD or pos + HEADER.size + n > len(data):
            log.warning("%s ends in a torn record (%d bytes ignored)", path.name, len(data) - pos)
            break
        out.append(msgpack.unpackb(data[pos + HEADER.size : pos + HEADER.size + n], raw=False))
        pos += HEADER.size + n
    return out


def _pack(record: dict) -> bytes:
    body = msgpack.packb(record, use_bin_type=True)
    return HEADER.pack(len(body)) + body


def _group_record(snap: bool, group: Group, ids: list[str]) -> bytes:
    return _pack({"snap": snap, "g": dataclasses.asdict(group), "ids": ids})


@dataclass
class Tally:
    """What a compaction dropped, as the ledger counts it: groups accepted after the checkpoint (``groups``,
    ``rollouts``, ``by_peer``), and the fate of every dropped group (its records are gone, the books still balance)."""

    groups: int = 0
    rollouts: int = 0
    by_peer: dict[str, int] = field(default_factory=dict)
    stale: int = 0
    no_signal: int = 0

    def drop(self, group: Group, ids: list[str], fate: str, accepted: bool) -> None:
        if accepted:
            self.groups += 1
            self.rollouts += len(ids)
            self.by_peer[group.peer] = self.by_peer.get(group.peer, 0) + len(ids)
        if fate == "no_signal":
            self.no_signal += 1
        else:
            self.stale += 1

    def add(self, other: dict) -> None:
        self.groups += other["groups"]
        self.rollouts += other["rollouts"]
        for peer, n in other["by_peer"].items():
            self.by_peer[peer] = self.by_peer.get(peer, 0) + n
        self.stale += other["stale"]
        self.no_signal += other["no_signal"]


Entries = list[tuple[Group, list[str]]]


def _replay(root: Path, epoch: int, epochs: list[int]) -> tuple[Entries, Entries, Tally]:
    """Replay from checkpoint ``epoch`` over segments ``epochs`` (those >= ``epoch``, ascending): a compacted
    segment restating from ``epoch`` (the latest, if several) stands for every segment before it."""
    segments = {e: _read(_segment(root, e)) for e in epochs}
    restated = [e for e in epochs if segments[e] and segments[e][0].get("base") == epoch]
    first = restated[-1] if restated else epoch
    snapshot: Entries = []
    new: Entries = []
    tally = Tally()
    seen: set[str] = set()
    for e in epochs:
        if e < first:
            continue
        for rec in segments[e]:
            if "tally" in rec:
                if e == first:
                    tally.add(rec["tally"])
                continue
            if "g" not in rec:
                continue  # a compaction's header
            group = Group(**rec["g"])
            if group.group_id in seen or (rec["snap"] and e != first):
                continue  # a later segment's snapshot repeats groups already counted
            seen.add(group.group_id)
            (snapshot if rec["snap"] else new).append((group, rec["ids"]))
    return snapshot, new, tally


class RolloutJournal:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.epoch = -1
        self._file: BinaryIO | None = None
        self.appended = 0  # records appended since this process started
        self.synced = 0  # of those, how many are known to be on stable storage
        self.fsyncs = 0
        self._sync_lock = trio.Lock()
        self.tally = Tally()  # what compactions dropped from the last replay's groups
        self.compactions = 0

    def _write(self, snap: bool, group: Group, ids: list[str]) -> None:
        assert self._file is not None, "open a segment first"
        self._file.write(_group_record(snap, group, ids))

    def append(self, group: Group, rollout_ids: list[str]) -> int:
        """Write a record (to the OS: it survives a killed process); returns its number for ``sync``."""
        self._write(False, group, rollout_ids)
        self._file.flush()  # type: ignore[union-attr]
        self.appended += 1
        return self.appended

    async def sync(self, upto: int) -> None:
        """Return once record ``upto`` is on stable storage (survives a lost machine)."""
        async with self._sync_lock:
            if self.synced >= upto or self._file is None:
                return
            target = self.appended
            fd = os.dup(self._file.fileno())  # stays valid if a checkpoint rotates the segment meanwhile
            try:
                await trio.to_thread.run_sync(os.fsync, fd)
            finally:
                os.close(fd)
            self.fsyncs += 1
            self.synced = max(self.synced, target)

    def start_segment(self, epoch: int, snapshot: list[tuple[Group, list[str]]]) -> None:
        """Begin segment ``epoch`` with the groups buffered now; later appends go there. Blocking fsyncs: this
        happens once per checkpoint, and the checkpoint must not name a segment that is not on disk."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self.synced = self.appended
        self._file = open(_segment(self.root, epoch), "wb")
        self.epoch = epoch
        for group, ids in snapshot:
            self._write(True, group, ids)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._sync_dir()

    def last_epoch(self) -> int:
        return max(_epochs(self.root), default=-1)

    def drop_before(self, epoch: int) -> None:
        for e in _epochs(self.root):
            if e < epoch:
                _segment(self.root, e).unlink(missing_ok=True)

    def replay(self, epoch: int) -> tuple[Entries, Entries]:
        """(the snapshot of segment ``epoch``, the groups accepted after it), each group once; ``tally`` then holds
        what compactions dropped from them."""
        snapshot, new, self.tally = _replay(self.root, epoch, [e for e in _epochs(self.root) if e >= epoch])
        return snapshot, new

    async def compact(self, base: int, keep: set[str], fate: Callable[[Group], str]) -> int:
        """Restate segments ``base`` (the checkpoint's) to the current one as one segment holding only the groups
        a restart from that checkpoint still needs (``keep``: buffered, or trained since the checkpoint), and a
        tally of the rest (``fate``: "stale" or "no_signal", what became of each); returns how many were dropped.

        Checkpoints compact the journal, but no step, no checkpoint: groups without signal would grow it forever.
        Appends move to a fresh segment first; the restatement is written beside (a temporary file, fsynced, then
        renamed, the directory fsynced) before the segments it restates are deleted: a crash at any point leaves
        either the old segments or their restatement for ``replay``. Call only while no checkpoint is being cut."""
        old = [e for e in _epochs(self.root) if base <= e <= self.epoch]
        k = self.epoch + 1
        self.start_segment(k + 1, [])
        try:
            return await trio.to_thread.run_sync(self._restate, base, old, k, keep, fate)
        except FileNotFoundError:  # a checkpoint superseded these segments meanwhile: nothing left to do
            return 0

    def _restate(self, base: int, old: list[int], k: int, keep: set[str], fate: Callable[[Group], str]) -> int:
        snapshot, new, tally = _replay(self.root, base, old)
        dropped = 0
        tmp = self.root / f"journal-{k:08d}.tmp"
        with open(tmp, "wb") as f:
            f.write(_pack({"base": base}))
            for entries, accepted in ((snapshot, False), (new, True)):
                for group, ids in entries:
                    if group.group_id in keep:
                        f.write(_group_record(not accepted, group, ids))
                    else:
                        tally.drop(group, ids, fate(group), accepted)
                        dropped += 1
            f.write(_pack({"tally": dataclasses.asdict(tally)}))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, _segment(self.root, k))
        self._sync_dir()
        for e in old:
            _segment(self.root, e).unlink(missing_ok=True)
        self.compactions += 1
        return dropped

    def _sync_dir(self) -> None:
        dir_fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
