"""node/libp2p/patches.py: each py-libp2p 0.8.1 bug reproduced on stock code, and gone with the patch.

Hosts are real ones from ``node.host.build_host`` (TCP + Noise + yamux) on 127.0.0.1; the stock runs are the same
scenario inside ``libp2p_patches.disabled()``.
"""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import multiaddr
import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.network.connection.exceptions import RawConnError
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.network.swarm import Swarm
from libp2p.peer.peerinfo import PeerInfo
from libp2p.stream_muxer.yamux import yamux as yamux_module

from node.connmgr import ConnLimits
from node.host import build_host
from node.libp2p import patches as libp2p_patches

LISTEN = multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")
PUSH = "/swarmrl-test/push/1"


def info(host) -> PeerInfo:
    return PeerInfo(host.get_id(), [a for a in host.get_addrs() if "127.0.0.1" in str(a)])


# -- apply / unapply ------------------------------------------------------------------------------------------------


def test_apply_is_idempotent_and_reversible():
    stock_write = libp2p_patches._state["originals"].get("Yamux._write_frame") or yamux_module.Yamux._write_frame
    libp2p_patches.apply()
    patched_write = yamux_module.Yamux._write_frame
    patched_inbound = Swarm._do_handle_inbound_connection
    assert patched_write is libp2p_patches._write_frame
    assert yamux_module.MAX_MESSAGE_SIZE == 65519  # one yamux frame = one Noise message
    libp2p_patches.apply()  # a second call changes nothing (build_host calls it for every host)
    assert yamux_module.Yamux._write_frame is patched_write
    assert Swarm._do_handle_inbound_connection is patched_inbound
    with libp2p_patches.disabled():
        assert not libp2p_patches.is_applied()
        assert yamux_module.Yamux._write_frame is stock_write
        build_host(create_new_key_pair())  # its apply() call is ignored in here
        assert yamux_module.Yamux._write_frame is stock_write
    assert libp2p_patches.is_applied()
    assert yamux_module.Yamux._write_frame is patched_write
    libp2p_patches.unapply()
    libp2p_patches.unapply()
    assert yamux_module.Yamux._write_frame is stock_write
    assert yamux_module.MAX_MESSAGE_SIZE == 65536
    libp2p_patches.apply()
    assert yamux_module.Yamux._write_frame is patched_write


def test_control_queue_sums_credit_per_stream_and_bounds_replies(monkeypatch):
    monkeypatch.setattr(libp2p_patches, "MAX_QUEUED_CONTROL_FRAMES", 3)
    header = struct.Struct(yamux_module.YAMUX_HEADER_FORMAT)
    ack = header.pack(0, yamux_module.TYPE_WINDOW_UPDATE, yamux_module.FLAG_ACK, 2, 0)
    pong = header.pack(0, yamux_module.TYPE_PING, yamux_module.FLAG_ACK, 0, 7)
    queue = libp2p_patches._ControlQueue(reader=None)  # type: ignore[arg-type]
    queue.push_frame(ack, droppable=False)
    queue.add_credit(3, 1000)
    queue.add_credit(5, 10)
    queue.add_credit(3, 24)  # one frame for stream 3, carrying both increments
    assert queue.take() == ack + header.pack(0, yamux_module.TYPE_WINDOW_UPDATE, 0, 3, 1024) + header.pack(
        0, yamux_module.TYPE_WINDOW_UPDATE, 0, 5, 10
    )
    assert queue.take() == b""
    for _ in range(3):
        queue.push_frame(ack, droppable=False)
    queue.push_frame(pong, droppable=True)  # a pong beyond the bound is dropped, as go-yamux does
    with pytest.raises(RawConnError):  # a peer that never reads our ACK/RST replies is cut off
        queue.push_frame(ack, droppable=False)
    assert queue.take() == ack * 3


# -- 1. yamux: both peers pushing over one connection ---------------------------------------------------------------

STREAMS = 8  # per direction
MIB_PER_STREAM = 8
READ_PAUSE = 0.002  # the receiving handler "works" 2 ms per 64 KiB read: it lags, it never stops


async def push_both_ways(stall_after: float, limit: float) -> tuple[int, int, list[str]]:
    """8 streams each way push 8 MiB at once over one connection; returns (received, expected, errors).

    Gives up when no byte has been received for ``stall_after`` seconds, or after ``limit`` seconds.
    """
    expected = 2 * STREAMS * MIB_PER_STREAM << 20
    received = 0
    errors: list[str] = []

    async def sink(stream) -> None:
        nonlocal received
        try:
            while True:
                data = await stream.read(1 << 16)
                received += len(data)
                await trio.sleep(READ_PAUSE)
        except Exception:  # StreamEOF at the end (or a reset, which the byte count then shows)
            pass

    async def push(src, dst) -> None:
        blob = bytes(1 << 20)
        try:
            stream = await src.new_stream(dst.get_id(), [PUSH])
            for _ in range(MIB_PER_STREAM):
                await stream.write(blob)
            await stream.close()
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")

    a, b = build_host(create_new_key_pair()), build_host(create_new_key_pair())
    with trio.fail_after(limit + 20):  # the run, then closing both hosts (a deadlocked connection included)
        async with a.run([LISTEN]), b.run([LISTEN]):
            a.set_stream_handler(PUSH, sink)
            b.set_stream_handler(PUSH, sink)
            await b.connect(info(a))
            with trio.move_on_after(limit):
                async with trio.open_nursery() as nursery:

                    async def watchdog() -> None:
                        last, since = -1, trio.current_time()
                        while received < expected and trio.current_time() - since < stall_after:
                            if received != last:
                                last, since = received, trio.current_time()
                            await trio.sleep(0.1)
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(watchdog)
                    for _ in range(STREAMS):
                        nursery.start_soon(push, a, b)
                        nursery.start_soon(push, b, a)
    return received, expected, errors


