"""Weights over the swarm: bit-exact delivery to several samplers, swarming that spares the trainer's upload,
new versions hot-swapped in, a corrupt-chunk peer detected and routed around, forged manifests refused."""

from __future__ import annotations

from contextlib import AsyncExitStack

import torch
import trio
from libp2p.crypto.keys import KeyPair
from libp2p.peer.peerinfo import info_from_p2p_addr

from node.host import open_swarm
from node.identity import load_or_create_key
from node.rpc import request, serve
from node.weights.gossip import announce_topic
from node.weights.manifest import sign_manifest
from node.weights.store import ChunkStore
from protocols import weights as w
from tests.helpers import LOOPBACK, start_bootstrap, start_sampler, start_trainer, wait_until

CHUNK = 16 << 10
NO_TRAINING = 1 << 30  # a batch never fills: versions change only when a test says so


def weights_bytes(store: ChunkStore, version: int) -> bytes:
    return (store.versions_dir / f"v{version}" / "model.safetensors").read_bytes()


async def trainer_and_samplers(nursery, tmp_path, tiny_model_dir, n: int):
    """A trainer that publishes only when a test says so, and ``n`` samplers running its first version."""
    boot = await start_bootstrap(nursery, tmp_path)
    trainer = await start_trainer(
        nursery, tmp_path, boot, tiny_model_dir, weights={"chunk_size": CHUNK}, batch_groups=NO_TRAINING
    )
    samplers = [await start_sampler(nursery, tmp_path, f"s{i}", boot) for i in range(n)]
    await wait_until(lambda: all(s.role.engine_ready.is_set() for s in samplers), timeout=60)
    return trainer, samplers


async def test_versions_reach_every_sampler_bit_exact_and_swarm(tmp_path, tiny_model_dir):
    async with trio.open_nursery() as nursery:
        trainer, samplers = await trainer_and_samplers(nursery, tmp_path, tiny_model_dir, 3)
        _, _, m0 = trainer.role.store.latest()
        reference = (await trio.to_thread.run_sync(trainer.role.store.assemble, m0)) / "model.safetensors"
        for s in samplers:
            assert weights_bytes(s.role.store, 0) == reference.read_bytes()
            assert s.role.engine.version == 0
        uploaded = trainer.role.weight_server.bytes_served
        # served on request, or relayed as pushed (a sampler that joined before version 0 went out got it by push)
        served_by_samplers = sum(s.role.weight_server.bytes_served + s.role.weights.relayed_bytes for s in samplers)
        assert uploaded + served_by_samplers >= 3 * m0.total_size * 0.99
        assert served_by_samplers > 0, "samplers must re-serve chunks to each other"
        assert uploaded < 2.5 * m0.total_size, (uploaded, m0.total_size)

        # a new version: only changed tensors are new content, and every engine hot-swaps to it
        with torch.no_grad():
            trainer.role.learner.model.model.layers[0].self_attn.q_proj.weight.mul_(-1.0)
        before = trainer.role.weight_server.bytes_served
        trainer.role.learner.new_version()
        await trainer.role.publish()
        await wait_until(
            lambda: all(s.role.engine is not None and s.role.engine.version == 1 for s in samplers), timeout=30
        )
        _, _, m1 = trainer.role.store.latest()
        new_bytes = sum(len(trainer.role.store.read(h)) for h in set(m1.all_chunks()) - set(m0.all_chunks()))
        assert new_bytes < 0.1 * m1.total_size
        assert trainer.role.weight_server.bytes_served - before <= 3 * new_bytes + 3 * 4096
        for s in samplers:
            assert (s.role.store.versions_dir / "v1").exists()
        nursery.cancel_scope.cancel()


