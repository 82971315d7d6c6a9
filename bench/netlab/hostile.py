"""Hostile swarm members for fault scenarios: real libp2p nodes (same host, DHT and protocols as the product)
that misbehave on purpose. Test code only; nothing in the product can be switched into these modes.

``--mode corrupt``: joins as a sampler, fetches the real manifests, then claims to hold every chunk of the
newest version and serves garbage of the right length (so only the blake3 check can catch it).
``--mode flood``: finds the trainer through the DHT and floods it with rollout submissions from 16
concurrent streams, counting the replies by error code.
``--mode withhold``: claims every chunk of every version in its have-bitfields, holds each chunk request 19 s,
then answers "missing" (issue 17, 2).
``--mode inject``: the product's sampler role with an engine that replaces half of each group with the task's
right answer, reporting that answer's exact logprobs under the current weights (issue 16).
``--mode sybil``: a stream of fresh identities, each taking leases and sending forged groups (waiting out rate
limits) until banned, then replaced by a new one (issue 17, 6).
``--mode bomb``: decode bombs (8.4 MB of empty maps), slow streams that never finish their frame, and uploads
pulled from samplers as fast as they answer (issue 17, 3, 4 and 7).
``--mode headers``: 40 identities, each on 8 work and 8 rollout streams sending only a frame header that announces
the largest request the trainer accepts (work: protocols/work.py's request limit; rollouts: ``--rollout-frame``, the
trainer's group frame limit), then 100 bytes, then nothing (issue 26, 2a). A header over the limit is another attack
(the bomber's): the trainer hangs up on it and cools its address, so it would stall nothing.
``--mode idle``: hundreds of fresh identities that each hold one idle connection to the trainer, and open a new
one (a fresh identity) whenever theirs is closed or refused (issue 26, 1a).
``--mode relay``: one identity sending circuit-relay RESERVEs to the trainer naming made-up peer ids, then its own;
a fresh identity at another address then reserves as an honest NATed peer would (issue 26, 1b).

``headers`` and ``idle`` dial from the addresses ``--sources`` names (bench/netlab/sources.py: one per identity,
spread so the trainer's per-address caps do not bind); without it every identity dials from the host's address.
"""

from __future__ import annotations

import argparse
import logging
import os
import struct
from contextlib import suppress
from pathlib import Path
from typing import Any

import msgpack
import multiaddr
import trio
from libp2p.peer.peerinfo import PeerInfo

from node.cli import setup_logging
from node.config import NodeConfig
from node.discovery import find_role, provide_forever, role_key
from node.host import Swarm
from node.rpc import request, serve
from node.runtime import run_node
from node.settings import load_config_file
from node.weights.patch import WeightChanges
from node.weights.server import WeightServer
from node.weights.store import ChunkStore
from node.weights.sync import WeightSync
from protocols import rollouts, work
from protocols import weights as w
from protocols.draw import RULE as DRAW_RULE
from protocols.errors import RemoteError
from protocols.rollouts import RolloutAck, RolloutGroup, Sample
from protocols.work import TaskSpec, WorkLease, WorkRequest

log = logging.getLogger(__name__)


async def find_trainer(swarm: Swarm, config: NodeConfig) -> PeerInfo:
    """The trusted trainer's record in the DHT, looked up once a second until it is there, narrowed to the first of
    its addresses that answers: the attackers' fresh identities dial with py-libp2p's stock dial, which tries one
    address only (docs/upstream/libp2p-dial-one-address.md), and a record an attacker held for minutes (booted early,
    armed later) listed one that did not answer first."""
    key = role_key(config.swarm, "trainer")
    while True:
        for info in await find_role(swarm, key):
            if info.peer_id != config.trainer_id:
                continue
            for addr in info.addrs:
                try:
                    with trio.fail_after(10):
                        await swarm.host.get_network().dial_addr(addr, info.peer_id)
                except Exception as exc:
                    log.info("trainer not at %s: %s", addr, exc)
                    continue
                log.info("trainer at %s (its record: %s)", addr, [str(a) for a in info.addrs])
                return PeerInfo(info.peer_id, [addr])
        await trio.sleep(1.0)