@pytest.fixture
def frequent_pings(monkeypatch):
    """Yamux pings 0.5 s after a connection starts, then every 30 s, for the connection's whole life; a ping answered
    while both TCP pipes are full is what locks the stock read loops. Pinging every 50 ms makes that happen within a
    second or two instead of sometime during a long transfer (the first ping alone caught it in ~2 runs of 3 here)."""
    monkeypatch.setattr(yamux_module, "RTT_MEASURE_INTERVAL", 0.05)


async def test_stock_yamux_deadlocks_when_both_peers_push(frequent_pings):
    """The lock is a race (a pong written while both pipes are full): it usually comes within a push, and on a
    loaded box a push sometimes slips through; three tries, any one stalling, reproduce it (the patched loop never
    stalls: the next test)."""
    moved = []
    with libp2p_patches.disabled():
        for _ in range(3):
            received, expected, _ = await push_both_ways(stall_after=4.0, limit=20.0)
            moved.append(received)
            if received < expected // 2:
                break
    # both read loops sit in _write_frame (a pong) behind a writer parked in a full socket: nothing moves, ever
    assert moved[-1] < expected // 2, f"stock py-libp2p was expected to stall, yet moved {moved} of {expected} B"


async def test_patched_yamux_completes_when_both_peers_push(frequent_pings):
    libp2p_patches.apply()
    received, expected, errors = await push_both_ways(stall_after=8.0, limit=25.0)
    assert errors == []
    assert received == expected


# -- 2. inbound connection slots ------------------------------------------------------------------------------------


SLOT_LIMITS = ConnLimits(max_inbound=136)  # py-libp2p's inbound slots: max_connections (136 + 64 outbound) - 0
IDENTITIES = 250  # 50 more than the slots


async def churn(server, count: int, batch: int = 75) -> int:
    """``count`` fresh identities each connect to ``server`` and leave again, ``batch`` at a time; returns how many
    could not connect (each gets a second try, so a handshake slowed down by a loaded machine is not a refusal)."""
    refused = 0

    async def visit() -> None:
        nonlocal refused
        client = build_host(create_new_key_pair())
        async with client.run([]):
            for _ in range(2):
                try:
                    with trio.fail_after(20):
                        await client.connect(info(server))
                        await client.disconnect(server.get_id())
                    return
                except Exception:
                    await trio.sleep(0.5)
        refused += 1

    for start in range(0, count, batch):
        async with trio.open_nursery() as nursery:
            for _ in range(min(batch, count - start)):
                nursery.start_soon(visit)
    return refused


async def fresh_identity_connects(server) -> bool:
    client = build_host(create_new_key_pair())
    async with client.run([]):
        try:
            with trio.fail_after(10):
                await client.connect(info(server))
                await trio.sleep(0.3)  # a refused connection is closed right after the dial
        except Exception:
            return False
        return server.get_id() in client.get_connected_peers()


async def run_slot_scenario() -> tuple[int, int, int, bool]:
    """250 identities come and go; returns (slots, slots still held, identities refused, a newcomer connects)."""
    server = build_host(create_new_key_pair(), limits=SLOT_LIMITS)
    async with server.run([LISTEN]):
        limiter = server.get_network()._inbound_limiter
        cap = int(limiter.total_tokens)
        assert cap == 200  # max_connections - min_connections (node/libp2p/conns.py library_limits)
        refused = await churn(server, IDENTITIES)
        with trio.fail_after(10):  # the server notices every peer has gone
            while server.get_network().get_connections():
                await trio.sleep(0.1)
        with trio.move_on_after(2):  # and its connection handlers return
            while limiter.borrowed_tokens:
                await trio.sleep(0.1)
        return cap, int(limiter.borrowed_tokens), refused, await fresh_identity_connects(server)


async def test_stock_swarm_keeps_inbound_slots_of_closed_connections():
    with libp2p_patches.disabled():
        cap, held, refused, connects = await run_slot_scenario()
    assert held == cap  # every slot taken, with no connection open
    assert refused == IDENTITIES - cap
    assert not connects


async def test_patched_swarm_frees_inbound_slots_when_connections_close():
    libp2p_patches.apply()
    _, held, refused, connects = await run_slot_scenario()
    assert (held, refused) == (0, 0)
    assert connects


