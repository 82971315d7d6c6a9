"""Serves what this node's store holds: manifests, chunks and have-bitfields. Every peer re-serves.

What one peer may cost this node, checked cheapest first: ``REQUESTS_PER_SECOND`` requests of any kind (a burst of
``REQUEST_BURST``; ``IP_PEERS`` times that from one IP), counted when a frame's length arrives, before its body is
read, decoded or any disk touched: a
flood of have-polls or chunk requests is refused with "rate_limited" and a retry_after (issue 26, 3c: the byte
limit alone let a flood of small requests take the trainer's CPU); then its upload share in bytes/s. At the origin
a peer with neither a lease nor an accepted group draws on one share for all such peers together
(node/weights/policy.py, ``origin_serves_freely``).

Push (``OriginPush``, ``push_lane``; protocols/weights.py): the origin sends the first copies of a small version's
chunks to the samplers it serves as it announces it, one share each, counted as served copies; a lane writes its
messages back to back on one stream and reads the replies at the end, so a far peer costs one round trip, not one
per chunk. Receivers relay their share through lanes of their own (node/weights/sync.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterable, Callable, Iterable, Mapping
from typing import Any

import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID

from node.libp2p.conns import path_rtt
from node.ratelimit import PeerRateLimiter, ip_key, take_all
from node.rpc import PEER_GONE, open_stream, request, serve
from node.weights import policy
from node.weights.manifest import chunk_sizes
from node.weights.store import ChunkStore
from protocols import weights as w
from protocols.errors import ProtocolError
from protocols.framing import FrameReader, unpack, write_message
from protocols.messages import raise_if_error

log = logging.getLogger(__name__)

REQUESTS_PER_SECOND = 50.0  # requests (of any kind) one peer may send: a download polls twice a second and its
REQUEST_BURST = 100.0  # chunk requests carry ~4 MiB each, so an honest peer stays far below this
IP_PEERS = 8  # one IP (an IPv6 /64) may send as many requests as this many peers: a NAT hides several nodes
STRANGERS = "strangers"  # the origin's one upload bucket for every peer without a lease or a record
TRUSTED_RECHECK = 1.0  # seconds the origin reuses a "yes" to "is any peer with a lease or record connected?"


class NotFound(ProtocolError):
    code = "not_found"


class WeightServer:
    """``origin`` (the trainer, which holds every version first) serves like a BitTorrent super-seeder: a chunk
    is served again only once every chunk of the newest version has been served as often, or ``reserve_after``
    seconds after its last copy finished going out (that copy may have been lost with its peer). So the first
    copies go to different peers, who then swap them: this keeps the trainer's upload near one model per version
    however many samplers ask at once. The clock starts when the reply was written, not when it was decided: on
    a slow uplink replies queue for many seconds, and a chunk still on its way out counted as "lost" after 3 s
    (bench/broadcast N=16 at 10 Mbit/s: trainer upload 1.9x a version, worst run 1.7x the bound)."""

    def __init__(
        self,
        store: ChunkStore,
        origin: bool = False,
        reserve_after: float = 3.0,
        upload_per_peer: float = 16 << 20,
        may_fetch: Callable[[ID], bool] | None = None,
        stranger_share: float = policy.STRANGER_SHARE,
    ) -> None:
        """``may_fetch(peer)``: at the origin, whether ``peer`` has a lease or an accepted group (None: everyone
        has); the others together get ``stranger_share`` of one peer's upload share."""
        self.store = store
        self.origin = origin
        self.reserve_after = reserve_after
        # bytes/s any one peer may pull (2 s of burst): a peer pulling everything it can must not starve this
        # node's own work (a sampler's generation) nor the other peers
        self.upload_limit = PeerRateLimiter(upload_per_peer, 2 * upload_per_peer, max_peers=10_000)
        self.request_limit = PeerRateLimiter(REQUESTS_PER_SECOND, REQUEST_BURST, max_peers=10_000)
        self.ip_request_limit = PeerRateLimiter(IP_PEERS * REQUESTS_PER_SECOND, IP_PEERS * REQUEST_BURST)
        self.may_fetch = may_fetch
        rate = upload_per_peer * stranger_share
        self.stranger_limit = PeerRateLimiter(rate, 2 * rate, max_peers=1)
        self.host: IHost | None = None
        self._trusted_seen: tuple[float, bool] = (-TRUSTED_RECHECK, False)  # (when checked, any connected)
        self.stranger_bytes = 0  # served to peers without a lease or record while some were connected
        self._requests = 0
        self._last_served: dict[bytes, float] = {}
        self.bytes_served = 0
        self.chunks_served = 0
        self.throttled = 0
        self._served: dict[bytes, int] = {}
        self._in_flight: dict[bytes, int] = {}  # copies in replies not yet written out
        self.bytes_pushed = 0  # of bytes_served: the origin's pushes (OriginPush)

    def _forget_gone_chunks(self) -> None:
        """Serving counters only for chunks still held: this state must not grow with every version ever served."""
        for table in (self._served, self._last_served, self._in_flight):
            for h in [h for h in table if not self.store.has(h)]:
                del table[h]

    def _floors(self) -> dict[bytes, int]:
        """Per chunk of the newest version, how often every chunk of its route went out (the super-seeding floor).
        Taken per route: nodes holding the parent fetch only the patch, so the full weights of an anchor (asked
        for by newcomers alone) must not hold the patch's floor at zero, nor the other way round."""
        latest = self.store.latest()
        if latest is None:
            return {}
        m = latest[2]
        floors: dict[bytes, int] = {}
        lows = []
        for route in (m.full_chunks(), m.patch_chunks()):
            if route:
                lows.append(low := min(self._served.get(h, 0) for h in route))
                for h in route:
                    floors[h] = max(floors.get(h, 0), low)
        floors[b""] = min(lows, default=0)  # chunks of older versions: the lowest route's floor, as before routes
        return floors

    def _may_serve(self, h: bytes, floors: dict[bytes, int]) -> bool:
        if not self.origin or self._served.get(h, 0) <= floors.get(h, floors.get(b"", 0)):
            return True
        if self._in_flight.get(h):
            return False
        return time.monotonic() - self._last_served.get(h, 0.0) > self.reserve_after

    def reply_sent(self, reply: dict[str, Any], ok: bool) -> None:
        """A reply's write ended: its chunks' re-serve clocks start now; a copy that never went out is uncounted."""
        now = time.monotonic()
        for h, _ in reply.get("found", ()):
            self._copy_ended(h, ok, now)

    def _copy_ended(self, h: bytes, went_out: bool, now: float) -> None:
        left = self._in_flight.get(h, 0) - 1
        if left > 0:
            self._in_flight[h] = left
        else:
            self._in_flight.pop(h, None)
        if went_out:
            self._last_served[h] = now
        elif self._served.get(h):
            self._served[h] -= 1

    def pushed(self, message: dict[str, Any]) -> None:
        """A push message went out: its chunks count as served copies (super-seeding) and uploaded bytes."""
        now = time.monotonic()
        for h, data in message.get("chunks", ()):
            self._served[h] = self._served.get(h, 0) + 1
            self._last_served[h] = now
            self.bytes_served += len(data)
            self.bytes_pushed += len(data)
            self.chunks_served += 1

    def register(self, host: IHost) -> None:
        self.host = host
        host.set_stream_handler(
            w.PROTOCOL_ID,
            serve(
                "weights",
                self.handle,
                w.MAX_REQUEST_FRAME,
                w.MAX_REPLY_FRAME,
                timeout=30.0,
                admit=self.admit,
                streams_per_peer=4,
                reply_sent=self.reply_sent,
            ),
        )

    def admit(self, remote: ID) -> None:
        """Before a request's body is read: one token of the peer's request bucket and of its IP's (``remote`` is
        rpc's Remote; none for loopback or a relayed peer), or RateLimited, spending neither."""
        draws = [(self.request_limit, str(remote))]
        ip = ip_key(getattr(remote, "ip", None))
        if ip is not None:
            draws.append((self.ip_request_limit, ip))
        take_all(draws)

    def _trusted_connected(self, now: float) -> bool:
        """Whether a peer with a lease or an accepted group is connected (a yes is reused for a second)."""
        when, seen = self._trusted_seen
        if (seen and now - when < TRUSTED_RECHECK) or self.host is None:
            return seen
        seen = self.may_fetch is not None and any(self.may_fetch(p) for p in self.host.get_connected_peers())
        self._trusted_seen = (now, seen)
        return seen

    def _charge(self, remote: ID, cost: int) -> bool:
        """Take a chunk request's bytes from the right bucket (RateLimited if it is empty); True when they came
        from the strangers' one bucket."""
        cost = min(cost, int(self.upload_limit.burst))  # one request never costs more than the burst
        stranger = False
        if self.origin and self.may_fetch is not None:
            trusted = self.may_fetch(remote)
            stranger = not policy.origin_serves_freely(trusted, trusted or self._trusted_connected(time.monotonic()))
        if stranger:
            self.stranger_limit.take(STRANGERS, min(float(cost), self.stranger_limit.burst))
        self.upload_limit.take(str(remote), float(cost))
        return stranger

    async def handle(self, message: dict[str, Any], remote: ID) -> dict[str, Any]:
        kind, arg = w.parse_request(message)
        if kind == "get_manifest":
            if arg is None:
                latest = self.store.latest()
                if latest is None:
                    raise NotFound("this peer holds no complete version yet")
                return newest_reply(latest[0], latest[1], w.parse_have_id(message))
            entry = self.store.manifest(arg)
            if entry is None:
                raise NotFound(f"manifest {arg.hex()[:12]} is not held here")
            return entry[0].to_wire()
        if kind == "get_chunks":
            self._requests += 1
            if self._requests % 1024 == 0:
                self._forget_gone_chunks()
            cost = sum(self.store.size(h) for h in arg)
            stranger = self._charge(remote, cost) if cost else False  # raises RateLimited(retry_after)
            found, missing = [], []
            floors = self._floors() if self.origin else {}
            for h in arg:
                if not self._may_serve(h, floors):
                    self.throttled += 1
                    missing.append(h)  # "ask the others first": they will have it soon
                    continue
                # counted before the read (a thread hop), so a request racing this one sees the copy
                self._served[h] = self._served.get(h, 0) + 1
                self._last_served[h] = time.monotonic()
                self._in_flight[h] = self._in_flight.get(h, 0) + 1
                data = await trio.to_thread.run_sync(self.store.read, h)
                if data is None:
                    self._copy_ended(h, False, time.monotonic())
                    missing.append(h)
                else:
                    found.append((h, data))
                    self.stranger_bytes += len(data) if stranger else 0
                    self.bytes_served += len(data)
                    self.chunks_served += 1
            named = w.chunks_request_manifest(message)
            entry = self.store.manifest(named) if named is not None else None
            return w.chunks_reply(found, missing, self.store.bitfield(entry[1]) if entry else None)
        entry = self.store.manifest(arg)
        if entry is None:
            raise NotFound(f"manifest {arg.hex()[:12]} is not held here")
        return w.have_reply(arg, self.store.bitfield(entry[1]))