class LyingStore:
    """Claims every chunk of every manifest it knows, and returns random bytes for each."""

    def __init__(self, store: ChunkStore) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def bitfield(self, manifest) -> bytes:
        n = len(manifest.all_chunks())
        return bytes([0xFF]) * ((n + 7) // 8)

    def read(self, h: bytes) -> bytes:
        real = self._store.read(h)
        return os.urandom(len(real) if real else 4096)


class CorruptSeeder:
    name = "sampler"

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.store = ChunkStore(config.data_dir / "store")
        self.server = WeightServer(LyingStore(self.store))  # type: ignore[arg-type]

    def register(self, swarm: Swarm) -> None:
        self.server.register(swarm.host)

        async def keep(version: int, path: Path, changes: WeightChanges | None) -> None:
            pass

        assert self.config.trainer_id is not None
        self.sync = WeightSync(swarm, self.store, swarm.gossip, self.config.swarm, self.config.trainer_id, keep)

    async def run(self, swarm: Swarm) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.sync.run)
            nursery.start_soon(provide_forever, swarm, role_key(self.config.swarm, "sampler"), 5.0)

    def status(self) -> dict[str, Any]:
        return {"mode": "corrupt", "garbage_bytes_served": self.server.bytes_served}


class Withholder(CorruptSeeder):
    """Claims everything, serves nothing, slowly."""

    def armed(self) -> bool:
        """Withholding now? (Armed(early=True) replaces this: honest until its arm file exists.)"""
        return True

    def register(self, swarm: Swarm) -> None:
        super().register(swarm)
        self.held = 0
        honest = WeightServer(self.store)

        async def withhold(message: dict[str, Any], remote: Any) -> dict[str, Any]:
            if not self.armed():
                return await honest.handle(message, remote)
            kind, arg = w.parse_request(message)
            if kind == "get_chunks":
                self.held += 1
                await trio.sleep(19)
                return w.chunks_reply([], arg)
            return await self.server.handle(message, remote)

        swarm.host.set_stream_handler(
            w.PROTOCOL_ID, serve("withhold", withhold, w.MAX_REQUEST_FRAME, w.MAX_REPLY_FRAME, 60, streams_per_peer=64)
        )

    def status(self) -> dict[str, Any]:
        return {"mode": "withhold", "requests_held": self.held}


def injecting_engine_factory(inner_factory):
    """An engine that samples honestly, then swaps every other sample for the task's right answer, with that
    answer's true logprobs under the weights it runs: nothing a logprob check can see."""
    import torch  # here, not at the top: only the injector needs it, and ten attackers boot at once in the WAN test

    from node.engines.base import Generation
    from trainer.model import token_logprobs
    from trainer.tasks.reverse import ReverseDigitsTask

    task = ReverseDigitsTask()

    def factory(path: Path, version: int):
        engine = inner_factory(path, version)
        original = engine.generate

        def generate(prompts, *, temperature, top_p, max_tokens, seed):
            gens = original(prompts, temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed)
            answer = [engine.char_ids[c] for c in task.answer(seed)] + list(engine.eos_ids)
            with torch.no_grad():
                lp, _ = token_logprobs(engine.model, [prompts[0]], [answer], temperature)
            injected = Generation(answer, lp[0, : len(answer)].tolist(), "stop")
            return [injected if k % 2 == 0 else g for k, g in enumerate(gens)]

        engine.generate = generate
        from trainer.tiny_qwen2 import vocab

        engine.char_ids = vocab()
        return engine

    return factory


