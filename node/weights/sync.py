"""Keeps a node on the newest policy version: learns of versions by gossip (and by asking the trainer),
accepts only manifests signed by the trusted trainer, downloads, reassembles, hands the model dir over,
then announces that it holds the version so others fetch from it.

A version may be a sparse patch of its parent (protocols/weights.py): the node plans the cheapest route to it
(node/weights/chain.py: patches from a version it has built, or the newest anchor and the patches after it),
fetches the missing links' manifests (signed by the trainer, each hashing to the id its child names), downloads
every step's chunks at once, rebuilds the versions in order (each tensor checked against its hash), and hands
the engine the positions that changed since the version it runs (``changes``) so it can update in place. A bad
link (a chunk damaged on disk, a parent whose bits do not give the hashed result) is dropped and fetched again,
never applied.

Small versions come by push too (protocols/weights.py): the origin sends this node the signed manifest, the plan of
who gets which chunk first, and this node's share, which it relays to the plan's other peers as each chunk is
stored. A pushed chunk is taken only for a version being chased, from the origin or the peer the plan names for it,
and only once its blake3 matches (a bad one is a strike); the download asks no one for a chunk a push is bringing
until ``policy.push_wait`` has passed.

A node runs one encoding (``encoding``: bf16/native, or int8-grid/int4-grid for an MLX int8/int4 sampler). Polling
the trainer for the newest version it names it (a node running the default names none), and it adopts versions in
its own encoding, or in the default one until one in its own has come (node/weights/encodings.py, ``takes``).

Which version to chase, when to give up on a download or an announcer, when to rebuild: node/weights/policy.py."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio
from libp2p.peer.id import ID

from node.host import Swarm
from node.rpc import serve, timed_by
from node.settings import WeightSettings
from node.strikes import Strikes
from node.weights import policy
from node.weights.chain import Step, plan, plan_bytes
from node.weights.encodings import news_floor, takes
from node.weights.fetcher import Conduct, Download
from node.weights.gossip import Gossip, announce_topic
from node.weights.hashes import manifest_id
from node.weights.manifest import ForgedManifest, chunk_sizes, verify_manifest, verify_once
from node.weights.patch import PatchError, TensorMismatch, WeightChanges
from node.weights.policy import FetchSettings
from node.weights.server import WeightsClient, push_deadline, push_lane
from node.weights.store import BadChunk, ChunkStore
from protocols import weights as w
from protocols.errors import ProtocolError

PUSH_STREAMS_PER_PEER = 4  # push streams one peer may have open here at once

log = logging.getLogger(__name__)

OnVersion = Callable[[int, Path, WeightChanges | None], Awaitable[None]]
"""Called with each version the node now holds: its number, its model dir, and what changed since the version
handed over before (None: load it whole)."""


def fetch_settings(s: WeightSettings) -> FetchSettings:
    """A download's knobs, as the user set them."""
    return FetchSettings(
        workers_per_peer=s.workers_per_peer,
        have_interval=s.have_interval,
        request_timeout=s.request_timeout,
        min_rate=s.min_rate,
    )


def swarm_peers(swarm: Swarm) -> Callable[[], list[ID]]:
    """Every peer ``swarm`` is connected to, itself excluded: whom a node asks for chunks unless told otherwise."""
    return lambda: [p for p in swarm.host.get_connected_peers() if p != swarm.peer_id]


class NotExpected(ProtocolError):
    """A push this node did not ask for and no plan of the origin's names: refused unread."""

    code = "not_expected"


@dataclass
class PushState:
    """The origin's push plan for one version being chased: who gets each chunk first, and this node's relays."""

    mid: bytes
    manifest: w.Manifest
    index: dict[bytes, int]  # chunk hash -> index in all_chunks()
    first: dict[int, bytes]  # chunk index -> the peer (id bytes) the origin gives it to first
    direct: dict[int, frozenset[bytes]]  # chunk index -> every peer the origin gives it to (no relay to them)
    peers: list[ID]  # the plan's peers: whom this node relays its share to
    mine: int  # chunks the origin gives this node
    share_bytes: int  # their bytes
    relayed: int = 0
    lanes: dict[ID, trio.MemorySendChannel] = field(default_factory=dict)

    def close(self) -> None:
        for lane in self.lanes.values():
            lane.close()


