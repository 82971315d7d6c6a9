"""Strikes for provable misbehaviour (a forged rollout, a corrupt chunk, a forged manifest): the one place a
peer earns them. ``limit`` strikes and the peer is banned. Normal refusals (stale, rate-limited) never strike."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Strikes:
    limit: int
    counts: dict[str, int] = field(default_factory=dict)
    banned: set[str] = field(default_factory=set)

    def strike(self, peer: object) -> bool:
        """Count one strike against ``peer``; True when that bans it."""
        key = str(peer)
        self.counts[key] = self.counts.get(key, 0) + 1
        if self.counts[key] >= self.limit and key not in self.banned:
            self.banned.add(key)
            return True
        return False

    def is_banned(self, peer: object) -> bool:
        return str(peer) in self.banned
