"""Which encodings the trainer publishes each version in, and who gets which: a sampler names the encoding it runs
in its ``get_manifest`` polls (protocols/weights.py); the trainer publishes the default (bf16/native, which every
sampler can run) always, and each other known encoding while a connected, not-banned peer asks for it.

What a peer declares is a choice of what it receives, never a limit or a trust decision: a peer can make the trainer
publish at most the known encodings (``RECEIVED_ENCODINGS``: bounded work), and the rollouts of every sampler are
verified the same way whatever it declared. The rules are pure functions; ``Demand`` remembers the declarations
(bounded), ``DemandServer`` hears them and answers each poll in the encoding asked for, and ``EncodingPush`` pushes a
version's first copies only to the peers that run its encoding.

What the trainer verifies an int8-grid sampler's rollouts against: the version as the learner published it (bf16),
as for every sampler, not the dequantized grid. One scoring model per version serves every encoding, and the grid's
distance from it is bounded by the re-grid rule (node/weights/grid.py: at most half a step inside a group's range,
a step at most 1.25x a fresh grid's), the same order as the rounding MLX's own int8 adds: the sampler declares q8
and is held to q8's measured limits. bench/draws_grid.py measures that this holds after 50 versions of grids frozen
at their anchor (bench/results/draws.txt). An int4-grid sampler likewise declares q4 and is held to q4's limits; its
rollouts count only where the trainer accepts q4 (``--accept-quant``), which it does not by default.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID

from node.settings import WeightSettings
from node.weights.grid import GRID_BITS
from node.weights.outbox import Announcer, Extra, Outbox
from node.weights.publish import Publisher
from node.weights.server import NotFound, OriginPush, WeightServer, newest_reply
from node.weights.store import ChunkStore
from protocols import weights as w

MAX_DECLARED = 1 << 14  # peers whose declaration is remembered (the oldest forgotten first)
GRID_QUANT = {enc: f"q{bits}" for enc, bits in GRID_BITS.items()}  # the quantization a grid encoding's samplers run


# -- pure rules ----------------------------------------------------------------------------------------------------
def encodings_to_publish(
    declared: Mapping[str, str],
    connected: Collection[str],
    banned: Callable[[str], bool],
    offered: Collection[str] = w.RECEIVED_ENCODINGS,
) -> list[str]:
    """The encodings to publish a version in besides the default: each known and ``offered`` one some connected,
    not-banned peer declared, in ``RECEIVED_ENCODINGS`` order (so never more than the known encodings, whatever
    peers say)."""
    asked = {enc for peer, enc in declared.items() if peer in connected and not banned(peer)}
    return [e for e in w.RECEIVED_ENCODINGS if e != w.DEFAULT_ENCODING and e in asked and e in offered]


def offered_encodings(accepted_quants: Collection[str]) -> tuple[str, ...]:
    """The encodings a trainer publishes when asked: the default, and each grid encoding whose samplers' rollouts
    it trains on (``--accept-quant``): an int4-grid chain costs a publish per version (an int8-grid one ~19 s at
    1.5B on this box), spent for nothing where every q4 group would be refused."""
    grids = tuple(e for e, quant in GRID_QUANT.items() if quant in accepted_quants)
    return (w.DEFAULT_ENCODING, *grids)


def takes(offered: str, runs: str, has_own: bool) -> bool:
    """Whether a sampler running encoding ``runs`` adopts a version in ``offered``: its own always; another one a
    sampler may ask for (int8-grid, say) never; the trainer's first encoding (bf16/native, or int8 rowwise where the
    trainer chose it: every engine runs it) always for a sampler running the default, else only until a version in
    its own has come (a newcomer starts on it, before the trainer has heard it and published its encoding)."""
    if offered == runs:
        return True
    if offered in w.RECEIVED_ENCODINGS and offered != w.DEFAULT_ENCODING:
        return False
    return runs == w.DEFAULT_ENCODING or not has_own


def news_floor(target: tuple[int, str] | None, offered: str, runs: str) -> int | None:
    """The version an offered one must be newer than, beside the one running: the target's, or one less when the
    target is in another encoding and the offer in the node's own (a node on the default chain moves to its own as
    soon as its own has the same version)."""
    if target is None:
        return None
    version, encoding = target
    return version - 1 if offered == runs and encoding != runs else version


def push_encoding(declared: str | None) -> str:
    """The encoding a peer gets pushed: the one it declared, or the default."""
    return declared or w.DEFAULT_ENCODING


# -- the trainer's side ---------------------------------------------------------------------------------------------
class Demand:
    """Each peer's latest declared encoding (at most ``MAX_DECLARED`` peers); ``wanted()``: what to publish now."""

    def __init__(
        self,
        connected: Callable[[], Iterable[ID]],
        banned: Callable[[str], bool],
        offered: Collection[str] = w.RECEIVED_ENCODINGS,
    ) -> None:
        self.connected = connected
        self.banned = banned
        self.offered = offered
        self.declared: OrderedDict[str, str] = OrderedDict()

    def heard(self, peer: ID, encoding: str) -> None:
        key = str(peer)
        self.declared.pop(key, None)
        self.declared[key] = encoding
        while len(self.declared) > MAX_DECLARED:
            self.declared.popitem(last=False)

    def encoding_of(self, peer: ID) -> str:
        return push_encoding(self.declared.get(str(peer)))

    def wanted(self) -> list[str]:
        return encodings_to_publish(self.declared, {str(p) for p in self.connected()}, self.banned, self.offered)


