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


def _read(path: Path) -> list[tuple[bool, Group, list[str]]]:
    """(is_snapshot, group, rollout ids) for every whole record in a segment."""
    out = []
    data = path.read_bytes()
    pos = 0
    while pos + HEADER.size <= len(data):
        (n,) = HEADER.unpack_from(data, pos)
        if n > MAX_RECORD or pos + HEADER.size + n > len(data):
            log.warning("%s ends in a torn record (%d bytes ignored)", path.name, len(data) - pos)
            break
        rec = msgpack.unpackb(data[pos + HEADER.size : pos + HEADER.size + n], raw=False)
        out.append((rec["snap"], Group(**rec["g"]), rec["ids"]))
        pos += HEADER.size + n
    return out


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

    def _write(self, snap: bool, group: Group, ids: list[str]) -> None:
        assert self._file is not None, "open a segment first"
        body = msgpack.packb({"snap": snap, "g": dataclasses.asdict(group), "ids": ids}, use_bin_type=True)
        self._file.write(HEADER.pack(len(body)) + body)

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
        dir_fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    def last_epoch(self) -> int:
        return max(_epochs(self.root), default=-1)

    def drop_before(self, epoch: int) -> None:
        for e in _epochs(self.root):
            if e < epoch:
                _segment(self.root, e).unlink(missing_ok=True)

    def replay(self, epoch: int) -> tuple[list[tuple[Group, list[str]]], list[tuple[Group, list[str]]]]:
        """(the snapshot of segment ``epoch``, the groups accepted after it), each group once."""
        snapshot: list[tuple[Group, list[str]]] = []
        new: list[tuple[Group, list[str]]] = []
        seen: set[str] = set()
        for e in _epochs(self.root):
            if e < epoch:
                continue
            for is_snap, group, ids in _read(_segment(self.root, e)):
                if group.group_id in seen or (is_snap and e != epoch):
                    continue  # a later segment's snapshot repeats groups already counted
                seen.add(group.group_id)
                (snapshot if is_snap else new).append((group, ids))
        return snapshot, new

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
