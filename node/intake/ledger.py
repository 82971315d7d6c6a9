"""Nothing accepted is lost, and this proves it: every accepted group ends trained, stale, without signal, or
still buffered. ``unaccounted`` is zero when the books balance."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

OTHERS = "(others)"


@dataclass
class Ledger:
    groups_accepted: int = 0
    rollouts_accepted: int = 0
    accepted_by_peer: dict[str, int] = field(default_factory=dict)
    groups_trained: int = 0
    groups_stale: int = 0
    groups_no_signal: int = 0

    def accept(self, peer: str, rollouts: int, max_peers: int = 10_000) -> None:
        self.groups_accepted += 1
        self.rollouts_accepted += rollouts
        self.accepted_by_peer[peer] = self.accepted_by_peer.get(peer, 0) + rollouts
        if len(self.accepted_by_peer) > max_peers:  # bounded: the least recently added peers fold into one line
            oldest = next(p for p in self.accepted_by_peer if p != OTHERS)
            self.accepted_by_peer[OTHERS] = self.accepted_by_peer.get(OTHERS, 0) + self.accepted_by_peer.pop(oldest)

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