# -- 4. a built-in handler that raises ------------------------------------------------------------------------------

ECHO = "/swarmrl-test/echo/1"
# one gossipsub RPC frame: length 6, then field 1 (subscriptions) claiming a 4 GiB body: protobuf's DecodeError
BAD_RPC = b"\x06\x0a\xff\xff\xff\xff\x0f"


async def garbage_gossip_then_echo() -> bytes:
    """A peer sends one malformed gossipsub RPC to a node, then asks it to echo: returns the echo."""
    from libp2p.pubsub.gossipsub import PROTOCOL_ID_V11

    from node.weights.gossip import open_gossip

    server = build_host(create_new_key_pair())

    async def echo(stream) -> None:
        await stream.write(await stream.read())
        await stream.close()

    server.set_stream_handler(ECHO, echo)
    with trio.fail_after(30):
        async with server.run([LISTEN]), open_gossip(server):
            client = build_host(create_new_key_pair())
            async with client.run([]):
                await client.connect(info(server))
                bad = await client.new_stream(server.get_id(), [PROTOCOL_ID_V11])
                await bad.write(BAD_RPC)
                await trio.sleep(1.0)
                stream = await client.new_stream(server.get_id(), [ECHO])
                await stream.write(b"still here")
                return await stream.read()


async def test_stock_node_dies_of_one_malformed_gossip_rpc():
    with libp2p_patches.disabled():
        with pytest.raises(BaseException) as caught:
            await garbage_gossip_then_echo()
    assert "DecodeError" in repr(caught.value) or "DecodeError" in str(caught.getrepr())


async def test_patched_node_resets_the_stream_and_lives_on():
    libp2p_patches.apply()
    assert await garbage_gossip_then_echo() == b"still here"


# -- 3. yamux frames and Noise messages -----------------------------------------------------------------------------


def test_stock_yamux_frame_does_not_fit_one_noise_message():
    from libp2p.security.noise.io import MAX_PLAINTEXT_LENGTH

    with libp2p_patches.disabled():
        # a full frame is 17 B over one Noise message: every one goes out as two (twice the AEAD calls and reads)
        assert yamux_module.MAX_MESSAGE_SIZE - MAX_PLAINTEXT_LENGTH == 17
    libp2p_patches.apply()
    assert yamux_module.MAX_MESSAGE_SIZE == MAX_PLAINTEXT_LENGTH


# -- 1b. a cancelled write -----------------------------------------------------------------------------------------
ECHO = "/swarmrl-test/echo/1"


async def cancelled_write_then_echo() -> tuple[bool, bytes]:
    """A writes on a stream to B while the socket holds the frame (Noise's packet writer waits), and A's caller gives
    up on it (its scope cancelled); then the socket takes the frame, and A asks B for an echo on a new stream of the
    same connection. Returns (that connection still open, the echo or b"")."""
    a, b = build_host(create_new_key_pair()), build_host(create_new_key_pair())

    async def echo(stream) -> None:
        await stream.write(await stream.read(64))
        await stream.close()

    b.set_stream_handler(ECHO, echo)
    with trio.fail_after(30):
        async with a.run([LISTEN]), b.run([LISTEN]):
            await a.connect(info(b))
            conn = a.get_network().get_connections(b.get_id())[0]
            first = await a.new_stream(b.get_id(), [ECHO])
            packets = conn.muxed_conn.secured_conn.conn.read_writer  # below Noise's encryption: the socket's side
            original, held, release = packets.write_msg, trio.Event(), trio.Event()

            async def socket_busy(data: bytes) -> None:
                held.set()
                await release.wait()
                await original(data)

            packets.write_msg = socket_busy
            async with trio.open_nursery() as nursery:
                scope = trio.CancelScope()

                async def give_up_on_a_write() -> None:
                    with scope:
                        await first.write(b"given up on")

                nursery.start_soon(give_up_on_a_write)
                await held.wait()  # encrypted (its nonce spent), not yet on the wire
                scope.cancel()  # delivered at once where nothing shields the wait (trio aborts it on the spot)
                packets.write_msg = original
                release.set()
            try:
                with trio.fail_after(5):
                    second = await a.new_stream(b.get_id(), [ECHO])
                    await second.write(b"ping")
                    answer = await second.read(64)
            except Exception:
                answer = b""
            if not answer:  # no echo: give A's read loop time to see the end B put to the connection (a loaded box)
                with trio.move_on_after(10):
                    await conn.muxed_conn.event_closed.wait()
            return not conn.muxed_conn.is_closed, answer


async def test_stock_yamux_loses_the_connection_when_a_write_is_cancelled():
    with libp2p_patches.disabled():
        alive, answer = await cancelled_write_then_echo()
    # B could not decrypt what came after the lost message ("Failed authentication of message", logged at debug)
    assert not alive and answer == b""


async def test_patched_yamux_finishes_a_cancelled_write_and_keeps_the_connection():
    alive, answer = await cancelled_write_then_echo()
    assert alive and answer == b"ping"


