"""Per-peer token buckets: a peer flooding the trainer is told to slow down, and costs others nothing.

Verification recomputes logprobs with the trainer's model, so an unmetered peer could buy the trainer's CPU
with garbage. Each peer gets ``burst`` requests at once and ``rate`` per second after that; a refused request
carries how long to wait, and the sampler waits and resends (nothing it produced is lost).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from protocols.errors import ProtocolError


class RateLimited(ProtocolError):
    code = "rate_limited"

    def __init__(self, retry_after: float) -> None:
        super().__init__(f"too many requests; retry after {retry_after:.2f} s")
        self.retry_after = retry_after


@dataclass
class PeerRateLimiter:
    rate: float  # tokens per second, per peer
    burst: float  # bucket size
    clock: Callable[[], float] = time.monotonic
    max_peers: int = 100_000
    _buckets: dict[str, tuple[float, float]] = field(default_factory=dict)  # peer -> (tokens, last refill)
    refused: dict[str, int] = field(default_factory=dict)

    def take(self, peer: str, cost: float = 1.0) -> None:
        """Spend ``cost`` tokens of ``peer``'s bucket, or raise RateLimited saying when it will have them."""
        now = self.clock()
        tokens, last = self._buckets.get(peer, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        if tokens < cost:
            self._buckets[peer] = (tokens, now)
            self.refused[peer] = self.refused.get(peer, 0) + 1
            raise RateLimited((cost - tokens) / self.rate)
        self._buckets[peer] = (tokens - cost, now)
        if len(self._buckets) > self.max_peers:  # forget the longest-idle peers (their buckets are full again)
            for stale in sorted(self._buckets, key=lambda p: self._buckets[p][1])[: self.max_peers // 10]:
                del self._buckets[stale]
