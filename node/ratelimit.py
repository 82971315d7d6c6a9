"""Per-peer token buckets: a peer flooding the trainer is told to slow down, and costs others nothing.

Verification recomputes logprobs with the trainer's model, so an unmetered peer could buy the trainer's CPU
with garbage. Each peer gets ``burst`` requests at once and ``rate`` per second after that; a refused request
carries how long to wait, and the sampler waits and resends (nothing it produced is lost).
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Callable, Sequence
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

    def wait(self, peer: str, cost: float = 1.0) -> float:
        """Seconds until ``peer``'s bucket holds ``cost`` tokens (0: it does now); spends nothing."""
        now = self.clock()
        tokens, last = self._buckets.get(peer, (self.burst, now))
        return max(0.0, (cost - min(self.burst, tokens + (now - last) * self.rate)) / self.rate)

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


def take_all(draws: Sequence[tuple[PeerRateLimiter, str]], cost: float = 1.0) -> None:
    """Spend ``cost`` from every (limiter, key) bucket, or from none: a request one bucket refuses spends nothing
    from the others. RateLimited says when all of them will have it."""
    waits = [limiter.wait(key, cost) for limiter, key in draws]
    if any(w > 0 for w in waits):
        for (limiter, key), w in zip(draws, waits, strict=True):
            if w > 0:
                limiter.refused[key] = limiter.refused.get(key, 0) + 1
        raise RateLimited(max(waits))
    for limiter, key in draws:
        limiter.take(key, cost)


def shares(total: PeerRateLimiter, fraction: float) -> PeerRateLimiter:
    """Buckets for one claimant's share of ``total``: ``fraction`` of its rate and burst (at least one request)."""
    return PeerRateLimiter(total.rate * fraction, max(1.0, total.burst * fraction), total.clock, total.max_peers)


def ip_key(ip: str | None) -> str | None:
    """What one network location's limits are keyed on: an IPv4 address, or an IPv6 /64 (one host's usual
    allocation: a host has 2^64 addresses to rotate through). None for no IP (relayed, unknown) and for loopback
    (this machine's own processes: a local swarm, the operator's tests), which no per-IP limit applies to."""
    if not ip:
        return None
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    if addr.is_loopback:
        return None
    if isinstance(addr, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((addr, 64), strict=False))
    return str(addr)
