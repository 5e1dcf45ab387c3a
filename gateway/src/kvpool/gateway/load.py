"""Per-instance load and optimistic prefix entries, as the router sees them. Pure: the
caller passes the clock.

Why this module exists: the controller learns that an instance holds a prefix only after
the instance has prefilled it and LMCache has reported the admit (hundreds of milliseconds
or more). A burst of requests sharing one new prefix would, in that window, scatter over
the pool and prefill it N times. :class:`PendingPrefixes` remembers for a short TTL which
instance each just-routed prompt's chunk hashes went to, so the next request of the burst
follows the first. :class:`LoadTracker` counts what is in flight per instance: requests,
prefill tokens not yet answered by a first byte, and a recent-TTFT average.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.gateway.routing import InstanceLoad, PrefixHit

TTFT_EWMA_ALPHA = 0.2


@dataclass
class _Stats:
    inflight: int = 0
    queued_prefill_tokens: int = 0
    ttft_s: float | None = None


@dataclass
class Ticket:
    """One request admitted to one instance; hand it back on first byte and at the end."""

    id: int
    instance: str
    prefill_tokens: int
    started_at: float
    first_byte: bool = False
    done: bool = False
    first_byte_at: float | None = None


class LoadTracker:
    """In-flight requests and queued prefill tokens per instance, and a TTFT EWMA."""

    def __init__(self) -> None:
        self._stats: dict[str, _Stats] = {}
        self._ids = itertools.count()

    def load(self, instance: str) -> InstanceLoad:
        s = self._stats.get(instance)
        if s is None:
            return InstanceLoad()
        return InstanceLoad(s.inflight, s.queued_prefill_tokens, s.ttft_s)

    def start(self, instance: str, prefill_tokens: int, now: float) -> Ticket:
        s = self._stats.setdefault(instance, _Stats())
        s.inflight += 1
        s.queued_prefill_tokens += prefill_tokens
        return Ticket(next(self._ids), instance, prefill_tokens, now)

    def first_byte(self, ticket: Ticket, now: float) -> float:
        """Mark the first byte of the answer; returns the TTFT it measured."""
        ttft = max(0.0, now - ticket.started_at)
        if ticket.first_byte or ticket.done:
            return ttft
        ticket.first_byte = True
        ticket.first_byte_at = now
        s = self._stats.setdefault(ticket.instance, _Stats())
        s.queued_prefill_tokens = max(0, s.queued_prefill_tokens - ticket.prefill_tokens)
        s.ttft_s = ttft if s.ttft_s is None else s.ttft_s + TTFT_EWMA_ALPHA * (ttft - s.ttft_s)
        return ttft

    def finish(self, ticket: Ticket) -> None:
        """The request ended (answered, failed or cancelled); idempotent."""
        if ticket.done:
            return
        ticket.done = True
        s = self._stats.setdefault(ticket.instance, _Stats())
        s.inflight = max(0, s.inflight - 1)
        if not ticket.first_byte:
            s.queued_prefill_tokens = max(0, s.queued_prefill_tokens - ticket.prefill_tokens)

    def forget(self, instance: str) -> None:
        self._stats.pop(instance, None)


class PendingPrefixes:
    """chunk hash → (instance, expiry) for prompts routed moments ago; bounded, TTL'd.

    ``max_entries`` bounds memory (oldest dropped first). An entry recorded with the request's
    load :class:`Ticket` lives while that request is still prefilling (its KV is not stored
    yet, so no admit event can have reached the index: a prefill longer than the TTL must not
    let the next same-prefix request go to a cold instance) and for ``ttl_s`` after its first
    byte, by which time the controller's index has normally caught up; a request that ended
    without an answer drops its entries. An entry without a ticket (a prefetch target) lives
    ``ttl_s`` from when it was recorded.
    """

    def __init__(self, ttl_s: float = 2.0, max_entries: int = 200_000) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[str, int], tuple[float, Ticket | None]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def record(
        self, instance: str, hashes: Sequence[int], now: float, ticket: Ticket | None = None
    ) -> None:
        entry = (now + self.ttl_s, ticket)
        for h in hashes:
            key = (instance, h)
            self._entries.pop(key, None)
            self._entries[key] = entry
        self._expire(now)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def _alive(self, entry: tuple[float, Ticket | None], now: float) -> bool:
        expiry, ticket = entry
        if ticket is None:
            return expiry > now
        if ticket.first_byte_at is not None:
            return ticket.first_byte_at + self.ttl_s > now
        return not ticket.done  # still prefilling; ended without an answer: nothing was stored

    def _expire(self, now: float) -> None:
        while self._entries:
            if self._alive(next(iter(self._entries.values())), now):
                break
            self._entries.popitem(last=False)

    def hit(self, instance: str, hashes: Sequence[int], now: float) -> int:
        """Leading chunks of ``hashes`` recorded for ``instance`` and still alive."""
        n = 0
        for h in hashes:
            entry = self._entries.get((instance, h))
            if entry is None or not self._alive(entry, now):
                break
            n += 1
        return n


def extend_hit(indexed: PrefixHit | None, chunks: int, location: str) -> PrefixHit | None:
    """The index's hit, extended to ``chunks`` leading chunks held at ``location``."""
    have = indexed.hit_chunks if indexed is not None else 0
    if chunks <= have:
        return indexed
    per_location = dict(indexed.per_location) if indexed is not None else {}
    per_location[location] = chunks - have + per_location.get(location, 0)
    return PrefixHit(chunks, per_location)


def merge_pending(indexed: PrefixHit | None, pending_chunks: int) -> PrefixHit | None:
    """The index's hit, extended by chunks routed here moments ago (tier "pending")."""
    return extend_hit(indexed, pending_chunks, "pending")