def newest_reply(mid: bytes, signed: w.SignedManifest, have: bytes | None) -> dict[str, Any]:
    """The answer to a poll for the newest manifest: ``same`` when the asker holds it already."""
    return w.same_reply() if have == mid else signed.to_wire()


class WeightsClient:
    """The client side of the protocol ``WeightServer`` serves: one method per request, each with its frame limits
    and its reply checked, so callers hold parsed data or an exception (RemoteError for a refusal; ``rpc.
    backpressure`` says whether it means "later")."""

    def __init__(self, host: IHost) -> None:
        self.host = host

    async def _ask(self, peer: ID, message: dict[str, Any], max_reply: int, timeout: float) -> dict[str, Any]:
        return await request(
            self.host,
            peer,
            w.PROTOCOL_ID,
            message,
            max_request=w.MAX_REQUEST_FRAME,
            max_reply=max_reply,
            timeout=timeout,
        )

    async def manifest(
        self, peer: ID, mid: bytes | None, timeout: float, encoding: str | None = None, have: bytes | None = None
    ) -> w.SignedManifest | None:
        """Manifest ``mid`` (None: the newest this peer holds, in ``encoding`` if given), still to be verified against
        the trainer's key; None when asked for the newest with ``have`` and that is still the newest there."""
        reply = await self._ask(peer, w.get_manifest(mid, encoding, have), w.MAX_MANIFEST_BODY + 4096, timeout)
        if mid is None and have is not None and w.is_same(reply):
            return None
        return w.SignedManifest.from_wire(reply)

    async def have(self, peer: ID, mid: bytes, n_chunks: int, timeout: float) -> bytes:
        """Which of version ``mid``'s ``n_chunks`` chunks the peer holds, as a bitfield."""
        reply = await self._ask(peer, w.get_have(mid), w.MAX_REPLY_FRAME, timeout)
        return w.parse_have(reply, n_chunks)[1]

    async def chunks(
        self, peer: ID, hashes: list[bytes], mid: bytes, chunk_size: int, n_chunks: int, timeout: float
    ) -> tuple[dict[bytes, bytes], bytes | None]:
        """The chunks among ``hashes`` the peer sent (each still to be checked against its hash), and the bitfield
        of version ``mid`` it piggybacked on the reply, if any."""
        reply = await self._ask(peer, w.get_chunks(hashes, mid), w.MAX_REPLY_FRAME, timeout)
        found, _missing = w.parse_chunks_reply(reply, hashes, chunk_size)
        return found, w.parse_reply_bits(reply, n_chunks)


