"""Nothing accepted is lost, and this proves it: every accepted group ends trained, stale, without signal, or
still buffered. ``unaccounted`` is zero when the books balance."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from node.intake.journal import Tally

OTHERS = "(others)"
MAX_PEERS = 10_000  # peers listed by name in ``accepted_by_peer``


def least_valuable(accepted: dict[str, int], n: int) -> list[str]:
    """The ``n`` peers to forget first: least accepted, then least recently accepted (``accepted``'s order)."""
    ranked = sorted((v, i, p) for i, (p, v) in enumerate(accepted.items()) if p != OTHERS)
    return [p for _, _, p in ranked[:n]]


@dataclass
class Ledger:
    groups_accepted: int = 0
    rollouts_accepted: int = 0
    accepted_by_peer: dict[str, int] = field(default_factory=dict)
    groups_trained: int = 0
    groups_stale: int = 0
    groups_no_signal: int = 0

    def accept(self, peer: str, rollouts: int, max_peers: int = MAX_PEERS) -> None:
        self.groups_accepted += 1
        self.rollouts_accepted += rollouts
        # re-inserted: the table's order is least recently accepted first
        self.accepted_by_peer[peer] = self.accepted_by_peer.pop(peer, 0) + rollouts
        if len(self.accepted_by_peer) > max_peers:
            self._fold(max(1, max_peers // 10))

    def _fold(self, n: int) -> None:
        """Bounded: the ``n`` peers with the least accepted, the least recently accepted first among equals, fold
        into one line. A record is what makes a peer trusted: ten thousand identities with one group each must not
        push the oldest honest samplers out of the table (turning them back into newcomers)."""
        for p in least_valuable(self.accepted_by_peer, n):
            self.accepted_by_peer[OTHERS] = self.accepted_by_peer.get(OTHERS, 0) + self.accepted_by_peer.pop(p)

    def absorb(self, tally: Tally) -> None:
        """Groups a journal compaction dropped (their fate known): counted as their records would have been."""
        self.groups_accepted += tally.groups
        self.rollouts_accepted += tally.rollouts
        for peer, n in tally.by_peer.items():
            self.accepted_by_peer[peer] = self.accepted_by_peer.pop(peer, 0) + n
        self.groups_stale += tally.stale
        self.groups_no_signal += tally.no_signal
        if len(self.accepted_by_peer) > MAX_PEERS:
            self._fold(len(self.accepted_by_peer) - MAX_PEERS + MAX_PEERS // 10)

    def unaccounted(self, buffered: int) -> int:
        """Accepted groups whose fate is unknown (0 when the books balance)."""
        done = self.groups_trained + self.groups_stale + self.groups_no_signal + buffered
        return self.groups_accepted - done

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "accepted_by_peer": dict(self.accepted_by_peer)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Ledger:
        known = {k: d[k] for k in asdict(cls()) if k in d}
        return cls(**{**known, "accepted_by_peer": dict(known.get("accepted_by_peer", {}))})