async def test_samplers_that_heard_other_holders_keep_their_installs_quiet(tmp_path, tiny_model_dir, monkeypatch):
    """Trickle's suppression (node/weights/policy.py announce_installed), here with a redundancy of 1: a sampler
    that heard another sampler announce a version before installing it does not gossip its own install. Without the
    rule every sampler announces every version (4 per version here): O(N^2) messages per version over a swarm."""
    from node.weights import policy

    monkeypatch.setattr(policy, "ANNOUNCE_REDUNDANCY", 1)
    async with trio.open_nursery() as nursery:
        trainer, samplers = await trainer_and_samplers(nursery, tmp_path, tiny_model_dir, 4)
        versions = 3
        for v in range(1, versions):
            with torch.no_grad():
                trainer.role.learner.model.model.layers[0].self_attn.q_proj.weight.mul_(-1.0)
            trainer.role.learner.new_version()
            await trainer.role.publish()
            await wait_until(
                lambda v=v: all(s.role.engine is not None and s.role.engine.version == v for s in samplers),
                timeout=30,
            )
        announced = sum(s.role.weights.announced for s in samplers)
        print(f"{announced} announcements of {versions} versions by 4 samplers")
        assert 1 <= announced < 4 * versions, f"{announced} announcements of {versions} versions by 4 samplers"
        nursery.cancel_scope.cancel()