# -- push (protocols/weights.py: the origin's first copies of a small version, and their relays) -------------------
PUSH_MIN_RATE = 64 << 10  # bytes/s a push lane may not fall below (with a grace): a stalled receiver ends its lane
PUSH_LANE_GRACE = 5.0  # seconds


def push_deadline(nbytes: int) -> float:
    """Seconds a push lane carrying ``nbytes`` may take."""
    return PUSH_LANE_GRACE + nbytes / PUSH_MIN_RATE


async def push_lane(
    host: IHost,
    peer: ID,
    messages: AsyncIterable[dict[str, Any]],
    on_written: Callable[[dict[str, Any]], None] = lambda message: None,
) -> int:
    """Send push messages to ``peer`` one after another on one stream without waiting for each reply (a far peer
    costs one round trip per lane, not one per message), then read the replies: how many chunks it took. A refusal
    or a failure ends the lane quietly: pushes only save round trips, and what does not arrive is fetched by request.
    ``on_written`` hears of each message once it is written out."""
    sent = took = 0
    stream = None
    try:
        stream = await open_stream(host, peer, w.PUSH_PROTOCOL_ID)
        async for message in messages:
            await write_message(stream, message, w.MAX_PUSH_FRAME)
            sent += 1
            on_written(message)
        reader = FrameReader(stream)
        for _ in range(sent):
            reply = unpack(await reader.read_body(w.MAX_PUSH_REPLY), w.MAX_PUSH_REPLY)
            took += w.parse_pushed(raise_if_error(reply))
        await stream.close()
    except BaseException as exc:
        if stream is not None:
            with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                try:
                    await stream.reset()
                except Exception:
                    pass
        if not isinstance(exc, Exception):
            raise  # cancelled (the lane's deadline): the stream is reset, the cancellation goes on
        level = logging.DEBUG if isinstance(exc, (ProtocolError, *PEER_GONE)) else logging.INFO
        log.log(level, "push to %s ended after %d messages: %s: %s", peer, sent, type(exc).__name__, exc)
    return took