class DemandServer(WeightServer):
    """The trainer's weights server: a poll for the newest manifest that names an encoding is a declaration, answered
    with the newest manifest in that encoding (the newest default one until there is one)."""

    def __init__(self, demand: Demand, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.demand = demand

    async def handle(self, message: dict[str, Any], remote: ID) -> dict[str, Any]:
        if message.get("t") == "get_manifest" and "encoding" in message:
            _kind, mid = w.parse_request(message)
            encoding = w.parse_encoding(message)
            if mid is None and encoding is not None:
                self.demand.heard(remote, encoding)
                latest = self.store.latest(encoding) or self.store.latest(w.DEFAULT_ENCODING)
                if latest is None:
                    raise NotFound("this peer holds no complete version yet")
                return newest_reply(latest[0], latest[1], w.parse_have_id(message))
        return await super().handle(message, remote)


class EncodingPush(OriginPush):
    """The origin's push of one encoding's versions: only to the peers that run it."""

    def __init__(self, server: WeightServer, encoding: str, demand: Demand, uplink: float = 0.0) -> None:
        super().__init__(server, uplink)
        self.encoding = encoding
        self.demand = demand

    def targets(self) -> list[ID]:
        return [p for p in super().targets() if self.demand.encoding_of(p) == self.encoding]


def trainer_outbox(
    store: ChunkStore,
    key_pair: KeyPair,
    swarm_name: str,
    settings: WeightSettings,
    gossip: Announcer,
    server: WeightServer,
    demand: Demand,
    stage: Callable[[int, Path], object],
    **outbox: Any,
) -> Outbox:
    """The trainer's way out for its versions: the configured encoding's chain (every sampler can run it), and each
    grid encoding's chain (int8-grid, int4-grid) while some connected sampler asks for it; a small version's first
    copies are pushed as it is announced, each encoding's to the samplers that run it. ``outbox``: Outbox's other
    arguments."""
    chain = (settings.chunk_size, settings.encoding, settings.anchor_every, settings.patch_max_fraction)
    publisher = Publisher(store, key_pair, swarm_name, *chain)
    uplink = settings.origin_uplink_mbps * 1e6 / 8
    extras = {
        enc: Extra(
            Publisher(store, key_pair, swarm_name, chain[0], enc, *chain[2:], tag=enc),
            EncodingPush(server, enc, demand, uplink),
        )
        for enc in GRID_BITS
    }
    return Outbox(
        publisher,
        stage,
        gossip,
        swarm_name,
        pusher=EncodingPush(server, w.DEFAULT_ENCODING, demand, uplink),
        extras=extras,
        wanted=demand.wanted,
        **outbox,
    )