async def test_corrupt_chunks_and_forged_manifests_are_refused(tmp_path, tiny_model_dir):
    async with trio.open_nursery() as nursery, AsyncExitStack() as stack:
        boot = await start_bootstrap(nursery, tmp_path)
        trainer = await start_trainer(
            nursery, tmp_path, boot, tiny_model_dir, weights={"chunk_size": CHUNK}, batch_groups=NO_TRAINING
        )
        await wait_until(lambda: trainer.role.published is not None, timeout=30)
        _, _, m0 = trainer.role.store.latest()
        key = load_or_create_key(tmp_path / "evil.key")
        evil = await stack.enter_async_context(open_swarm(key, LOOPBACK))
        gossip = evil.gossip
        forged = sign_manifest(
            w.Manifest(m0.swarm, 99, 0, m0.encoding, m0.chunk_size, m0.files, m0.tensors),
            KeyPair(key.private_key, key.public_key),
        )
        served_bad = []

        async def evil_handler(message, remote):
            kind, arg = w.parse_request(message)
            if kind == "get_have":
                return w.have_reply(arg, b"\xff" * ((len(m0.all_chunks()) + 7) // 8))
            if kind == "get_manifest":
                return forged.to_wire()
            bad = [(h, trainer.role.store.read(h)[::-1] + b"!") for h in arg]
            served_bad.extend(arg)
            return w.chunks_reply(bad, [])

        evil.host.set_stream_handler(w.PROTOCOL_ID, serve("evil", evil_handler, 1 << 16, w.MAX_REPLY_FRAME))
        await evil.connect(info_from_p2p_addr(boot.swarm.addrs()[0]))
        sampler = await start_sampler(nursery, tmp_path, "s0", boot)
        await evil.connect(info_from_p2p_addr(sampler.swarm.addrs()[0]))
        await wait_until(lambda: sampler.role.engine_ready.is_set(), timeout=60)
        assert served_bad, "the corrupt peer was never asked: the test proves nothing"
        # then it announces a version it signed itself (each under a different manifest id)
        for k in range(5):
            await gossip.publish(announce_topic("test"), w.announce(99, bytes([k + 1]) * 32))
            await trio.sleep(0.3)
        await wait_until(lambda: sampler.role.weights.strikes.is_banned(evil.peer_id), 30, what="the evil peer's ban")
        assert sampler.role.weights.forged_manifests >= 1
        assert sampler.role.engine.version == 0
        reference = await trio.to_thread.run_sync(trainer.role.store.assemble, m0)
        assert weights_bytes(sampler.role.store, 0) == (reference / "model.safetensors").read_bytes()
        nursery.cancel_scope.cancel()


async def test_download_killed_midway_resumes_from_what_is_on_disk(tmp_path, tiny_model_dir):
    from node.strikes import Strikes
    from node.weights.fetcher import Download
    from node.weights.policy import FetchSettings

    async with trio.open_nursery() as nursery, AsyncExitStack() as stack:
        boot = await start_bootstrap(nursery, tmp_path)
        trainer = await start_trainer(
            nursery, tmp_path, boot, tiny_model_dir, weights={"chunk_size": 4 << 10}, batch_groups=NO_TRAINING
        )
        await wait_until(lambda: trainer.role.published is not None, timeout=30)
        mid, signed, manifest = trainer.role.store.latest()
        me = await stack.enter_async_context(open_swarm(load_or_create_key(tmp_path / "me.key"), LOOPBACK))
        await me.connect(info_from_p2p_addr(trainer.swarm.addrs()[0]))
        total = len(manifest.all_chunks())

        store = ChunkStore(tmp_path / "me")
        store.add_manifest(signed, manifest)
        first = Download(
            me.host,
            store,
            manifest,
            mid,
            trainer.swarm.peer_id,
            lambda: [],
            Strikes(2),
            FetchSettings(workers_per_peer=1, batch=1),
        )
        with trio.move_on_after(30):
            async with trio.open_nursery() as inner:
                inner.start_soon(first.run)
                await wait_until(lambda: len(first.missing) < total // 2, timeout=30, interval=0.001)
                inner.cancel_scope.cancel()  # the "kill": mid-transfer, requests in flight
        got_first = sum(first.stats.bytes_by_peer.values())
        assert 0 < got_first < manifest.total_size

        restarted = ChunkStore(tmp_path / "me")  # a fresh process would see exactly this
        assert restarted.manifest(mid) is not None
        left = restarted.missing(manifest)
        assert 0 < len(left) < total
        second = Download(me.host, restarted, manifest, mid, trainer.swarm.peer_id, lambda: [], Strikes(2))
        await second.run()
        assert sum(second.stats.bytes_by_peer.values()) == sum(len(trainer.role.store.read(h)) for h in left)
        out = restarted.assemble(manifest)
        assert (out / "model.safetensors").read_bytes() == (tiny_model_dir / "model.safetensors").read_bytes()
        nursery.cancel_scope.cancel()


async def test_a_download_that_stalls_is_abandoned_for_the_newest_version(tmp_path, tiny_model_dir):
    """The last chunks of a mostly-done version vanish everywhere (garbage-collected): the sampler must not wait
    for them forever, but move on to the newer version once the download stops moving."""
    async with trio.open_nursery() as nursery:
        boot = await start_bootstrap(nursery, tmp_path)
        trainer = await start_trainer(
            nursery, tmp_path, boot, tiny_model_dir, weights={"chunk_size": 4 << 10}, batch_groups=NO_TRAINING
        )
        await wait_until(lambda: trainer.role.published is not None, timeout=30)
        _, _, m0 = trainer.role.store.latest()
        weights = next(f for f in m0.files if f.path == "model.safetensors").chunks
        gone = weights[len(weights) // 2 : len(weights) // 2 + 3]  # tensor data, not the (shared) header
        for h in gone:
            trainer.role.store.drop(h)
        sampler = await start_sampler(nursery, tmp_path, "s0", boot, engine="torch")
        sampler.role.weights.settings.stall_timeout = 1.0
        await wait_until(
            lambda: sampler.role.weights.download is not None and sampler.role.weights.download.fraction_done() > 0.9,
            timeout=60,
        )
        await trio.sleep(1.0)
        assert sampler.role.engine is None  # version 0 can never complete
        with torch.no_grad():
            for p in trainer.role.learner.model.parameters():
                p.mul_(1.01)
        trainer.role.learner.new_version()
        await trainer.role.publish()
        await wait_until(lambda: sampler.role.engine is not None and sampler.role.engine.version == 1, timeout=30)
        nursery.cancel_scope.cancel()


async def test_a_peer_withholding_chunks_it_claims_cannot_stall_distribution(tmp_path, tiny_model_dir):
    """Issue 17, 2: a peer claims every chunk, holds each request 19 s, then says "missing". Before: downloads
    stalled (installs up to 74 s), the peer never earned a strike. Now: the origin serves what only it is asked for
    after a second without progress, the slow peer is dropped and struck."""
    async with trio.open_nursery() as nursery, AsyncExitStack() as stack:
        boot = await start_bootstrap(nursery, tmp_path)
        trainer = await start_trainer(
            nursery, tmp_path, boot, tiny_model_dir, weights={"chunk_size": CHUNK}, batch_groups=NO_TRAINING
        )
        await wait_until(lambda: trainer.role.published is not None, timeout=30)
        liar = await stack.enter_async_context(open_swarm(load_or_create_key(tmp_path / "liar.key"), LOOPBACK))
        asked: list[int] = []

        async def withhold(message, remote):
            kind, arg = w.parse_request(message)
            if kind == "get_have":
                entry = trainer.role.store.manifest(arg)
                return w.have_reply(arg, b"\xff" * ((len(entry[1].all_chunks()) + 7) // 8))
            if kind == "get_chunks":
                asked.append(len(arg))
                await trio.sleep(19)
                return w.chunks_reply([], arg)
            raise NotFound("nothing here")

        from node.weights.server import NotFound

        liar.host.set_stream_handler(w.PROTOCOL_ID, serve("liar", withhold, 1 << 16, w.MAX_REPLY_FRAME, 60))
        await liar.connect(info_from_p2p_addr(boot.swarm.addrs()[0]))
        sampler = await start_sampler(nursery, tmp_path, "s0", boot, engine="torch")
        await liar.connect(info_from_p2p_addr(sampler.swarm.addrs()[0]))
        await wait_until(lambda: sampler.role.engine_ready.is_set(), timeout=60, what="version 0")
        for version in (1, 2):
            with torch.no_grad():
                for p in trainer.role.learner.model.parameters():
                    p.mul_(1.01)
            trainer.role.learner.new_version()
            t0 = trio.current_time()
            await trainer.role.publish()
            await wait_until(lambda v=version: sampler.role.versions.engine == v, 30, what=f"version {version}")
            assert trio.current_time() - t0 < 12, "a withheld download took as long as the liar wanted"
        assert asked, "the withholding peer was never asked: the test proves nothing"
        assert sampler.role.weights.strikes.counts.get(str(liar.peer_id), 0) >= 1
        nursery.cancel_scope.cancel()


async def test_one_peer_cannot_pull_more_than_its_upload_share(tmp_path, tiny_model_dir):
    """Issue 17, 7: 16 streams pulling chunks from one node as fast as they can. Each peer gets at most its
    upload share (bytes/s, 2 s burst) and is told when to come back; another peer is still served at once."""
    from node.weights.publish import Publisher
    from node.weights.server import WeightServer
    from protocols.errors import RemoteError
    from tests.helpers import publish_model
    from trainer.model import load_model

    key = load_or_create_key(tmp_path / "server.key")
    store = ChunkStore(tmp_path / "store")
    _, _, manifest = publish_model(
        Publisher(store, KeyPair(key.private_key, key.public_key), "t", chunk_size=CHUNK),
        load_model(tiny_model_dir),
        0,
        tiny_model_dir,
    )
    rate = 256 << 10
    server = WeightServer(store, upload_per_peer=rate)
    async with AsyncExitStack() as stack:
        node = await stack.enter_async_context(open_swarm(key, LOOPBACK))
        server.register(node.host)
        greedy = await stack.enter_async_context(open_swarm(load_or_create_key(tmp_path / "g.key"), LOOPBACK))
        other = await stack.enter_async_context(open_swarm(load_or_create_key(tmp_path / "o.key"), LOOPBACK))
        for peer in (greedy, other):
            await peer.connect(info_from_p2p_addr(node.addrs()[0]))
        hashes = manifest.all_chunks()
        got, refused = [0], [0]

        async def pull(k: int) -> None:
            while trio.current_time() < deadline:
                batch = hashes[(k * 4) % len(hashes) :][:4]
                try:
                    reply = await request(
                        greedy.host,
                        node.peer_id,
                        w.PROTOCOL_ID,
                        w.get_chunks(batch),
                        max_request=w.MAX_REQUEST_FRAME,
                        max_reply=w.MAX_REPLY_FRAME,
                    )
                    found, _ = w.parse_chunks_reply(reply, batch, CHUNK)
                    got[0] += sum(len(d) for d in found.values())
                except RemoteError as exc:
                    assert exc.code in ("rate_limited", "busy") and exc.retry_after is not None
                    refused[0] += 1
                    await trio.sleep(0.05)

        start = trio.current_time()
        deadline = start + 3.0
        async with trio.open_nursery() as nursery:
            for k in range(16):
                nursery.start_soon(pull, k)
        elapsed = trio.current_time() - start
        assert refused[0] > 0 and got[0] <= 2 * rate + rate * elapsed + 4 * CHUNK
        reply = await request(
            other.host,
            node.peer_id,
            w.PROTOCOL_ID,
            w.get_chunks(hashes[:1]),
            max_request=w.MAX_REQUEST_FRAME,
            max_reply=w.MAX_REPLY_FRAME,
        )
        assert w.parse_chunks_reply(reply, hashes[:1], CHUNK)[0]


async def test_announcement_floods_and_replays_do_not_delay_versions(tmp_path, tiny_model_dir):
    """Issue 17, 9: a peer announces made-up versions near 2^40 every 0.3 s and holds every manifest request, and
    replays the trainer's old signed manifest. A new sampler still starts from the newest version, and later
    versions still install within seconds (announcements are handled concurrently, with short timeouts)."""
    async with trio.open_nursery() as nursery, AsyncExitStack() as stack:
        boot = await start_bootstrap(nursery, tmp_path)
        trainer = await start_trainer(
            nursery, tmp_path, boot, tiny_model_dir, weights={"chunk_size": CHUNK}, batch_groups=NO_TRAINING
        )
        await wait_until(lambda: trainer.role.published is not None, timeout=30)
        old_mid, old_signed, _ = trainer.role.store.latest()

        async def bump() -> None:
            with torch.no_grad():
                for p in trainer.role.learner.model.parameters():
                    p.mul_(1.01)
            trainer.role.learner.new_version()
            await trainer.role.publish()

        await bump()  # version 1: the replayed version 0 is stale
        spammer = await stack.enter_async_context(open_swarm(load_or_create_key(tmp_path / "spam.key"), LOOPBACK))
        gossip = spammer.gossip

        async def hang(message, remote):
            kind, arg = w.parse_request(message)
            if kind == "get_manifest" and arg == old_mid:
                return old_signed.to_wire()
            await trio.sleep(29)
            raise TimeoutError

        spammer.host.set_stream_handler(w.PROTOCOL_ID, serve("spam", hang, 1 << 16, w.MAX_REPLY_FRAME, 60))
        await spammer.connect(info_from_p2p_addr(boot.swarm.addrs()[0]))

        async def spam() -> None:
            k = 0
            while True:
                k += 1
                await gossip.publish(announce_topic("test"), w.announce((1 << 40) - k, k.to_bytes(32, "big")))
                await gossip.publish(announce_topic("test"), w.announce(0, old_mid))
                await trio.sleep(0.3)

        nursery.start_soon(spam)
        installed: list[int] = []
        sampler = await start_sampler(nursery, tmp_path, "s0", boot, engine="torch")
        await spammer.connect(info_from_p2p_addr(sampler.swarm.addrs()[0]))
        await wait_until(lambda: sampler.role.engine_ready.is_set(), timeout=60, what="the first version")
        installed.append(sampler.role.versions.engine)
        assert installed[0] == 1, "a replayed old manifest sent the new sampler to an old version first"
        for version in (2, 3):
            t0 = trio.current_time()
            await bump()
            await wait_until(lambda v=version: sampler.role.versions.engine == v, 30, what=f"version {version}")
            assert trio.current_time() - t0 < 8, "announcements held up a real version"
        nursery.cancel_scope.cancel()


async def test_endgame_asks_a_second_peer_for_chunks_stuck_at_a_slow_one(tmp_path, tiny_model_dir):
    """A slow peer and a fast one both hold a version; whatever the slow one was asked for is asked of the fast
    one too once nothing else is left (endgame), and the slow request is cancelled when its chunks have arrived."""
    from libp2p.crypto.ed25519 import create_new_key_pair

    from node.strikes import Strikes
    from node.weights.fetcher import Download
    from node.weights.policy import FetchSettings
    from node.weights.publish import Publisher
    from node.weights.server import WeightServer
    from tests.helpers import publish_model
    from trainer.model import load_model

    source = ChunkStore(tmp_path / "source")
    publisher = Publisher(source, create_new_key_pair(), "t", chunk_size=CHUNK)
    mid, _, manifest = publish_model(publisher, load_model(tiny_model_dir), 0, tiny_model_dir)
    server = WeightServer(source)
    slow_asked: list[int] = []

    async def slow(message, remote):
        kind, arg = w.parse_request(message)
        if kind == "get_chunks":
            slow_asked.append(len(arg))
            await trio.sleep(30)
        return await server.handle(message, remote)

    async with AsyncExitStack() as stack:
        hosts = [
            await stack.enter_async_context(open_swarm(load_or_create_key(tmp_path / f"{n}.key"), LOOPBACK))
            for n in ("slow", "fast", "me")
        ]
        slow_node, fast_node, me = hosts
        handler = serve("slow", slow, w.MAX_REQUEST_FRAME, w.MAX_REPLY_FRAME, 60)
        slow_node.host.set_stream_handler(w.PROTOCOL_ID, handler)
        server.register(fast_node.host)
        for node in (slow_node, fast_node):
            await me.connect(info_from_p2p_addr(node.addrs()[0]))
        store = ChunkStore(tmp_path / "me")
        store.add_manifest(*source.manifest(mid))
        download = Download(
            me.host, store, manifest, mid, None, lambda: [slow_node.peer_id, fast_node.peer_id], Strikes(3),
            FetchSettings(batch=4),
        )  # fmt: skip
        t0 = trio.current_time()
        with trio.fail_after(20):
            await download.run()
    assert not download.missing and trio.current_time() - t0 < 15, "the download waited for the slow peer"
    assert slow_asked, "the slow peer was never asked: the test proves nothing"
    assert download.stats.endgame_requests >= 1 and download.stats.cancelled_requests >= 1
    assert store.missing(manifest) == []


async def test_a_node_on_a_slow_downlink_does_not_blame_honest_peers_for_it(tmp_path, tiny_model_dir):
    """Six honest peers serve a node whose own downlink (128 KiB/s, shared by every reply, first come first
    served) is the bottleneck. Each peer sends far faster than the required rate, but six replies queue on the
    one link: the node must pace its requests by its own download rate and allow for that queue, not time out,
    strike and drop the peers (it did: a sampler on a slow home link dropped a peer every version)."""
    from libp2p.crypto.ed25519 import create_new_key_pair

    from node.strikes import Strikes
    from node.weights.fetcher import Download
    from node.weights.policy import FetchSettings
    from node.weights.publish import Publisher
    from node.weights.server import WeightServer
    from tests.helpers import publish_model
    from trainer.model import load_model

    source = ChunkStore(tmp_path / "source")
    publisher = Publisher(source, create_new_key_pair(), "t", chunk_size=CHUNK)
    mid, _, manifest = publish_model(publisher, load_model(tiny_model_dir), 0, tiny_model_dir)
    server = WeightServer(source)
    downlink, rate = trio.Lock(), 128 << 10  # trio's lock is fair: replies cross the link in arrival order
    peak = [0]

    async def over_the_downlink(message, remote):
        reply = await server.handle(message, remote)
        kind, arg = w.parse_request(message)
        if kind == "get_chunks":
            peak[0] = max(peak[0], download.bytes_in_flight())
            async with downlink:
                await trio.sleep(sum(source.size(h) for h in arg) / rate)
        return reply

    async with AsyncExitStack() as stack:
        peers = [
            await stack.enter_async_context(open_swarm(load_or_create_key(tmp_path / f"p{i}.key"), LOOPBACK))
            for i in range(6)
        ]
        me = await stack.enter_async_context(open_swarm(load_or_create_key(tmp_path / "me.key"), LOOPBACK))
        for peer in peers:
            peer.host.set_stream_handler(w.PROTOCOL_ID, serve("link", over_the_downlink, w.MAX_REQUEST_FRAME,
                                                              w.MAX_REPLY_FRAME, 60))  # fmt: skip
            await me.connect(info_from_p2p_addr(peer.addrs()[0]))
        store = ChunkStore(tmp_path / "me")
        store.add_manifest(*source.manifest(mid))
        strikes = Strikes(3)
        download = Download(
            me.host, store, manifest, mid, None, lambda: [p.peer_id for p in peers], strikes,
            FetchSettings(min_rate=64 << 10, min_in_flight=256 << 10),
        )  # fmt: skip
        t0 = trio.current_time()
        with trio.fail_after(60):
            await download.run()
        took = trio.current_time() - t0
    ideal = sum(source.size(h) for h in manifest.all_chunks()) / rate
    assert not download.stats.slow and not download.stats.dropped, (download.stats.slow, download.stats.dropped)
    assert not strikes.counts
    assert download.stats.failed_requests == 0
    assert took < 1.6 * ideal, (took, ideal)
    # paced: never much more in flight than a few seconds of the link (plus the one batch that starts a request)
    assert peak[0] <= 4.0 * rate + w.MAX_CHUNKS_PER_REQUEST * CHUNK, peak[0]
    assert store.missing(manifest) == []


async def test_the_origin_counts_a_copy_as_sent_once_it_has_gone_out(tmp_path, tiny_model_dir):
    """On a slow uplink a reply queues for seconds. The origin's re-serve clock (``reserve_after``) starts when a
    copy has been written out, not when it was decided: a chunk still on its way to one peer is not sent to a
    second (before: it was, 3 s after the first request, and a 16-sampler broadcast cost the trainer 1.9 versions
    of upload). A copy whose write failed is uncounted: the chunk may go out again at once."""
    from libp2p.crypto.ed25519 import create_new_key_pair

    from node.weights.publish import Publisher
    from node.weights.server import WeightServer
    from tests.helpers import publish_model
    from trainer.model import load_model

    source = ChunkStore(tmp_path / "source")
    publisher = Publisher(source, create_new_key_pair(), "t", chunk_size=256 << 10)
    mid, _, manifest = publish_model(publisher, load_model(tiny_model_dir), 0, tiny_model_dir)
    chunks = manifest.all_chunks()
    assert len(chunks) > 8, "every chunk would be sent once by the first request: the floor would allow copies"
    reserve_after = 0.5
    server = WeightServer(source, origin=True, reserve_after=reserve_after, upload_per_peer=1e12)
    asked = chunks[:4]
    link_free = trio.Event()

    async def slow_uplink(message, remote):
        """The reply to the slow peer queues behind a busy uplink until the test frees it."""
        reply = await server.handle(message, remote)
        if remote == slow.peer_id:
            await link_free.wait()
        return reply

    async with AsyncExitStack() as stack:
        origin, slow, other = [
            await stack.enter_async_context(open_swarm(load_or_create_key(tmp_path / f"{n}.key"), LOOPBACK))
            for n in ("origin", "slow", "other")
        ]
        origin.host.set_stream_handler(
            w.PROTOCOL_ID,
            serve("w", slow_uplink, w.MAX_REQUEST_FRAME, w.MAX_REPLY_FRAME, 60, reply_sent=server.reply_sent),
        )
        for node in (slow, other):
            await node.connect(info_from_p2p_addr(origin.addrs()[0]))

        async def served_to(node) -> list[bytes]:
            reply = await request(
                node.host, origin.peer_id, w.PROTOCOL_ID, w.get_chunks(asked, mid),
                max_request=w.MAX_REQUEST_FRAME, max_reply=w.MAX_REPLY_FRAME,
            )  # fmt: skip
            return [h for h, _ in reply["found"]]

        async with trio.open_nursery() as nursery:
            slow_got: list[bytes] = []
            nursery.start_soon(lambda: _append(slow_got, served_to(slow)))
            await trio.sleep(3 * reserve_after)  # the copy to the slow peer has been on its way out for a while
            assert server._in_flight and not slow_got
            assert await served_to(other) == [], "a copy still on its way out was sent again"
            link_free.set()
        assert slow_got == asked
        assert not server._in_flight
        assert await served_to(other) == [], "sent again before reserve_after passed since it went out"
        await trio.sleep(reserve_after + 0.1)
        assert await served_to(other) == asked  # the first copy may have been lost with its peer

        server.reply_sent({"found": [(asked[0], b"")]}, ok=False)  # a write that failed: that copy never left
        assert server._served[asked[0]] == 1


async def _append(into: list, items) -> None:
    into.extend(await items)
