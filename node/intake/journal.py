"""A write-ahead journal of accepted rollout groups, so a trainer that dies loses none of them.

A group is appended (and flushed to the OS) before its ack is sent. The journal is cut into segments, one
per checkpoint: when the trainer checkpoints, it opens segment ``e`` holding a snapshot of the groups then
buffered, and the checkpoint records ``e``. On restart, segment ``e``'s snapshot plus every group accepted
after it (in ``e`` or any later segment) go back into the buffer; groups trained since the checkpoint are
trained again, which is right, because the model went back to the checkpoint too. Segments older than the
checkpoint's are deleted once it is safely on disk. A record torn by a crash ends the replay quietly.
Flushing survives a killed process, not a lost machine (no fsync per group: it would cap the ack rate).
"""

from __future__ import annotations

import dataclasses
import logging
import struct
from pathlib import Path
from typing import BinaryIO

import msgpack

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

    def _write(self, snap: bool, group: Group, ids: list[str]) -> None:
        assert self._file is not None, "open a segment first"
        body = msgpack.packb({"snap": snap, "g": dataclasses.asdict(group), "ids": ids}, use_bin_type=True)
        self._file.write(HEADER.pack(len(body)) + body)

    def append(self, group: Group, rollout_ids: list[str]) -> None:
        self._write(False, group, rollout_ids)
        self._file.flush()  # type: ignore[union-attr]

    def start_segment(self, epoch: int, snapshot: list[tuple[Group, list[str]]]) -> None:
        """Begin segment ``epoch`` with the groups buffered now; later appends go there."""
        if self._file is not None:
            self._file.close()
        self._file = open(_segment(self.root, epoch), "wb")
        self.epoch = epoch
        for group, ids in snapshot:
            self._write(True, group, ids)
        self._file.flush()

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