class SybilSwarm:
    """Fresh identities, ``concurrency`` at a time: each takes leases and sends forged groups until banned."""

    name = "sampler"

    def __init__(self, config: NodeConfig, concurrency: int = 6, tries: int = 32) -> None:
        self.config = config
        self.concurrency = concurrency
        self.tries = tries  # refusals one request waits out before its identity gives up
        self.identities = 0
        self.replies: dict[str, int] = {}

    def register(self, swarm: Swarm) -> None:
        self.swarm = swarm

    async def run(self, swarm: Swarm) -> None:
        from libp2p.crypto.ed25519 import create_new_key_pair

        from node.host import build_host

        target = await find_trainer(swarm, self.config)

        def count(code: str) -> None:
            self.replies[code] = self.replies.get(code, 0) + 1

        def forged(lease: WorkLease, spec: TaskSpec, host: Any) -> RolloutGroup:
            samples = [
                Sample(f"{lease.lease_id}/{spec.seed}/{k}", [5, 2], [-0.01, -0.01], "stop")
                for k in range(lease.group_size)
            ]
            return RolloutGroup(
                f"{lease.lease_id}/{spec.seed}",
                lease.lease_id,
                spec.task_id,
                spec.seed,
                lease.version,
                str(host.get_id()),
                spec.prompt_ids,
                lease.sampling.temperature,
                lease.sampling.top_p,
                "q8",  # a mode the trainer trains on, so the forgery is checked (and struck)
                samples,
                DRAW_RULE,
                engine="mlx",
                compute="bf16",
            )

        async def ask(host: Any, protocol: str, message: dict, max_request: int, max_reply: int) -> Any:
            """One request, a refusal that says when to come back (a rate limit, a full lease pool) waited out
            and asked again, as a forger set on its goal would: an identity that gave up at the first one was
            struck once and never banned, and one that kept a lease's other seeds held the newcomers' lease pool
            until its leases expired (2 min). "banned" and anything else end the identity."""
            for _ in range(self.tries):
                try:
                    with trio.fail_after(60):
                        return await request(
                            host, target.peer_id, protocol, message, max_request=max_request, max_reply=max_reply
                        )
                except RemoteError as exc:
                    count(exc.code)
                    if exc.code == "banned":
                        raise
                    await trio.sleep(min(exc.retry_after or 1.0, 10.0))
            raise trio.TooSlowError(f"{protocol}: refused {self.tries} times")

        async def until_banned(host: Any) -> None:
            """One identity: leases, and a forged group for every seed of each, until the trainer bans it."""
            with trio.fail_after(30):
                await host.connect(target)
            while True:
                reply = await ask(host, work.PROTOCOL_ID, WorkRequest(4).to_wire(), work.MAX_FRAME, work.MAX_FRAME)
                lease = WorkLease.from_wire(reply)
                for spec in lease.tasks:
                    group = forged(lease, spec, host).to_wire()
                    ack = RolloutAck.from_wire(
                        await ask(host, rollouts.PROTOCOL_ID, group, rollouts.MAX_FRAME, rollouts.MAX_ACK_FRAME)
                    )
                    count("accepted" if ack.accepted else "refused")

        async def identity() -> None:
            while True:
                host = build_host(create_new_key_pair())
                self.identities += 1
                async with host.run([]):
                    try:
                        await until_banned(host)
                    except RemoteError:  # banned (counted)
                        pass
                    except Exception as exc:
                        count(type(exc).__name__)
                        if self.replies[type(exc).__name__] == 1:
                            log.info("a sybil identity gave up: %r", exc)
                await trio.sleep(0.5)

        async with trio.open_nursery() as nursery:
            for _ in range(self.concurrency):
                nursery.start_soon(identity)

    def status(self) -> dict[str, Any]:
        return {"mode": "sybil", "identities": self.identities, "replies": dict(self.replies)}