class OriginPush:
    """The origin's side of push: whom to push to, and the pushes themselves (counted as served copies by the
    ``WeightServer`` whose store and host it shares, so super-seeding sees them)."""

    def __init__(self, server: WeightServer, uplink: float = 0.0) -> None:
        """``uplink``: this origin's upload in bytes/s (0: unknown), for ``policy.push_copies``."""
        self.server = server
        self.uplink = uplink

    def targets(self) -> list[ID]:
        """Connected peers that speak the push protocol; those the origin serves from their own share first."""
        host, server = self.server.host, self.server
        if host is None:
            return []
        me, peerstore = host.get_id(), host.get_peerstore()
        capable = []
        for p in host.get_connected_peers():
            try:
                if p != me and peerstore.supports_protocols(p, [w.PUSH_PROTOCOL_ID]):
                    capable.append(p)
            except Exception:
                continue  # identify has not told us yet
        trusted = {p for p in capable if server.may_fetch is not None and server.may_fetch(p)}
        return policy.push_targets(capable, trusted)

    def audience(self) -> int:
        return len(self.targets())

    async def push(
        self, mid: bytes, signed: w.SignedManifest, manifest: w.Manifest, manifests_out: trio.Event | None = None
    ) -> int:
        """Send the first copies of ``manifest``'s new chunks to the peers this origin serves, one share each, with the
        plan of who got what (each relays its share to the others as it arrives); with ``copies`` c > 1 each peer also
        gets the c - 1 shares after its own from here, and their relayers skip it. Returns the chunks taken.
        ``manifests_out`` is set once every lane has written the manifest (or ended): announce after it, and a peer
        pushed to holds the manifest when the announcement comes, instead of fetching it a second time."""
        out = manifests_out if manifests_out is not None else trio.Event()
        store = self.server.store
        route = manifest.patch_chunks() if manifest.patch is not None else manifest.full_chunks()
        old = {h for other, m in store.manifests() if other != mid for h in m.all_chunks()}
        sizes = chunk_sizes(manifest)
        pieces = policy.push_pieces(route, old, sizes)
        targets = self.targets()
        if not pieces or not targets or self.server.host is None:
            out.set()
            return 0
        index = {h: i for i, h in enumerate(manifest.all_chunks())}
        network = self.server.host.get_network()
        slowest = max(path_rtt(network, p) for p in targets)
        pushed = sum(sizes.get(h, 0) for h in pieces)
        n, copies = len(targets), policy.push_copies(len(targets), self.uplink, pushed, slowest)
        plan = w.PushPlan([p.to_bytes() for p in targets], [index[h] for h in pieces], copies)
        deadline = push_deadline(copies * pushed)  # every lane shares this uplink
        took, waiting = 0, set(range(n))

        def manifest_out(k: int) -> None:
            waiting.discard(k)
            if not waiting:
                out.set()

        async def lane(k: int, peer: ID) -> None:
            nonlocal took

            def written(message: dict[str, Any]) -> None:
                manifest_out(k)
                self.server.pushed(message)

            try:
                with trio.move_on_after(deadline):
                    others = [h for j in range(1, copies) for h in pieces[(k + j) % n :: n]]
                    batches = policy.lane_messages(pieces[k::n], others, sizes)
                    messages = self._messages(mid, signed, plan, batches, held)
                    took += await push_lane(self.server.host, peer, messages, written)
            finally:
                manifest_out(k)

        # every lane sends from one read of the pieces (at most MAX_PUSH_VERSION bytes, held for the push): read
        # by each of 14 lanes, a piece at a time through a worker thread, they were a seventh of the origin's CPU
        held = await trio.to_thread.run_sync(lambda: {h: store.read(h) for h in pieces})
        async with trio.open_nursery() as nursery:
            for k, peer in enumerate(targets):
                nursery.start_soon(lane, k, peer)
        return took

    async def _messages(
        self,
        mid: bytes,
        signed: w.SignedManifest,
        plan: w.PushPlan,
        batches: Iterable[list[bytes]],
        held: Mapping[bytes, bytes | None],
    ) -> AsyncIterable[dict[str, Any]]:
        """The manifest and the plan first (small: every peer learns who relays what before any relay reaches it),
        then the chunks (``held``: read once for every lane), a message per batch (``policy.lane_messages``: this
        peer's own share a piece a message, so the first relays start after the first piece, not the last)."""
        yield w.push(mid, [], signed, plan)
        for batch in batches:
            chunks = [(h, data) for h in batch if (data := held.get(h)) is not None]
            if chunks:
                yield w.push(mid, chunks)
