"""Circuit breakers, token buckets and retry backoff. Pure: the caller passes the clock.

Why this module exists: a dead or sick instance must stop receiving traffic after a few
failures and be tried again later without a human (breaker); one API key must not starve the
others (token bucket); a request that failed before any byte reached the client may go to
another instance after a short, jittered, growing pause (backoff). Keeping these pure makes
their timing testable without sleeping.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum


class BreakerState(Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass
class CircuitBreaker:
    """Opens after ``failure_threshold`` consecutive failures; after ``cooldown_s`` lets one
    trial request through (half-open): success closes it, failure opens it again with a
    doubled cooldown (up to ``max_cooldown_s``)."""

    failure_threshold: int = 3
    cooldown_s: float = 2.0
    max_cooldown_s: float = 30.0
    state: BreakerState = BreakerState.CLOSED
    failures: int = 0
    opened_at: float = 0.0
    current_cooldown_s: float = 0.0
    trial_in_flight: bool = False
    #: Called after the state changed (the instance set keeps its list of impaired instances).
    on_change: Callable[[], None] | None = field(default=None, repr=False, compare=False)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def available(self, now: float) -> bool:
        """Whether a request may be sent now (does not reserve the half-open trial)."""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN:
            return now - self.opened_at >= self.current_cooldown_s
        return not self.trial_in_flight

    def acquire(self, now: float) -> bool:
        """Reserve the right to send one request now."""
        if not self.available(now):
            return False
        if self.state is BreakerState.OPEN:
            self.state = BreakerState.HALF_OPEN
            self._changed()
        if self.state is BreakerState.HALF_OPEN:
            self.trial_in_flight = True
        return True

    def success(self) -> None:
        was = self.state
        self.state = BreakerState.CLOSED
        self.failures = 0
        self.current_cooldown_s = 0.0
        self.trial_in_flight = False
        if was is not BreakerState.CLOSED:
            self._changed()

    def failure(self, now: float) -> None:
        self.failures += 1
        self.trial_in_flight = False
        if self.state is BreakerState.HALF_OPEN:
            self._open(
                now, min(self.max_cooldown_s, max(self.cooldown_s, 2 * self.current_cooldown_s))
            )
        elif self.failures >= self.failure_threshold:
            self._open(now, self.cooldown_s)

    def _open(self, now: float, cooldown: float) -> None:
        self.state = BreakerState.OPEN
        self.opened_at = now
        self.current_cooldown_s = cooldown
        self._changed()


@dataclass
class TokenBucket:
    """``rate`` tokens per second, at most ``burst`` saved up."""

    rate: float
    burst: float
    tokens: float = -1.0
    updated: float = 0.0

    def take(self, now: float, cost: float = 1.0) -> float:
        """0.0 when allowed (and charged); otherwise the seconds until it would be."""
        if self.tokens < 0:
            self.tokens, self.updated = self.burst, now
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens >= cost:
            self.tokens -= cost
            return 0.0
        return (cost - self.tokens) / self.rate if self.rate > 0 else float("inf")


class KeyedBuckets:
    """One :class:`TokenBucket` per API key, the least recently used dropped beyond
    ``max_keys`` (memory stays bounded whatever keys clients send)."""

    def __init__(self, rate: float, burst: float, max_keys: int = 10_000) -> None:
        self.rate = rate
        self.burst = burst
        self.max_keys = max_keys
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()

    def take(self, key: str, now: float) -> float:
        bucket = self._buckets.pop(key, None) or TokenBucket(self.rate, self.burst)
        self._buckets[key] = bucket
        while len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)
        return bucket.take(now)

    def __len__(self) -> int:
        return len(self._buckets)


def backoff_s(
    attempt: int, base_s: float = 0.05, cap_s: float = 1.0, rng: random.Random | None = None
) -> float:
    """Full-jitter exponential backoff before retry number ``attempt`` (1-based)."""
    ceiling = min(cap_s, base_s * 2 ** max(0, attempt - 1))
    return (rng or random).uniform(ceiling / 2, ceiling)