class Bomber:
    """Decode bombs and slow streams at the trainer; chunk pulls at every sampler it can find."""

    name = "sampler"

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.sent: dict[str, int] = {}

    def register(self, swarm: Swarm) -> None:
        pass

    async def run(self, swarm: Swarm) -> None:
        await find_trainer(swarm, self.config)
        tid = self.config.trainer_id
        bomb = b"\xdd" + (8_400_000).to_bytes(4, "big") + b"\x80" * 8_400_000
        frame = len(bomb).to_bytes(4, "big") + bomb

        def count(what: str) -> None:
            self.sent[what] = self.sent.get(what, 0) + 1

        async def bombs() -> None:
            while True:
                try:
                    with trio.fail_after(10):
                        s = await swarm.host.new_stream(tid, [rollouts.PROTOCOL_ID])
                        await s.write(frame[: 64 << 10])  # the header says 8.4 MB; refused before the body
                        await s.reset()
                    count("bomb")
                except Exception:
                    count("bomb_failed")
                await trio.sleep(0.2)

        async def slow() -> None:
            while True:
                try:
                    s = await swarm.host.new_stream(tid, [rollouts.PROTOCOL_ID])
                    await s.write((64 << 10).to_bytes(4, "big") + b"\x00" * 100)  # never finished
                    count("slow")
                    await trio.sleep(60)
                except Exception:
                    count("slow_failed")
                    await trio.sleep(1)

        async def pull() -> None:
            while True:
                for info in await find_role(swarm, role_key(self.config.swarm, "sampler")):
                    try:
                        with trio.fail_after(10):
                            await swarm.connect(info)
                            reply = await request(
                                swarm.host,
                                info.peer_id,
                                w.PROTOCOL_ID,
                                w.get_manifest(None),
                                max_request=w.MAX_REQUEST_FRAME,
                                max_reply=w.MAX_MANIFEST_BODY + 4096,
                            )
                            manifest = w.Manifest.from_body(w.SignedManifest.from_wire(reply).body)
                            hashes = manifest.all_chunks()[: w.MAX_CHUNKS_PER_REQUEST]
                            await request(
                                swarm.host,
                                info.peer_id,
                                w.PROTOCOL_ID,
                                w.get_chunks(hashes),
                                max_request=w.MAX_REQUEST_FRAME,
                                max_reply=w.MAX_REPLY_FRAME,
                            )
                        count("pull")
                    except RemoteError as exc:
                        count(f"pull_{exc.code}")
                    except Exception:
                        count("pull_failed")
                await trio.sleep(0.1)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(bombs)
            for _ in range(4):
                nursery.start_soon(slow)
            for _ in range(4):
                nursery.start_soon(pull)

    def status(self) -> dict[str, Any]:
        return {"mode": "bomb", "sent": dict(self.sent)}


class Flooder:
    name = "sampler"

    def __init__(self, config: NodeConfig, concurrency: int = 16) -> None:
        self.config = config
        self.concurrency = concurrency
        self.replies: dict[str, int] = {}

    def register(self, swarm: Swarm) -> None:
        pass

    async def run(self, swarm: Swarm) -> None:
        await find_trainer(swarm, self.config)
        junk = msgpack.unpackb(msgpack.packb({"v": 1, "t": "rollouts", "group_id": "f" * 16, "samples": []}))

        async def flood() -> None:
            while True:
                try:
                    await request(
                        swarm.host,
                        self.config.trainer_id,
                        rollouts.PROTOCOL_ID,
                        junk,
                        max_request=rollouts.MAX_FRAME,
                        max_reply=rollouts.MAX_ACK_FRAME,
                        timeout=10,
                    )
                    code = "accepted"
                except RemoteError as exc:
                    code = exc.code
                except Exception as exc:
                    code = type(exc).__name__
                    await trio.sleep(0.2)
                self.replies[code] = self.replies.get(code, 0) + 1

        async with trio.open_nursery() as nursery:
            for _ in range(self.concurrency):
                nursery.start_soon(flood)

    def status(self) -> dict[str, Any]:
        return {"mode": "flood", "replies": dict(self.replies), "sent": sum(self.replies.values())}


def bind_source(host: Any, ip: str | None) -> None:
    """Make ``host`` dial over TCP from ``ip`` (an address of this machine), any port."""
    if ip is None:
        return
    for transport in host.get_network().transport_manager.get_transports():
        dial_with_source = getattr(transport, "dial_with_source", None)
        if dial_with_source is not None:

            async def dial(maddr: Any, _dial: Any = dial_with_source) -> Any:
                return await _dial(maddr, (ip, 0))

            transport.dial = dial


def fresh_host(ip: str | None) -> Any:
    from libp2p.crypto.ed25519 import create_new_key_pair

    from node.host import build_host

    host = build_host(create_new_key_pair())
    bind_source(host, ip)
    return host


def retry_pause(failures: int) -> float:
    """Seconds to wait after the ``failures``-th failure in a row (5, 10, 20, 40, then 60): an attacker's process
    starved of CPU (niced, on a busy box) that retried at once timed out every stream negotiation (py-libp2p's 30 s)
    and spent what CPU it had retrying, and never stalled a stream in 12 minutes (a loaded CI run)."""
    return min(60.0, 5.0 * 2 ** max(0, failures - 1))


