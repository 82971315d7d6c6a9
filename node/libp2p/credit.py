"""yamux receive-window credit at half the window, as go-yamux sends it (a row of node/libp2p/patches.py PATCHES).

py-libp2p 0.8.1's ``YamuxStream._auto_tune_and_send_window_update`` (stream_muxer/yamux/yamux.py l. 410-458) is
called after every read and, besides go-yamux's rule (credit once the window owed reaches half the target window),
credits the sender on every read that leaves any window owed (its "partial slack" branch, and the
``PY_YAMUX_RELEASE_ON_READ`` branch, on by default). A reader that takes a frame at a time therefore answers every
data frame with a window-update frame: at the receiver one more Noise message to encrypt and write per frame read,
at the sender one more to read, decrypt and parse in its connection's read loop. In bench/wan's 1.5B replay that
was the origin's second-largest cost (its read loop ~0.3 CPU-s per version, reading the 14 samplers' credits for
~35 MB pushed), on a box whose CPU bounds the delivery.

``credit_at_half_window`` replaces it with go-yamux's ``sendWindowUpdate``: after a read, if the window owed (the
target minus what the sender may still send minus what is buffered unread) is at least half the target, credit all
of it at once, and let the auto-tuner double the target when such credits come within 4 RTTs (upstream's
``_apply_autotune_epoch``, unchanged). The sender still sends only within its credit, and a reader that wants more
data has read everything buffered, which makes the whole window owed and sends the credit, so no transfer waits on a
credit that is never sent.

One difference from go-yamux: at a stream's first read its target jumps to ``FIRST_TARGET`` (4 MiB) and the sender
is credited at once. Stock py-libp2p's per-read credit over-counts (it credits the owed window plus the bytes just
read: the sender's allowance is 256 KiB plus everything read so far), so its senders ran nearly unthrottled; with
go-yamux's exact rule the window doubled once per round trip from 256 KiB, and a 3 MB push over 170 ms took ~5 round
trips instead of ~2. bench/wan --replay at 4 samplers (every lane ~3.2 MB): 0.72 s stock, 1.28 s with the exact rule;
with the jump at the first read 0.66-0.68 s, at 32 KiB read 0.84 s, to 1 MiB at the first read 0.88 s. The cost: a
peer may have up to 4 MiB in flight on a stream whose reader has read once (stock: 256 KiB plus what was read;
go-yamux lets the auto-tuner reach 16 MiB); our handlers read each stream until it ends or close it."""

from __future__ import annotations

from libp2p.stream_muxer.yamux.yamux import YamuxStream

FIRST_TARGET = 4 << 20  # bytes: a stream's receive window from its first read (MAX_WINDOW_SIZE, the ceiling: 16 MiB)


async def credit_at_half_window(self: YamuxStream, *, bytes_read: int = 0) -> None:
    """Credit the sender once at least half the target window is owed (go-yamux), never after each small read."""
    credit = 0
    async with self.window_lock:
        buffered = len(self.conn.stream_buffers.get(self.stream_id, b""))
        owed = self.target_recv_window - (self.recv_window + buffered)
        if owed > 0 and (owed >= self._grow_threshold() or self.target_recv_window < FIRST_TARGET):
            self.target_recv_window = max(self.target_recv_window, FIRST_TARGET)  # the first read: see above
            credit = self._grow_to_delta(buffered) + self._apply_autotune_epoch(buffered)
    if credit > 0:
        await self.send_window_update(credit, skip_lock=True)