# -- 1c. a cancelled close -----------------------------------------------------------------------------------------
ASK = "/swarmrl-test/ask/1"


@asynccontextmanager
async def serving_pair(protocol: str, handler) -> AsyncIterator[tuple[Any, Any, Any]]:
    """Two hosts on loopback, B serving ``protocol`` with ``handler`` and A connected to it: (A, B, A's connection)."""
    a, b = build_host(create_new_key_pair()), build_host(create_new_key_pair())
    b.set_stream_handler(protocol, handler)
    async with a.run([LISTEN]), b.run([LISTEN]):
        await a.connect(info(b))
        yield a, b, a.get_network().get_connections(b.get_id())[0]


async def questions_given_up(count: int = 3) -> tuple[int, int, list[bool]]:
    """A asks B ``count`` questions at once, the way py-libp2p's DHT does (``finally: await stream.close()``), and
    gives up on each (its scope cancelled) once B has read it; B answers late, waits for A's end of the stream, and
    ends its own. Returns, once A has read B's ends: A's backlog slots still taken on the connection, A's streams
    still counted on it, and whether each of B's handlers saw A's end (its FIN)."""
    asked, given_up, answered = trio.Event(), trio.Event(), trio.Event()
    saw_end: list[bool] = []
    read = [0]

    async def answer_late(stream) -> None:
        await stream.read(64)
        read[0] += 1
        if read[0] == count:
            asked.set()
        await given_up.wait()
        await stream.write(b"late")
        saw = False
        with trio.move_on_after(5):
            try:
                saw = await stream.read(64) == b""
            except StreamEOF:
                saw = True
        saw_end.append(saw)
        await stream.close()
        if len(saw_end) == count:
            answered.set()

    with trio.fail_after(30):
        async with serving_pair(ASK, answer_late) as (a, b, conn):
            scopes = [trio.CancelScope() for _ in range(count)]

            async def ask(scope: trio.CancelScope) -> None:
                with scope:
                    stream = await a.new_stream(b.get_id(), [ASK])
                    try:
                        await stream.write(b"question")
                        await stream.read(64)
                    finally:
                        await stream.close()

            async with trio.open_nursery() as nursery:
                for scope in scopes:
                    nursery.start_soon(ask, scope)
                await asked.wait()
                for scope in scopes:
                    scope.cancel()
            given_up.set()
            await answered.wait()
            while not all(s.recv_closed for s in conn.muxed_conn.streams.values()):
                await trio.sleep(0.01)
            taken = conn.muxed_conn.stream_backlog_limit - conn.muxed_conn.stream_backlog_semaphore.value
            return taken, len(conn.get_streams()), saw_end


async def test_stock_yamux_keeps_the_slot_of_a_stream_closed_when_cancelled():
    with libp2p_patches.disabled():
        taken, counted, saw_end = await questions_given_up()
    # no FIN went out, and the slots stay taken for the connection's life: 256 such questions and it opens no stream
    assert (taken, counted, saw_end) == (3, 3, [False, False, False])


async def test_patched_yamux_settles_a_stream_closed_when_cancelled():
    taken, counted, saw_end = await questions_given_up()
    assert (taken, counted, saw_end) == (0, 0, [True, True, True])


async def test_a_closed_streams_frames_still_reach_the_peer_before_its_end():
    """The FIN waits its turn for the write lock: a frame of the stream already waiting for it goes first."""
    got: list[bytes] = []
    done = trio.Event()

    async def collect(stream) -> None:
        try:
            while data := await stream.read(64):
                got.append(data)
        except StreamEOF:
            pass
        done.set()

    with trio.fail_after(30):
        async with serving_pair(ASK, collect) as (a, b, conn):
            stream = await a.new_stream(b.get_id(), [ASK])
            async with trio.open_nursery() as nursery:
                async with conn.muxed_conn._write_lock:  # the wire busy: the write and the FIN both wait
                    nursery.start_soon(stream.write, b"before the end")
                    await trio.testing.wait_all_tasks_blocked()
                    await stream.close()
            await done.wait()
    assert b"".join(got) == b"before the end"