def connected_to(host: Any, peer: Any) -> bool:
    return bool(host.get_network().get_connections(peer))


def default_rollout_frame() -> int:
    """The rollout frame limit of a trainer with the default lease shape (node/settings.py)."""
    from node.settings import TrainerSettings

    defaults = TrainerSettings()
    return rollouts.frame_limit(defaults.group_size, defaults.max_tokens)


class HeaderFlooder:
    """40 identities whose streams send a frame's header and 100 bytes, then stall (what the old budget reserved
    on the announced length: 256 MiB held, honest throughput 14%). Each header announces the largest frame the
    trainer accepts on that protocol: one byte more and the trainer hangs up at once (``rpc.on_oversized_frame``),
    which stalls nothing. ``rollout_frame``: the trainer's group frame limit (``rollouts.frame_limit`` of its lease
    shape; 0: the default shape's)."""

    name = "sampler"

    def __init__(self, config: NodeConfig, sources: list[str], identities: int = 40, rollout_frame: int = 0):
        self.config = config
        self.sources = sources
        self.identities = identities
        rollout_frame = rollout_frame or default_rollout_frame()
        # rollouts first: the stall that matters (a group's frame is the larger), and what a scenario waits to see
        self.sizes = {rollouts.PROTOCOL_ID: rollout_frame, work.PROTOCOL_ID: work.MAX_REQUEST_FRAME}
        self.connected = 0
        self.streams = 0  # stalled streams open now
        self.sent: dict[str, int] = {}
        self.failures: dict[str, int] = {}  # by what failed and the exception's type

    def register(self, swarm: Swarm) -> None:
        pass

    def count(self, what: str) -> None:
        self.sent[what] = self.sent.get(what, 0) + 1

    def failed(self, what: str, exc: BaseException) -> None:
        self.count(what)
        why = f"{what}: {type(exc).__name__}"
        self.failures[why] = self.failures.get(why, 0) + 1

    async def back_off(self, what: str, exc: BaseException, failures: int) -> int:
        """Count a failure, wait out its pause (``retry_pause``), and return the failures in a row so far."""
        self.failed(what, exc)
        await trio.sleep(retry_pause(failures + 1))
        return failures + 1

    async def run(self, swarm: Swarm) -> None:
        target = await find_trainer(swarm, self.config)

        async def identity(k: int) -> None:
            refused = 0
            while True:
                host = fresh_host(self.sources[k] if k < len(self.sources) else None)
                async with host.run([]):
                    try:
                        with trio.fail_after(30):
                            await host.connect(target)
                    except Exception as exc:
                        refused = await self.back_off("connect_failed", exc, refused)
                        continue
                    refused = 0
                    self.connected += 1
                    try:
                        async with trio.open_nursery() as streams:
                            for protocol, size in self.sizes.items():
                                for _ in range(8):
                                    streams.start_soon(stall, host, protocol, size)
                            while connected_to(host, target.peer_id):
                                await trio.sleep(1)
                            streams.cancel_scope.cancel()
                    finally:
                        self.connected -= 1
                self.count("cut")

        async def stall(host: Any, protocol: str, size: int) -> None:
            failures = 0
            while True:  # a stream the trainer cuts is opened again
                try:
                    stream = await host.new_stream(target.peer_id, [protocol])
                    await stream.write(struct.pack(">I", size) + b"\x00" * 100)
                except Exception as exc:
                    failures = await self.back_off("stream_failed", exc, failures)
                    continue
                failures = 0
                self.count(protocol.split("/")[2])
                self.streams += 1
                held = trio.current_time()
                try:
                    while await stream.read(1 << 16):
                        pass
                except Exception as exc:
                    self.failed("stream_cut", exc)
                finally:
                    self.streams -= 1
                if trio.current_time() - held < 2:
                    await trio.sleep(5)  # cut at once: a pause, not a flood of stream opens

        async with trio.open_nursery() as nursery:
            for k in range(self.identities):
                nursery.start_soon(identity, k)

    def status(self) -> dict[str, Any]:
        return {"mode": "headers", "connected": self.connected, "streams": self.streams, "sent": dict(self.sent),
                "failures": dict(self.failures)}  # fmt: skip


