"""node/rpc.py ``open_stream``: a stream's protocol is proposed with its first message, not negotiated before it.

py-libp2p's ``new_stream`` reads the listener's two multistream echoes before the caller may write: two round trips
before a push or a request leaves (0.34 s to a peer 170 ms away). Real hosts on 127.0.0.1, stock listeners.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import multiaddr
import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.host.exceptions import StreamFailure
from libp2p.network.stream.net_stream import NetStream
from libp2p.peer.peerinfo import PeerInfo
from libp2p.utils import encode_delim

from node.host import build_host
from node.rpc import LazyStream, StreamPool, open_stream, request, serve

LISTEN = multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")
ECHO = "/swarmrl-test/echo/1"


def info(host) -> PeerInfo:
    return PeerInfo(host.get_id(), [a for a in host.get_addrs() if "127.0.0.1" in str(a)])


async def echo(message, peer):
    return {"v": 1, "t": "echo", "n": message["n"]}


@pytest.mark.trio
async def test_the_first_message_leaves_before_any_byte_is_read(monkeypatch):
    events: list[tuple[object, str]] = []  # (the stream's remote peer, what it did)
    stock_read, stock_write = NetStream.read, NetStream.write

    async def read(self, n=None):
        events.append((self.muxed_conn.peer_id, "read"))
        return await stock_read(self, n)

    async def write(self, data):
        events.append((self.muxed_conn.peer_id, "write"))
        return await stock_write(self, data)

    a, b = build_host(create_new_key_pair()), build_host(create_new_key_pair())
    with trio.fail_after(30):
        async with a.run([LISTEN]), b.run([LISTEN]):
            b.set_stream_handler(ECHO, serve("echo", echo, max_request=1024, max_reply=1024))
            await a.connect(info(b))
            monkeypatch.setattr(NetStream, "read", read)
            monkeypatch.setattr(NetStream, "write", write)
            pool = StreamPool()
            reply = await request(a, b.get_id(), ECHO, {"v": 1, "t": "echo", "n": 1}, max_request=1024, max_reply=1024,
                                  pool=pool)  # fmt: skip
            client = [what for peer, what in events if peer == b.get_id()]  # a's side of its streams to b
            assert reply["n"] == 1
            again = await request(a, b.get_id(), ECHO, {"v": 1, "t": "echo", "n": 2}, max_request=1024, max_reply=1024,
                                  pool=pool)  # fmt: skip
            assert again["n"] == 2  # the kept stream, its echoes read once
    # the client's proposal and its request went out before its first read; with py-libp2p's new_stream the
    # client writes its header, then reads the echo, then writes the protocol, then reads again
    first_read = client.index("read")
    assert client[:first_read].count("write") >= 2, client


@pytest.mark.trio
async def test_a_peer_that_does_not_speak_the_protocol_fails_the_request_clearly():
    a, b = build_host(create_new_key_pair()), build_host(create_new_key_pair())
    with trio.fail_after(30):
        async with a.run([LISTEN]), b.run([LISTEN]):
            await a.connect(info(b))
            with pytest.raises(StreamFailure, match=ECHO):
                await request(a, b.get_id(), ECHO, {"v": 1, "t": "echo", "n": 1}, max_request=1024, max_reply=1024,
                              pool=StreamPool())  # fmt: skip
            # the connection survives a refused proposal: a protocol it speaks still works on it
            b.set_stream_handler(ECHO, serve("echo", echo, max_request=1024, max_reply=1024))
            stream = await open_stream(a, b.get_id(), ECHO)
            assert isinstance(stream, LazyStream)


class Scripted:
    """A stream that reads out given bytes (a listener's answer)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    async def read(self, n=None):
        n = len(self.data) if n is None else n
        out, self.data = self.data[:n], self.data[n:]
        return out


@pytest.mark.trio
@pytest.mark.parametrize(
    "answer, why",
    [
        (encode_delim(b"/multistream/1.0.0") + encode_delim(b"na"), "answered"),  # not spoken
        (encode_delim(b"/multistream/1.0.0") + encode_delim(b"/other/1"), "answered"),  # another protocol
        (encode_delim(b"/multistream/2.0.0") + encode_delim(ECHO.encode()), "answered"),  # another multistream
        (b"\xff\xff\xff\x7f" + b"x" * 64, "no multistream answer"),  # an echo announcing 256 MiB: not read
        (encode_delim(b"/multistream/1.0.0")[:5], "no multistream answer"),  # cut short
    ],
)
async def test_a_listeners_bad_answer_is_a_clear_error_before_any_data(answer, why):
    stream = LazyStream(Scripted(answer + b"data"), ECHO)  # type: ignore[arg-type]
    with pytest.raises(StreamFailure, match=why):
        await stream.read(4)


@pytest.mark.trio
async def test_a_good_answer_is_read_once_and_the_data_follows():
    ok = encode_delim(b"/multistream/1.0.0") + encode_delim(ECHO.encode())
    stream = LazyStream(Scripted(ok + b"datamore"), ECHO)  # type: ignore[arg-type]
    assert await stream.read(4) == b"data"
    assert await stream.read(4) == b"more"


class Framed:
    """A stream whose bytes arrive in given pieces (a yamux frame each): a read returns at most what one piece
    has left, and the reads are counted (each one is a few task switches of the reader)."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = [p for p in pieces if p]
        self.reads = 0

    async def read(self, n=None):
        self.reads += 1
        if not self.pieces:
            return b""
        n = len(self.pieces[0]) if n is None or n < 0 else n
        out, rest = self.pieces[0][:n], self.pieces[0][n:]
        self.pieces = [rest, *self.pieces[1:]] if rest else self.pieces[1:]
        return out


@pytest.mark.trio
@pytest.mark.parametrize("cut", range(1, 60, 3))
async def test_echoes_and_a_reply_are_read_in_as_few_reads_as_they_arrive(cut):
    """A listener's echoes and a varint-prefixed reply, cut anywhere into two frames: read a byte at a time for
    the varint (as py-libp2p's readers do), they come whole, in no more reads than frames (the last read: the end)."""
    from libp2p.utils.varint import read_varint_prefixed_bytes_limited

    reply = b"r" * 300  # a two-byte varint
    wire = encode_delim(b"/multistream/1.0.0") + encode_delim(ECHO.encode()) + encode_delim(reply)
    raw = Framed([wire[:cut], wire[cut:]])
    stream = LazyStream(raw, ECHO)  # type: ignore[arg-type]
    assert await read_varint_prefixed_bytes_limited(stream, 1024) == reply + b"\n"  # encode_delim ends a line
    assert raw.reads <= 2
    assert await stream.read(10) == b""


def test_a_delimited_item_is_taken_only_when_whole_and_within_its_limit():
    from libp2p.exceptions import ParseError
    from libp2p.io.exceptions import MessageTooLarge

    from node.rpc import take_delimited

    item = encode_delim(b"x" * 200)  # a two-byte varint, then 201 bytes ("\n" included)
    assert take_delimited(item + b"next", 1024) == (b"x" * 200 + b"\n", len(item))
    assert all(take_delimited(item[:k], 1024) is None for k in range(len(item)))
    with pytest.raises(MessageTooLarge):
        take_delimited(item, 100)  # refused on the announced length, before the body is there
    with pytest.raises(ParseError):
        take_delimited(b"\xff" * 10, 1 << 40)
    assert take_delimited(b"\xff" * 9, 1 << 40) is None


@asynccontextmanager
async def echo_pair() -> AsyncIterator[tuple[Any, Any, StreamPool, tuple[str, str, str]]]:
    """Two hosts on loopback, b serving ECHO and a connected to it: (a, b, a fresh pool, the pool's key a -> b)."""
    a, b = build_host(create_new_key_pair()), build_host(create_new_key_pair())
    async with a.run([LISTEN]), b.run([LISTEN]):
        b.set_stream_handler(ECHO, serve("echo", echo, max_request=1024, max_reply=1024))
        await a.connect(info(b))
        yield a, b, StreamPool(), (str(a.get_id()), str(b.get_id()), ECHO)


@pytest.mark.trio
async def test_a_kept_stream_past_its_idle_time_is_closed_not_dropped():
    """A dropped stream stays in its connection for good, and in py-libp2p's host-wide stream semaphore (10,000
    slots, inbound and outbound alike: a full one makes every new stream wait). The pool once dropped stale streams
    unclosed: a sampler leasing once a minute lost a slot or two a minute, and was deaf after a few days."""
    with trio.fail_after(30):
        async with echo_pair() as (a, b, pool, key):
            for n in range(5):
                reply = await request(a, b.get_id(), ECHO, {"v": 1, "t": "echo", "n": n}, max_request=1024,
                                      max_reply=1024, pool=pool)  # fmt: skip
                assert reply["n"] == n
                for entry in pool.idle[key]:
                    entry.since -= pool.max_idle  # idle too long: the next request opens a fresh stream
            (conn,) = a.get_network().get_connections(b.get_id())
            assert len(conn.streams) == 1, conn.streams  # the one kept; the four stale ones were closed
            (server_side,) = b.get_network().get_connections(a.get_id())
            while len(server_side.streams) > 1:  # their handlers saw the close and ended them
                await trio.sleep(0.01)


@pytest.mark.trio
async def test_a_stale_streams_close_cut_short_by_the_deadline_still_frees_its_slot():
    """The stale streams are closed inside the next request's deadline. A close the deadline cuts short (a peer
    slow to acknowledge it) once left the stream in its connection, and its slot held; now it is reset."""
    with trio.fail_after(30):
        async with echo_pair() as (a, b, pool, key):
            ask = {"v": 1, "t": "echo", "n": 1}
            await request(a, b.get_id(), ECHO, ask, max_request=1024, max_reply=1024, pool=pool)
            (entry,) = pool.idle[key]
            entry.since -= pool.max_idle

            async def hangs() -> None:
                await trio.sleep_forever()

            entry.stream.close = hangs  # the close never ends: the request's deadline cuts it
            with pytest.raises(trio.TooSlowError):
                await request(a, b.get_id(), ECHO, ask, max_request=1024, max_reply=1024, timeout=0.3, pool=pool)
            (conn,) = a.get_network().get_connections(b.get_id())
            assert len(conn.streams) == 0, conn.streams  # reset: its slot is free
            reply = await request(a, b.get_id(), ECHO, ask, max_request=1024, max_reply=1024, pool=pool)
            assert reply["n"] == 1  # the connection serves on