# -- 8. window credit ----------------------------------------------------------------------------------------------
async def credits_for_one_transfer(read_size: int, nbytes: int = 4 << 20) -> tuple[int, int]:
    """One stream carrying ``nbytes``, read ``read_size`` bytes at a time: (bytes received, window updates sent)."""
    received, updates = 0, 0
    done = trio.Event()
    send_window_update = yamux_module.YamuxStream.send_window_update

    async def counting(self, increment: int, skip_lock: bool = False) -> None:
        nonlocal updates
        updates += increment > 0
        await send_window_update(self, increment, skip_lock)

    async def sink(stream) -> None:
        nonlocal received
        try:
            while received < nbytes:
                received += len(await stream.read(read_size))
        finally:
            done.set()

    a, b = build_host(create_new_key_pair()), build_host(create_new_key_pair())
    with trio.fail_after(60):
        async with a.run([LISTEN]), b.run([LISTEN]):
            b.set_stream_handler(PUSH, sink)
            await a.connect(info(b))
            yamux_module.YamuxStream.send_window_update = counting  # type: ignore[method-assign]
            try:
                stream = await a.new_stream(b.get_id(), [PUSH])
                blob = bytes(1 << 16)
                for _ in range(nbytes // len(blob)):
                    await stream.write(blob)
                await done.wait()
            finally:
                yamux_module.YamuxStream.send_window_update = send_window_update  # type: ignore[method-assign]
    return received, updates


async def test_stock_yamux_sends_a_window_update_per_read():
    """4 MiB read 16 KiB at a time: stock py-libp2p credits the sender after (nearly) every read, 256 reads; the
    patch, go-yamux's rule, once half the window is owed (a few here: the first read opens the window to 4 MiB), and
    every byte still arrives."""
    with libp2p_patches.disabled():
        received, stock = await credits_for_one_transfer(16 << 10)
    assert received == 4 << 20
    assert stock >= 200, stock
    libp2p_patches.apply()
    received, ours = await credits_for_one_transfer(16 << 10)
    assert received == 4 << 20
    assert ours <= 40, ours
    received, _ = await credits_for_one_transfer(1 << 10, nbytes=1 << 20)  # reads far smaller than a frame
    assert received == 1 << 20


async def test_the_read_loop_notes_when_it_last_read_and_stock_does_not():
    """What the keepalive asks before it calls a connection dead (node/connmgr.py ``pong_overdue``)."""
    from node.discovery import role_cid
    from node.host import open_swarm
    from node.libp2p import providers_from_peer
    from node.libp2p.conns import last_read

    async def stamps() -> tuple[float, float, float]:
        async with open_swarm(create_new_key_pair(), LISTEN) as a, open_swarm(create_new_key_pair(), LISTEN) as b:
            await a.connect(PeerInfo(b.peer_id, b.addrs()))
            conn = a.host.get_network().get_connections(b.peer_id)[0]
            first, before = last_read(conn), trio.current_time()
            await providers_from_peer(a.dht, b.peer_id, role_cid("test", "trainer"))  # its answer is read on conn
            return first, before, last_read(conn)

    with trio.fail_after(30):
        with libp2p_patches.disabled():
            first, _, last = await stamps()
        assert first == last == 0.0  # stock py-libp2p keeps no such time
        libp2p_patches.apply()
        first, before, last = await stamps()
        assert 0 < first <= before <= last


async def test_the_path_rtt_is_the_kernels_from_the_handshake_on_not_the_first_ping():
    """What the origin's push_copies weighs (node/libp2p/conns.py ``path_rtt``): known as soon as a connection is
    up, and not moved by a keepalive pong answered late."""
    from node.host import open_swarm
    from node.libp2p.conns import kernel_min_rtt, path_rtt

    with trio.fail_after(30):
        async with open_swarm(create_new_key_pair(), LISTEN) as a, open_swarm(create_new_key_pair(), LISTEN) as b:
            await a.connect(PeerInfo(b.peer_id, b.addrs()))
            network = a.host.get_network()
            conn = network.get_connections(b.peer_id)[0]
            assert conn.muxed_conn.rtt() == 0.0  # yamux's first ping goes out 0.5 s after the start
            kernel = kernel_min_rtt(conn)
            assert 0 < kernel < 0.05  # loopback: microseconds
            assert path_rtt(network, b.peer_id) == kernel
            conn.muxed_conn._rtt = 0.9  # a late pong averaged in: the kernel's minimum stands
            assert path_rtt(network, b.peer_id) <= kernel_min_rtt(conn) < 0.05


async def test_the_kernel_says_when_a_peers_bytes_last_came_read_or_not():
    """What the keepalive asks besides our read loop (node/connmgr.py): a loop starved past the timeout has not read
    the pong waiting in its socket, but the kernel received it (tcpi_last_data_recv counts arrival, not reads)."""
    from node.discovery import role_cid
    from node.host import open_swarm
    from node.libp2p import providers_from_peer
    from node.libp2p.conns import kernel_last_data

    with trio.fail_after(30):
        async with open_swarm(create_new_key_pair(), LISTEN) as a, open_swarm(create_new_key_pair(), LISTEN) as b:
            await a.connect(PeerInfo(b.peer_id, b.addrs()))
            conn = a.host.get_network().get_connections(b.peer_id)[0]
            await trio.sleep(0.7)  # past yamux's first ping (0.5 s in); the next is 30 s away
            await providers_from_peer(a.dht, b.peer_id, role_cid("test", "trainer"))  # b's answer came just now
            came = kernel_last_data(conn, trio.current_time())
            assert 0 <= trio.current_time() - came < 0.5
            await trio.sleep(0.4)  # nothing from b meanwhile
            now = trio.current_time()
            assert 0.35 < now - kernel_last_data(conn, now) < 2.0  # the kernel's clock, not "now"


# -- 5. TCP and circuit addresses -----------------------------------------------------------------------------------


def test_stock_tcp_claims_circuit_addresses():
    from libp2p.peer.id import ID
    from libp2p.transport.tcp.tcp import TCP

    relay, target = (ID.from_pubkey(create_new_key_pair().public_key) for _ in range(2))
    circuit = multiaddr.Multiaddr(f"/ip4/127.0.0.1/tcp/4001/p2p/{relay}/p2p-circuit/p2p/{target}")
    direct = multiaddr.Multiaddr(f"/ip4/127.0.0.1/tcp/4001/p2p/{target}")
    with libp2p_patches.disabled():
        assert TCP().can_dial(circuit)  # the swarm would dial the relay expecting the target
    libp2p_patches.apply()
    assert not TCP().can_dial(circuit)
    assert TCP().can_dial(direct)


# -- subclass overrides (node/libp2p/nat.py, node/libp2p/access.py) -------------------------------------------------


def closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_stock_autonat_dial_back_reuses_the_existing_connection():
    """The dial-back request arrives on a connection, so ``host.connect`` succeeds without dialing: the server
    reports an address nobody listens on as reachable. ``DialBack`` dials a fresh connection."""
    from libp2p.host.autonat.autonat import AutoNATService

    from node.libp2p import DialBack

    server, client = build_host(create_new_key_pair()), build_host(create_new_key_pair())
    nobody = multiaddr.Multiaddr(f"/ip4/127.0.0.1/tcp/{closed_port()}").to_bytes()
    with trio.fail_after(30):
        async with server.run([LISTEN]), client.run([]):
            await client.connect(info(server))
            stock = AutoNATService(server, serve=False)
            assert await stock._try_dial(client.get_id(), [nobody]) == nobody  # "reachable" at a closed port
            ours = DialBack(server, every=5.0, timeout=5.0)
            assert await ours._try_dial(client.get_id(), [nobody]) is None


def test_stock_autonat_never_dials_a_node_listening_on_a_private_address():
    from libp2p.host.autonat.autonat import AutoNATService

    from node.libp2p import DialBack

    behind_nat = [multiaddr.Multiaddr(a).to_bytes() for a in ("/ip4/192.168.1.5/tcp/4001", "/ip4/0.0.0.0/tcp/4001")]
    assert AutoNATService._filter_by_observed_ip(behind_nat, "203.0.113.7") == []  # nothing to dial: no verdict
    ours = [str(multiaddr.Multiaddr(a)) for a in DialBack._filter_by_observed_ip(behind_nat, "203.0.113.7")]
    assert ours == ["/ip4/203.0.113.7/tcp/4001"]


class EndedStream:
    """A stream whose peer has closed its end: every read raises StreamEOF, as py-libp2p's yamux streams do."""

    def __init__(self) -> None:
        self.reads = 0

    async def read(self, n: int | None = None) -> bytes:
        from libp2p.network.stream.exceptions import StreamEOF

        self.reads += 1
        raise StreamEOF("closed")


async def test_stock_relay_retries_a_yamux_eof():
    from libp2p.network.stream.exceptions import StreamEOF
    from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
    from libp2p.relay.circuit_v2.resources import RelayLimits

    from node.libp2p import RelayHop

    limits = RelayLimits(duration=60, data=1 << 20, max_circuit_conns=4, max_reservations=4, reservation_ttl=60)
    hop = RelayHop(build_host(create_new_key_pair()), limits, allow_hop=True)
    stream = EndedStream()
    started = trio.current_time()
    with pytest.raises(StreamEOF):  # an EOF (the circuit's normal end) raised, after three reads and 0.6 s asleep
        await CircuitV2Protocol._read_stream_with_retry(hop, stream)  # type: ignore[arg-type]
    assert stream.reads == 3 and trio.current_time() - started >= 0.6
    stream = EndedStream()
    assert await hop._read_stream_with_retry(stream) is None  # type: ignore[arg-type]
    assert stream.reads == 1


async def test_stock_find_providers_answers_from_the_local_store_alone():
    """A node holding one record for a key never asks the DHT again: a provider its connected peer knows of stays
    unknown to it. ``providers_from_peer`` asks that peer directly (node/discovery.py asks the trusted peers)."""
    from libp2p.kad_dht.kad_dht import _encode_key
    from libp2p.peer.id import ID

    from node.discovery import role_cid
    from node.host import open_swarm
    from node.libp2p import providers_from_peer

    cid = role_cid("test", "trainer")
    known, other = (ID.from_pubkey(create_new_key_pair().public_key) for _ in range(2))
    somewhere = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/4001")]
    with trio.fail_after(30):
        async with open_swarm(create_new_key_pair(), LISTEN) as a, open_swarm(create_new_key_pair(), LISTEN) as b:
            await a.connect(PeerInfo(b.peer_id, b.addrs()))
            a.dht.provider_store.add_provider(_encode_key(cid), PeerInfo(known, somewhere))
            b.dht.provider_store.add_provider(_encode_key(cid), PeerInfo(other, somewhere))
            assert [p.peer_id for p in await a.dht.find_providers(cid)] == [known]
            assert [p.peer_id for p in await providers_from_peer(a.dht, b.peer_id, cid)] == [other]


def test_every_patch_names_an_upstream_report_and_a_test_that_exist():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for patch in libp2p_patches.PATCHES:
        assert patch.report.is_file(), f"{patch.name}: no {patch.report}"
        path, _, test = patch.test.partition("::")
        assert f"def {test.split()[0]}(" in (root / path).read_text(), patch.test
        assert patch.install is None or patch.install[1] in patch.target, patch.name
    sent = {p.report.name for p in libp2p_patches.PATCHES}
    assert sent == {p.name for p in (root / "docs" / "upstream").glob("libp2p-*.md")}  # no report without a patch


def _provider_store() -> tuple[Any, list[Any]]:
    from libp2p.kad_dht.provider_store import ProviderStore
    from libp2p.peer.id import ID

    class Host:
        def __init__(self) -> None:
            self.connected: list[Any] = []

        def get_id(self) -> Any:
            return ID.from_pubkey(create_new_key_pair().public_key)

        def get_connected_peers(self) -> list[Any]:
            return self.connected

    peers = [ID.from_pubkey(create_new_key_pair().public_key) for _ in range(30)]
    return ProviderStore(Host()), peers


def test_stock_provider_store_keeps_the_first_twenty_providers_only():
    """Every peer provides a role's key: the stock store keeps the first 20 (48 h) and gives all 20 to every
    lookup, so every newcomer dialled the same 20 samplers. Ours keeps them all and answers a sample."""
    from libp2p.kad_dht.kad_dht import _encode_key

    from node.libp2p import providers

    key = _encode_key("bafkreigc2gtfxkff24ufrfysbpkazzp2wev7d5fryk4flvi3tv3g2uloey")
    somewhere = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/4001")]
    with libp2p_patches.disabled():
        store, peers = _provider_store()
        for peer in peers:
            store.add_provider(key, PeerInfo(peer, somewhere))
        assert {p.peer_id for p in store.get_providers(key)} == set(peers[:20])
    libp2p_patches.apply()
    store, peers = _provider_store()
    for peer in peers:
        store.add_provider(key, PeerInfo(peer, somewhere))
    assert len(store.providers[key]) == 30
    answers = [{p.peer_id for p in store.get_providers(key)} for _ in range(20)]
    assert all(len(a) == min(30, providers.ANSWER_MOST) for a in answers)
    assert set().union(*answers) == set(peers)  # every provider is given to someone


def test_a_full_key_replaces_its_oldest_idle_record_and_keeps_connected_providers(monkeypatch):
    from libp2p.kad_dht.kad_dht import _encode_key

    from node.libp2p import providers

    libp2p_patches.apply()
    monkeypatch.setattr(providers, "PROVIDERS_PER_KEY", 4)
    monkeypatch.setattr(providers, "ANSWER_MOST", 3)
    key = _encode_key("bafkreigc2gtfxkff24ufrfysbpkazzp2wev7d5fryk4flvi3tv3g2uloey")
    store, peers = _provider_store()
    somewhere = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/4001")]
    store.host.connected = [peers[0], peers[2]]
    for peer in peers[:4]:
        store.add_provider(key, PeerInfo(peer, somewhere))
    store.providers[key][str(peers[1])].timestamp -= 10  # the oldest idle one
    store.add_provider(key, PeerInfo(peers[4], somewhere))
    assert set(store.providers[key]) == {str(p) for p in (peers[0], peers[2], peers[3], peers[4])}
    assert {p.peer_id for p in store.get_providers(key)} >= {peers[0], peers[2]}  # the connected ones first
    store.host.connected = list(peers)
    store.add_provider(key, PeerInfo(peers[5], somewhere))  # every holder connected: refused
    assert str(peers[5]) not in store.providers[key] and len(store.providers[key]) == 4


def test_room_for_a_provider_and_the_sample_of_an_answer_are_decided_by_pure_rules():
    import random

    from node.libp2p.providers import answer_sample, make_room

    held = {"a": 1.0, "b": 0.5, "c": 2.0}
    assert make_room(held, set(), "d", 4) == (True, None)  # room left
    assert make_room(held, set(), "a", 3) == (True, None)  # held already: updated in place
    assert make_room(held, {"b"}, "d", 3) == (True, "a")  # the oldest not connected goes
    assert make_room(held, {"a", "b", "c"}, "d", 3) == (False, None)  # all alive: refused
    rng = random.Random(1)
    sample = answer_sample(list(range(10)), lambda p: p >= 8, 4, rng)
    assert len(sample) == 4 and set(sample[:2]) == {8, 9}
    assert answer_sample([1, 2], lambda p: False, 4, rng) in ([1, 2], [2, 1])


class _SilentHost:
    """Just what a routing table and its walks ask of a host; every stream opened to a peer waits forever (a
    peer that never answers in time, as every one did for py-libp2p's own walks at N = 256, bench/swarm_scale)."""

    def __init__(self) -> None:
        from libp2p.peer.id import ID
        from libp2p.peer.peerstore import PeerStore

        self.me = ID.from_pubkey(create_new_key_pair().public_key)
        self.store, self.opened = PeerStore(), 0

    def get_id(self):
        return self.me

    def get_peerstore(self):
        return self.store

    def get_connected_peers(self) -> list:
        return []

    async def new_stream(self, peer, protocols):
        self.opened += 1
        await trio.sleep_forever()


async def _silent_routing(peers: int = 120):
    """A PeerRouting over a real routing table holding ``peers`` random peers (several buckets), none answering."""
    from libp2p.kad_dht.peer_routing import PeerRouting
    from libp2p.kad_dht.routing_table import RoutingTable
    from libp2p.peer.id import ID

    host = _SilentHost()
    table = RoutingTable(host.me, host, max_peers_per_subnet=0)  # type: ignore[arg-type]
    for _ in range(peers):
        peer = ID.from_pubkey(create_new_key_pair().public_key)
        addrs = [multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/4001")]
        host.store.add_addrs(peer, addrs, 3600)
        await table.add_peer(PeerInfo(peer, addrs), skip_server_mode_check=True)
    return PeerRouting(host, table), host  # type: ignore[arg-type]


def _count_walks(monkeypatch) -> list[bytes]:
    """The target key of every walk (py-libp2p's own walk, unchanged by any patch), in order."""
    from libp2p.kad_dht.peer_routing import PeerRouting

    walks: list[bytes] = []
    walk = PeerRouting.find_closest_peers_network

    async def counted(self, target_key: bytes, count: int = 20):
        walks.append(target_key)
        return await walk(self, target_key, count)

    monkeypatch.setattr(PeerRouting, "find_closest_peers_network", counted)
    return walks


async def test_stock_refresh_walks_every_bucket_when_no_peer_answers(monkeypatch, autojump_clock):
    """No peer of the table answers: the stock refresh still walks for its own id and a key in every non-empty
    bucket, each walk asking its closest peers again. Ours ends the round after the first walk."""
    walks = _count_walks(monkeypatch)
    with libp2p_patches.disabled():
        routing, host = await _silent_routing()
        buckets = sum(1 for b in routing.routing_table.buckets if b.size() > 0)
        assert buckets >= 3
        await routing.refresh_routing_table()
        assert len(walks) == 1 + buckets and host.opened >= 2 * (1 + buckets)
        stock_opened = host.opened
    walks.clear()
    libp2p_patches.apply()
    routing, host = await _silent_routing()
    await routing.refresh_routing_table()
    assert walks == [host.me.to_bytes()]  # its own id, then the round ended
    assert 0 < host.opened < stock_opened / 2


async def test_a_refresh_round_walks_on_while_walks_are_answered_and_ends_at_the_first_that_is_not(
    monkeypatch, autojump_clock
):
    from node.libp2p import routing as routing_mod

    assert routing_mod.go_on(1) and not routing_mod.go_on(0)
    libp2p_patches.apply()
    walks = _count_walks(monkeypatch)
    routing, host = await _silent_routing()
    buckets = [b for b in routing.routing_table.buckets if b.size() > 0]
    somebody = buckets[0].peer_ids()[0]

    async def answers(self, peer, target_key: bytes):  # every peer answers: the table refreshes as upstream's
        return [somebody]

    monkeypatch.setattr(routing_mod, "_stock_query", answers)
    await routing.refresh_routing_table()
    assert len(walks) == 1 + len(buckets) and walks[0] == host.me.to_bytes()
    assert [next(i for i, b in enumerate(buckets) if b.key_in_range(k)) for k in walks[1:]] == list(range(len(buckets)))

    walks.clear()
    second = buckets[1]

    async def up_to_the_second_bucket(self, peer, target_key: bytes):  # the walk in the second bucket: no answer
        return [] if second.key_in_range(target_key) else [somebody]

    monkeypatch.setattr(routing_mod, "_stock_query", up_to_the_second_bucket)
    await routing.refresh_routing_table()
    assert len(walks) == 3 and second.key_in_range(walks[-1])


async def test_a_refresh_walk_that_finds_a_peer_the_peerstore_does_not_hold_goes_on(monkeypatch, autojump_clock):
    """py-libp2p's peerstore raises for a peer it holds no record of: one such peer in a walk's answer must not end
    the round (nor the DHT's maintenance loop) with an exception."""
    from libp2p.peer.id import ID

    from node.libp2p import routing as routing_mod

    libp2p_patches.apply()
    walks = _count_walks(monkeypatch)
    routing, _ = await _silent_routing()
    stranger = ID.from_pubkey(create_new_key_pair().public_key)  # named by an answer, in no peerstore

    async def answers(self, peer, target_key: bytes):
        return [stranger]

    monkeypatch.setattr(routing_mod, "_stock_query", answers)
    await routing.refresh_routing_table()
    assert len(walks) == 1 + sum(1 for b in routing.routing_table.buckets if b.size() > 0)