class IdleHolder:
    """Fresh identities holding idle connections: as many as ``identities``, each replaced by a new identity when
    its connection is closed (pruned) or refused."""

    name = "sampler"

    def __init__(self, config: NodeConfig, sources: list[str], identities: int = 64) -> None:
        self.config = config
        self.sources = sources
        self.identities = identities
        self.held = 0
        self.most_held = 0
        self.made = 0
        self.counts: dict[str, int] = {}

    def register(self, swarm: Swarm) -> None:
        pass

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    async def run(self, swarm: Swarm) -> None:
        target = await find_trainer(swarm, self.config)

        async def identity(k: int) -> None:
            await trio.sleep(k * 0.05)  # ~20 handshakes a second, not 256 at once
            while True:  # an identity tries until it holds a connection; once that is closed, a fresh one
                host = fresh_host(self.sources[k] if k < len(self.sources) else None)
                self.made += 1
                async with host.run([]):
                    while not await hold(host):
                        self.count("refused")
                        await trio.sleep(5)
                self.count("closed")
                await trio.sleep(2)

        async def hold(host: Any) -> bool:
            """Connect and hold the connection idle until the trainer closes it; False if it was refused."""
            try:
                with trio.fail_after(30):
                    await host.connect(target)
                await trio.sleep(0.5)  # a refused connection is closed right after its handshake
            except Exception:
                pass
            if not connected_to(host, target.peer_id):
                return False
            self.count("connected")
            self.held += 1
            self.most_held = max(self.most_held, self.held)
            try:
                while connected_to(host, target.peer_id):
                    await trio.sleep(1)
            finally:
                self.held -= 1
            return True

        async with trio.open_nursery() as nursery:
            for k in range(self.identities):
                nursery.start_soon(identity, k)

    def status(self) -> dict[str, Any]:
        return {"mode": "idle", "held": self.held, "most_held": self.most_held, "identities": self.made,
                **self.counts}  # fmt: skip


async def reserve(host: Any, relay: Any, claimed: Any) -> int:
    """One circuit-relay RESERVE on its own HOP stream naming ``claimed`` (None: no peer field); the reply's status,
    or -1 when none came."""
    from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
    from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL_ID
    from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg

    try:
        with trio.fail_after(20):
            stream = await host.new_stream(relay, [HOP_PROTOCOL_ID])
            try:
                msg = HopMessage(type=HopMessage.RESERVE)
                if claimed is not None:
                    msg.peer.id = claimed.to_bytes()
                await write_delimited_msg(stream, msg)
                return int((await read_delimited_msg(stream, HopMessage)).status)
            finally:
                with suppress(Exception):
                    await stream.close()
    except Exception:
        return -1


class RelayThief:
    """Books relay slots on the trainer under made-up peer ids (py-libp2p booked ``msg.peer.id``: one identity
    took all 64), again every 10 s; then reserves as itself; a fresh identity at ``probe_source`` reserves too."""

    name = "sampler"

    def __init__(self, config: NodeConfig, probe_source: str | None, claims: int = 80) -> None:
        self.config = config
        self.probe_source = probe_source
        self.claims = claims
        self.rounds = 0
        self.made_up: dict[str, int] = {}
        self.own: dict[str, int] = {}
        self.probe: dict[str, int] = {}

    def register(self, swarm: Swarm) -> None:
        pass

    async def run(self, swarm: Swarm) -> None:
        from libp2p.crypto.ed25519 import create_new_key_pair
        from libp2p.peer.id import ID
        from libp2p.relay.circuit_v2.protocol_buffer import StatusCode

        target = await find_trainer(swarm, self.config)
        await swarm.connect(target)

        def tally(book: dict[str, int], status: int) -> None:
            name = "none" if status < 0 else StatusCode(status).name if status in iter(StatusCode) else str(status)
            book[name] = book.get(name, 0) + 1

        async def claim(limit: trio.CapacityLimiter) -> None:
            async with limit:
                made_up = ID.from_pubkey(create_new_key_pair().public_key)
                tally(self.made_up, await reserve(swarm.host, target.peer_id, made_up))

        while True:
            async with trio.open_nursery() as nursery:
                limit = trio.CapacityLimiter(8)
                for _ in range(self.claims):
                    nursery.start_soon(claim, limit)
            tally(self.own, await reserve(swarm.host, target.peer_id, None))
            probe = fresh_host(self.probe_source)
            async with probe.run([]):
                try:
                    with trio.fail_after(30):
                        await probe.connect(target)
                    tally(self.probe, await reserve(probe, target.peer_id, probe.get_id()))
                except Exception:
                    tally(self.probe, -1)
            self.rounds += 1
            await trio.sleep(10)

    def status(self) -> dict[str, Any]:
        return {"mode": "relay", "rounds": self.rounds, "made_up": dict(self.made_up), "own": dict(self.own),
                "probe": dict(self.probe)}  # fmt: skip


