"""Strikes for provable misbehaviour (a forged rollout, a corrupt chunk, a forged manifest): the one place a
peer earns them. ``limit`` strikes and the peer is banned. Normal refusals (stale, rate-limited) never strike."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Strikes:
    limit: int
    max_peers: int = 100_000  # beyond this, the oldest entries are forgotten: state stays bounded under Sybils
    counts: dict[str, int] = field(default_factory=dict)
    banned: dict[str, None] = field(default_factory=dict)  # insertion-ordered set

    def strike(self, peer: object) -> bool:
        """Count one strike against ``peer``; True when that bans it."""
        key = str(peer)
        self.counts[key] = self.counts.pop(key, 0) + 1  # re-inserted: most recently struck last
        for table in (self.counts, self.banned):
            while len(table) > self.max_peers:
                del table[next(iter(table))]
        if self.counts[key] >= self.limit and key not in self.banned:
            self.banned[key] = None
            return True
        return False

    def is_banned(self, peer: object) -> bool:
        return str(peer) in self.banned