class PlanDownload:
    """The downloads of one plan's steps, run at once, seen as one."""

    def __init__(self, downloads: list[Download]) -> None:
        self.downloads = downloads

    @property
    def missing(self) -> list[tuple[int, int]]:
        return [(k, i) for k, d in enumerate(self.downloads) for i in d.missing]

    @property
    def wanted_count(self) -> int:
        return sum(d.wanted_count for d in self.downloads)

    def fraction_done(self) -> float:
        return 1.0 - len(self.missing) / max(1, self.wanted_count)

    def bytes_by_peer(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for d in self.downloads:
            for peer, n in d.stats.bytes_by_peer.items():
                out[peer] = out.get(peer, 0) + n
        return out

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            for d in self.downloads:
                nursery.start_soon(d.run)


class WeightSync:
    def __init__(
        self,
        swarm: Swarm,
        store: ChunkStore,
        gossip: Gossip,
        swarm_name: str,
        trainer_id: ID,
        on_version: OnVersion,
        settings: WeightSettings | None = None,
        peers: Callable[[], list[ID]] | None = None,
        encoding: str = w.DEFAULT_ENCODING,
    ) -> None:
        """``peers``: whom to ask for chunks and manifests (default: every connected peer); ``encoding``: the one
        this node's engine runs (protocols/weights.py, ``RECEIVED_ENCODINGS``)."""
        settings = settings or WeightSettings()
        self.swarm = swarm
        self.client = WeightsClient(swarm.host)
        self.peers = peers or swarm_peers(swarm)
        self.store = store
        self.gossip = gossip
        self.swarm_name = swarm_name
        self.trainer_id = trainer_id
        self.on_version = on_version
        self.settings = settings
        self.encoding = encoding
        self.has_own = False  # a version in this node's own encoding has been adopted: the default one no longer is
        self._cancelled_in_a_row = 0
        self.strikes = Strikes(limit=2)  # corrupt chunks and forged manifests: two and a peer is never asked again
        self.conduct = Conduct(self.strikes)  # peers' standing as chunk sources, across versions (fetcher.py)
        self.current: int = -1
        self.target: tuple[int, bytes, w.Manifest] | None = None
        self.forged_manifests = 0
        self.heard_at: dict[int, float] = {}  # version -> when its signed manifest was accepted
        self.last_swap_seconds: float | None = None  # from a version's announcement to the engine running it
        self._pending_ids: set[bytes] = set()  # announced manifests being fetched
        # manifest id -> (version, peers other than the trainer heard announcing it): whether ours would add anything
        self._announcers: dict[bytes, tuple[int, set[ID]]] = {}
        self.announced = 0  # versions this node announced on installing them
        self._announce_slots = trio.Semaphore(4)
        self._announce_failures: dict[str, int] = {}
        self._trainer_asked = trio.Event()
        self.download: PlanDownload | None = None
        self._target_changed = trio.Event()
        self.routes: dict[str, int] = {"built": 0, "full": 0, "patch": 0}  # steps taken, by route
        self.last_plan: list[tuple[int, str, int]] = []  # (version, route, bytes to fetch) of the last plan
        self.bad_links = 0  # builds refused: damaged chunks, parents whose bits did not give the hashed result
        self._build_failures: dict[bytes, int] = {}
        self._nursery: trio.Nursery | None = None
        self._expecting: dict[bytes, float] = {}  # chunk -> until when (trio's clock) a push is bringing it
        self._push: PushState | None = None  # the newest plan of a version being chased
        self._plan_taken = trio.Event()  # set (and replaced) each time a new plan is taken
        self.pushed_chunks = 0  # taken from pushes (the origin's, and relays)
        self.relayed_chunks = 0  # pushed on to the plan's other peers
        self.relayed_bytes = 0
        self.early_relays = 0  # relay messages that came before this node's plan of their version
        self.refused_pushed = 0  # pushed chunks not taken: not expected from that peer, or not of the version
        # registered now, before the node connects, so that identify tells the origin this node takes pushes
        swarm.host.set_stream_handler(
            w.PUSH_PROTOCOL_ID,
            serve(
                "push",
                self._on_push,
                w.MAX_PUSH_FRAME,
                w.MAX_PUSH_REPLY,
                timeout=60.0,
                admit=self._admit_push,
                max_containers=w.PUSH_CONTAINERS,
                streams_per_peer=PUSH_STREAMS_PER_PEER,
            ),
        )

    async def run(self) -> None:
        await self._resume()  # a version fully on disk is usable at once
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self.gossip.listen, announce_topic(self.swarm_name), self._on_announce)
            nursery.start_soon(self._poll_trainer)
            nursery.start_soon(self._download_loop)

    def status(self) -> dict[str, Any]:
        """What a user (or a test harness) wants to see: where this node is and where it is going."""
        out: dict[str, Any] = {
            "weights_version": self.current,
            "peers_struck": dict(self.strikes.counts),
            "forged_manifests": self.forged_manifests,
        }
        if self.last_swap_seconds is not None:
            out["last_swap_seconds"] = round(self.last_swap_seconds, 3)
        out["routes"] = dict(self.routes)
        if self.pushed_chunks or self.relayed_chunks or self.refused_pushed:
            out["push"] = {
                "took": self.pushed_chunks,
                "relayed": self.relayed_chunks,
                "refused": self.refused_pushed,
                "early": self.early_relays,
            }
        if self.bad_links:
            out["bad_links"] = self.bad_links
        if self.conduct.benches:
            out["chunk_peers_benched"] = self.conduct.benches
        d = self.download
        if d is not None and d.missing and self.target is not None and self.target[0] > self.current:
            have = d.wanted_count - len(d.missing)
            out["downloading"] = {"version": self.target[0], "have": have, "of": d.wanted_count}
        return out

    async def _on_announce(self, sender: ID, message: dict[str, Any]) -> None:
        """Handle each announcement in its own task (a peer that never answers must not hold up the others), at
        most a few at once; versions not newer than what we hold or chase are ignored, each manifest id once."""
        version, mid = w.parse_announce(message)
        encoding = w.parse_encoding(message, w.ENCODINGS)
        if sender != self.trainer_id and version > self.current and not self.strikes.is_banned(sender):
            self._heard_announcing(sender, version, mid)  # a banned peer cannot quiet this node
        if encoding is not None and not takes(encoding, self.encoding, self.has_own):
            return  # a version in an encoding this node does not run: not even its manifest is fetched
        target = self._floor(encoding)
        banned = self.strikes.is_banned(sender)
        if not policy.take_announcement(version, mid, self.current, target, self._pending_ids, banned):
            return
        self._pending_ids.add(mid)
        self._nursery.start_soon(self._consider_announced, sender, mid)

    def _heard_announcing(self, sender: ID, version: int, mid: bytes) -> None:
        """Count the peers announcing a version newer than ours (up to what the rule needs; a bounded table)."""
        _, heard = self._announcers.setdefault(mid, (version, set()))
        if len(heard) < policy.ANNOUNCE_REDUNDANCY:
            heard.add(sender)
        while len(self._announcers) > policy.MAX_PENDING_ANNOUNCEMENTS:
            del self._announcers[next(iter(self._announcers))]  # the oldest heard

    async def _consider_announced(self, sender: ID, mid: bytes) -> None:
        try:
            # ask the trainer first (once, at start): a replayed old announcement must not be a new node's first pick
            with trio.move_on_after(self.settings.manifest_timeout):
                await self._trainer_asked.wait()
            async with self._announce_slots:
                if not await self.consider(sender, mid) and sender != self.trainer_id:
                    self._announce_failures[str(sender)] = self._announce_failures.get(str(sender), 0) + 1
                    if policy.strike_announcer(self._announce_failures[str(sender)]):
                        self.strikes.strike(sender)
        finally:
            self._pending_ids.discard(mid)

    async def _poll_trainer(self) -> None:
        """Gossip can miss a late joiner; ask the trainer for its newest manifest now and then."""
        while True:
            if self.trainer_id in self.swarm.host.get_connected_peers():
                await self.consider(self.trainer_id, None, self.settings.request_timeout)
                self._trainer_asked.set()
            await trio.sleep(self.settings.poll_interval)

    async def consider(self, peer: ID, mid: bytes | None, timeout: float | None = None) -> bool:
        """Fetch a manifest from ``peer`` (``mid``, or its newest); if the trusted trainer signed it, it is the one
        asked for, and it is newer, make it the target. False when ``peer`` gave nothing usable."""
        known = self.store.manifest(mid) if mid else None
        if known is None:
            try:
                got = await self._request_manifest(peer, mid, timeout or self.settings.manifest_timeout)
                if got is None:
                    return True  # the newest there is the one we hold or chase already
                signed, manifest = got
            except ForgedManifest as exc:
                self.forged_manifests += 1
                self.strikes.strike(peer)
                log.warning("rejected a manifest from %s: %s", peer, exc)
                return False
            except (ProtocolError, Exception) as exc:
                log.debug("no manifest from %s: %s", peer, exc)
                return False
            mid = manifest_id(signed)
        else:
            signed, manifest = known
        if not self.takes(manifest):
            return True  # a good manifest, of an encoding this node does not run
        if policy.is_news(manifest.version, self.current, self._floor(manifest.encoding)):
            self._adopt(signed, manifest, mid)
        return True

    def _newest_known(self) -> bytes | None:
        """The manifest a poll for the newest names as held (its ``have``): the one chased, else the newest here."""
        if self.target is not None:
            return self.target[1]
        latest = self.store.latest()
        return latest[0] if latest is not None else None

    def _floor(self, encoding: str | None) -> int | None:
        """The version a manifest in ``encoding`` must be newer than to become the target (``news_floor``)."""
        if self.target is None:
            return None
        return news_floor((self.target[0], self.target[2].encoding), encoding or "", self.encoding)

    def takes(self, manifest: w.Manifest) -> bool:
        """Whether this node runs versions in ``manifest``'s encoding (now)."""
        return takes(manifest.encoding, self.encoding, self.has_own)

    def _adopt(self, signed: w.SignedManifest, manifest: w.Manifest, mid: bytes) -> None:
        """A verified manifest of a newer version: the new target."""
        self.store.add_manifest(signed, manifest)
        self.has_own = self.has_own or manifest.encoding == self.encoding
        self.target = (manifest.version, mid, manifest)
        self.heard_at[manifest.version] = time.monotonic()
        log.info(
            "new version %d announced (%d chunks, %.1f MB)",
            manifest.version,
            len(manifest.all_chunks()),
            manifest.total_size / 1e6,
        )
        self._target_changed.set()

    # -- push (the receiving side; the origin's is node/weights/server.py, OriginPush) -------------------------
    def _admit_push(self, remote: ID) -> None:
        """Before a push's body is read: only the origin, or a peer the origin's current plan names, may push."""
        if self.strikes.is_banned(remote):
            raise NotExpected("this peer is banned here")
        if remote == self.trainer_id:
            return
        if self._push is None or remote.to_bytes() not in self._push.first.values():
            raise NotExpected("no push from this peer is expected")

    def _chasing(self, manifest: w.Manifest) -> bool:
        """A version newer than the one running, and not older than the one being fetched."""
        return manifest.version > self.current and (self.target is None or manifest.version >= self.target[0])

    async def _on_push(self, message: dict[str, Any], remote: ID) -> dict[str, Any]:
        push = w.parse_push(message)
        if push.manifest is not None:
            if remote != self.trainer_id:
                raise NotExpected("only the origin pushes manifests")
            try:
                mid, signed, manifest = self._verify_once(push.manifest)
                if mid != push.mid:
                    raise ForgedManifest("a pushed manifest does not hash to the id it came with")
            except ForgedManifest:
                self.forged_manifests += 1
                raise
            if not self.takes(manifest):
                raise NotExpected(f"this node runs {self.encoding} versions, not {manifest.encoding}")
            if self._chasing(manifest):
                if push.plan is not None:
                    self._take_plan(push.mid, manifest, push.plan)
                if policy.is_news(manifest.version, self.current, self._floor(manifest.encoding)):
                    self._adopt(signed, manifest, push.mid)
        if not push.chunks:
            return w.pushed_reply(0)
        if remote != self.trainer_id and (self._push is None or self._push.mid != push.mid):
            # a relay may come before this node's own plan (the origin's lane here can be slower than to the
            # relayer): wait a little for the plan rather than drop what the relayer will not send again
            self.early_relays += 1
            with trio.move_on_after(policy.PLAN_WAIT):
                while self._push is None or self._push.mid != push.mid:
                    await self._plan_taken.wait()
        state = self._push
        if state is None or state.mid != push.mid or not self._chasing(state.manifest):
            self.refused_pushed += len(push.chunks)
            return w.pushed_reply(0)  # a version no longer chased (or never planned): nothing to take
        sender, origin = remote.to_bytes(), self.trainer_id.to_bytes()
        accepted: list[tuple[bytes, bytes, int]] = []
        for h, data in push.chunks:
            i = state.index.get(h)
            fits = i is not None and len(data) <= state.manifest.chunk_size
            if fits and policy.push_source_ok(sender, origin, state.first.get(i)):
                accepted.append((h, data, i))
            else:
                self.refused_pushed += 1
        fresh = [(h, data) for h, data, _ in accepted if not self.store.has(h)]
        # one thread hop for the message's chunks (each checked against its blake3 before it is stored)
        stored = await trio.to_thread.run_sync(self._store_each, fresh) if fresh else {}
        took = 0
        for h, data, i in accepted:
            if stored.get(h) is False:
                self.strikes.strike(remote)
                log.warning("peer %s pushed a corrupt chunk %s", remote, h.hex()[:12])
                continue
            if stored.get(h):
                took += 1
                self.pushed_chunks += 1
                self._expecting.pop(h, None)
                if self.download is not None:
                    for d in self.download.downloads:
                        d.arrived(h, len(data), remote)
            # relayed even if held already (it came here first by another way): the others wait for it, and the
            # lanes close once this node's whole share went out
            if sender == origin and state.first.get(i) == self.swarm.peer_id.to_bytes():
                self._relay(state, h, data, state.direct.get(i, frozenset()))
        return w.pushed_reply(took)

    def _store_each(self, chunks: list[tuple[bytes, bytes]]) -> dict[bytes, bool]:
        """Blocking: store each chunk whose blake3 matches; hash -> stored (False: it did not match)."""
        out: dict[bytes, bool] = {}
        for h, data in chunks:
            try:
                self.store.write(h, data)
                out[h] = True
            except BadChunk:
                out[h] = out.get(h, False)  # a bad copy beside a good one of the same hash does not undo it
        return out

    def _take_plan(self, mid: bytes, manifest: w.Manifest, plan: w.PushPlan) -> None:
        """The origin's plan for a version being chased: expect its chunks for a while, get ready to relay."""
        if self._push is not None and self._push.mid == mid:
            return
        chunks = manifest.all_chunks()
        first = {i: peer for i, peer in plan.first_holder().items() if i < len(chunks)}
        me = self.swarm.peer_id.to_bytes()
        sizes = chunk_sizes(manifest)
        mine = [i for i, peer in first.items() if peer == me]
        if self._push is not None:
            self._push.close()
        peers = []
        for raw in dict.fromkeys(plan.peers):
            try:
                peers.append(ID(raw))
            except Exception:
                continue
        self._push = PushState(
            mid,
            manifest,
            {h: i for i, h in enumerate(chunks)},
            first,
            plan.from_origin(),
            peers,
            len(mine),
            sum(sizes.get(chunks[i], 0) for i in mine),
        )
        self._plan_taken.set()
        self._plan_taken = trio.Event()
        plan_bytes, n, rate = sum(sizes.get(chunks[i], 0) for i in first), len(plan.peers), self.settings.min_rate
        now = trio.current_time()
        until = {
            "origin": now + policy.push_wait(plan_bytes, n, rate, plan.copies),
            "relay": now + policy.push_wait(plan_bytes, n, rate, relayed=True),
        }
        reachable = {p.to_bytes() for p in self.swarm.host.get_connected_peers() if self.swarm.is_direct(p)}
        self._expecting.clear()  # (the dict itself is shared with the downloads)
        for i, holder in first.items():
            source = policy.push_source(me, holder, self._push.direct.get(i, frozenset()), reachable)
            if source is not None and not self.store.has(chunks[i]):
                self._expecting[chunks[i]] = until[source]

    def _relay(self, state: PushState, h: bytes, data: bytes, skip: frozenset[bytes] = frozenset()) -> None:
        """A chunk the origin gave this node first goes on to the plan's other peers at once (a lane each), but for
        ``skip`` (those the origin sends it to itself), over direct connections only: relays are for control
        traffic (each circuit's bytes are capped)."""
        if self._nursery is None:
            return
        connected = set(self.swarm.host.get_connected_peers())
        for peer in state.peers:
            if peer in (self.swarm.peer_id, self.trainer_id) or peer not in connected or self.strikes.is_banned(peer):
                continue
            if peer.to_bytes() in skip:
                continue
            if not self.swarm.is_direct(peer):
                continue
            lane = state.lanes.get(peer)
            if lane is None:
                send, receive = trio.open_memory_channel(math.inf)
                state.lanes[peer] = lane = send
                self._nursery.start_soon(self._relay_lane, peer, receive, state.share_bytes * len(state.peers))
            lane.send_nowait(w.push(state.mid, [(h, data)]))
        state.relayed += 1
        if state.relayed >= state.mine:
            state.close()

    async def _relay_lane(self, peer: ID, messages: trio.MemoryReceiveChannel, nbytes: int) -> None:
        def written(message: dict[str, Any]) -> None:
            self.relayed_chunks += len(message["chunks"])
            self.relayed_bytes += sum(len(data) for _, data in message["chunks"])

        async with messages:
            with trio.move_on_after(push_deadline(nbytes)):
                await push_lane(self.swarm.host, peer, messages, written)

    async def fetch_manifest(
        self, mid: bytes, sources: list[ID] | None = None
    ) -> tuple[w.SignedManifest, w.Manifest] | None:
        """A manifest by id (a link of a patch chain): from the store, else from the trainer, then a few peers.
        It must be signed by the trusted trainer and hash to ``mid``; a peer answering otherwise is struck."""
        known = self.store.manifest(mid)
        if known is not None:
            return known
        if sources is None:
            others = [p for p in self.peers() if not self.strikes.is_banned(p)]
            sources = policy.manifest_sources(self.trainer_id, others)
        for peer in sources:
            try:
                signed, manifest = await self._request_manifest(peer, mid, self.settings.manifest_timeout)
            except ForgedManifest as exc:
                self.forged_manifests += 1
                self.strikes.strike(peer)
                log.warning("rejected a chain manifest from %s: %s", peer, exc)
                continue
            except Exception as exc:
                log.debug("no manifest %s from %s: %s", mid.hex()[:12], peer, exc)
                continue
            self.store.add_manifest(signed, manifest)
            return signed, manifest
        return None

    async def _request_manifest(
        self, peer: ID, mid: bytes | None, timeout: float
    ) -> tuple[w.SignedManifest, w.Manifest] | None:
        """Manifest ``mid`` (None: the newest, in this node's encoding) from ``peer``, signed by the trusted trainer
        for this swarm, and the one asked for (ForgedManifest otherwise: a replay of another manifest is a lie too).
        None: asked for the newest, the peer's is the one this node holds or chases already. ``timeout`` is never
        below this node's own delay (``policy.OwnDelay``), which the request teaches: a fixed 5 s left a loaded
        newcomer without the manifests of version 0's chain ("no route ... asking again", 103 times at N = 256 on
        one box), and 114-130 of 256 samplers never installed a version."""
        own = self.conduct.own_delay
        timeout = max(timeout, own.seconds())
        with timed_by(own, timeout):
            if mid is None:
                encoding = self.encoding if self.encoding != w.DEFAULT_ENCODING else None
                signed = await self.client.manifest(peer, None, timeout, encoding, self._newest_known())
            else:
                signed = await self.client.manifest(peer, mid, timeout)
        if signed is None:
            return None
        got, signed, manifest = self._verify_once(signed)
        if mid is not None and got != mid:
            raise ForgedManifest("asked for one manifest, answered with another (a replay?)")
        return signed, manifest

    def _verify_once(self, signed: w.SignedManifest) -> tuple[bytes, w.SignedManifest, w.Manifest]:
        """(id, signed, manifest): the trusted trainer's for this swarm, verified and parsed once (``verify_once``:
        one already in the store is the store's)."""
        return verify_once(signed, self.store.manifest, lambda s: verify_manifest(s, self.trainer_id, self.swarm_name))

    def _new_download(self, step: Step) -> Download:
        return Download(
            self.swarm.host,
            self.store,
            step.manifest,
            step.mid,
            self.trainer_id,
            self.peers,
            self.strikes,
            fetch_settings(self.settings),
            wanted=None
            if step.route == "full" and step.manifest.patch is None
            else self.store.route_chunks(step.manifest, step.route),
            conduct=self.conduct,
            expected=self._expecting,
        )

    def build(self, steps: list[Step]) -> tuple[Path, WeightChanges | None]:
        """Blocking: build a plan's versions in order; (the target's model dir, what changed since the plan's base
        when the plan is a built version and patches after it, else None)."""
        path: Path | None = None
        changes: WeightChanges | None = None
        previous: w.Manifest | None = None
        for step in steps:
            m = step.manifest
            if step.route == "built":
                path, changes = self.store.built(m), WeightChanges(m.version, m.version)
                if path is None:
                    raise FileNotFoundError(f"version {m.version} is no longer built here")
            elif step.route == "full":
                path, changes = self.store.assemble(m), None
            else:
                assert previous is not None
                try:
                    path, more = self.store.build_patched(m, previous)
                except TensorMismatch:
                    self.store.unbuild(previous.version)  # its bits are not what the patch was made against
                    raise
                changes = changes.then(more) if changes is not None and more is not None else None
            previous = m
        assert path is not None
        return path, changes

    async def _resume(self) -> None:
        """Start from the newest version this store can build without fetching anything (in an encoding it runs)."""
        held = self.store.manifests()
        self.has_own = any(m.encoding == self.encoding and self.store.built(m) is not None for _, m in held)
        for mid, m in held[:8]:
            if not self.takes(m) or (self.store.built(m) is None and not self.store.complete(m)):
                continue
            steps = await plan(self.store, mid, m)
            if steps is None or plan_bytes(steps) > 0:
                continue
            try:
                path, _ = await trio.to_thread.run_sync(self.build, steps)
            except (PatchError, BadChunk, FileNotFoundError) as exc:
                log.warning("version %d on disk is not usable (%s)", m.version, exc)
                continue
            await self._activate(mid, m, path)
            return

    def _poke_later(self, version: int) -> None:
        async def poke() -> None:
            await trio.sleep(self.settings.poll_interval)
            if self.target is not None and self.target[0] == version and self.current < version:
                self._target_changed.set()

        self._nursery.start_soon(poke)

    async def _download_loop(self) -> None:
        while True:
            await self._target_changed.wait()
            self._target_changed = trio.Event()
            version, mid, manifest = self.target
            if version <= self.current:
                continue
            steps = await plan(self.store, mid, manifest, self.fetch_manifest)
            if steps is None:
                log.warning("no route to version %d yet (a link of its chain is out of reach); asking again", version)
                self._poke_later(version)
                continue
            self.last_plan = [(st.manifest.version, st.route, st.cost) for st in steps]
            download = PlanDownload([self._new_download(st) for st in steps if st.route != "built"])
            self.download = download
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._cancel_on_newer, download, version, scope)
                    await download.run()
                    nursery.cancel_scope.cancel()
            if scope.cancelled_caught:
                self._cancelled_in_a_row += 1
                continue
            self._cancelled_in_a_row = 0
            try:
                path, changes = await trio.to_thread.run_sync(self.build, steps)
            except (PatchError, BadChunk, FileNotFoundError) as exc:
                self.bad_links += 1
                failures = self._build_failures[mid] = self._build_failures.get(mid, 0) + 1
                again = policy.rebuild_now(failures)
                log.warning("version %d not built (%s); %s", version, exc, "fetching again" if again else "")
                if again:
                    self._target_changed.set()  # plan again: the bad chunk is gone, the suspect parent unbuilt
                else:
                    self._poke_later(version)
                continue
            for st in steps:
                self.routes[st.route] += 1
            await self._activate(mid, manifest, path, changes)

    async def _cancel_on_newer(self, download: PlanDownload, version: int, scope: trio.CancelScope) -> None:
        """A newer target cancels this download (chunks already stored are kept for the next one), unless it
        is mostly done or the previous download was cancelled too: where the trainer publishes faster than a
        link moves a version, cancelling every time would leave the node holding nothing usable, forever.
        A download being finished that stops moving (its last chunks were garbage-collected everywhere) is
        cancelled after ``stall_timeout`` seconds without progress, or as long as a chunk reply may take here
        (``policy.reply_deadline``'s floor: on a loaded node a 10 s stall was every reply still on its way)."""
        await self._target_changed.wait()
        if policy.cancel_for_newer(download.fraction_done(), self.settings.finish_fraction, self._cancelled_in_a_row):
            scope.cancel()
            return
        log.info("version %d is %.0f%% here: finishing it first", version, 100 * download.fraction_done())
        while True:
            left = len(download.missing)
            await trio.sleep(max(self.settings.stall_timeout, self.conduct.own_delay.seconds()))
            if len(download.missing) == left:
                log.warning("version %d stalled with %d chunks to go; moving on to the newest", version, left)
                scope.cancel()
                return

    async def _activate(
        self, mid: bytes, manifest: w.Manifest, path: Path | None = None, changes: WeightChanges | None = None
    ) -> None:
        if path is None:
            path = await trio.to_thread.run_sync(self.store.assemble, manifest)
        if changes is not None and changes.base == changes.version:
            changes = None  # a built version alone, no patch applied: what changed is not known, load it whole
        await self.on_version(manifest.version, path, changes)
        self._build_failures.pop(mid, None)
        self.current = manifest.version
        heard = self.heard_at.pop(manifest.version, None)
        if heard is not None:
            self.last_swap_seconds = time.monotonic() - heard
        for v in [v for v in self.heard_at if v < manifest.version]:
            del self.heard_at[v]
        _, others = self._announcers.pop(mid, (0, set()))
        for old in [m for m, (v, _) in self._announcers.items() if v <= manifest.version]:
            del self._announcers[old]
        if policy.announce_installed(len(others), policy.ANNOUNCE_REDUNDANCY):
            try:
                await self.gossip.publish(
                    announce_topic(self.swarm_name), w.announce(manifest.version, mid, manifest.encoding)
                )
                self.announced += 1
            except Exception as exc:
                log.debug("announce failed: %s", exc)
        await trio.to_thread.run_sync(self.store.gc, self.settings.keep_versions)