class Armed:
    """A hostile role that joins at once (process, host, bootstrap: the slow part on a busy box) and misbehaves only
    once its arm file exists, so that a scenario can boot its attackers early and start each at its window.
    ``early``: the role runs at once (a withholder syncs versions, which takes a minute, and serves honestly) and
    asks ``role.armed()`` when to turn."""

    def __init__(self, role: Any, arm_file: Path, early: bool = False) -> None:
        self.role, self.arm_file, self.early = role, arm_file, early
        self.name = role.name
        if early:
            role.armed = arm_file.exists

    def register(self, swarm: Swarm) -> None:
        self.role.register(swarm)

    async def run(self, swarm: Swarm) -> None:
        while not self.early and not self.arm_file.exists():
            await trio.sleep(0.2)
        await self.role.run(swarm)

    def status(self) -> dict[str, Any]:
        return {**self.role.status(), "armed": self.arm_file.exists()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument(
        "--mode", choices=["corrupt", "flood", "withhold", "inject", "sybil", "bomb", "headers", "idle", "relay"],
        required=True,
    )  # fmt: skip
    p.add_argument("--config", type=Path, required=True)
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--listen", required=True)
    p.add_argument("--arm-file", type=Path, default=None, help="misbehave only once this file exists")
    p.add_argument("--sources", default="", help="headers/idle/relay: comma-separated addresses to dial from")
    p.add_argument("--identities", type=int, default=0, help="headers (40) / idle (64): how many at once")
    p.add_argument(
        "--rollout-frame", type=int, default=0,
        help="headers: the rollout frame size announced, the trainer's limit (0: a default trainer's)",
    )  # fmt: skip
    args = p.parse_args()
    setup_logging(verbose=False)
    config = NodeConfig(
        role="sampler",
        data_dir=args.data_dir,
        listen=multiaddr.Multiaddr(args.listen),
        provide_interval=5.0,
        status_interval=1.0,
        **load_config_file(args.config),
    )
    if args.mode == "inject":
        from node.engines import engine_factory
        from node.local_swarm import settings
        from node.roles.sampler import SamplerRole

        arm_file = args.arm_file

        class Injector(SamplerRole):
            async def _work_loop(self, swarm: Swarm) -> None:
                while arm_file is not None and not arm_file.exists():  # booted and synced, waiting for its turn
                    await trio.sleep(0.2)
                await super()._work_loop(swarm)

            def status(self) -> dict[str, Any]:
                return {**super().status(), "mode": "inject"}

        role: Any = Injector(
            config, settings(sampler={"engine": "torch"}), injecting_engine_factory(engine_factory("torch", "none"))
        )
    else:
        modes = {
            "corrupt": CorruptSeeder,
            "flood": Flooder,
            "withhold": Withholder,
            "sybil": SybilSwarm,
            "bomb": Bomber,
        }
        sources = [a for a in args.sources.split(",") if a]
        if args.mode == "headers":
            role = HeaderFlooder(config, sources, args.identities or 40, args.rollout_frame)
        elif args.mode == "idle":
            role = IdleHolder(config, sources, args.identities or 64)
        elif args.mode == "relay":
            role = RelayThief(config, sources[0] if sources else None)
        else:
            role = modes[args.mode](config)
        if args.arm_file is not None:
            role = Armed(role, args.arm_file, early=args.mode == "withhold")
    trio.run(run_node, config, role)


if __name__ == "__main__":
    main()
