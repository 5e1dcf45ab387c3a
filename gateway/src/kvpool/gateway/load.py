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
import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from kvpool.gateway.candidates import FloatArray, InstanceLoad, IntArray, PrefixHit

TTFT_EWMA_ALPHA = 0.2


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
    slot: int = -1


class LoadTracker:
    """In-flight requests and queued prefill tokens per instance, and a TTFT EWMA.

    Kept as arrays indexed by a slot per instance name, so a routing decision reads the loads
    of a thousand candidates in one fancy-indexing step (:meth:`columns`).
    """

    def __init__(self) -> None:
        self._slot: dict[str, int] = {}
        self._inflight: IntArray = np.zeros(16, dtype=np.int64)
        self._queued: IntArray = np.zeros(16, dtype=np.int64)
        self._ttft: FloatArray = np.full(16, math.nan, dtype=np.float64)
        self._ids = itertools.count()

    def slot(self, instance: str) -> int:
        """The instance's position in the load arrays (assigned on first sight)."""
        slot = self._slot.get(instance)
        if slot is None:
            slot = len(self._slot)
            if slot == len(self._inflight):
                grow = len(self._inflight)
                self._inflight = np.concatenate([self._inflight, np.zeros(grow, np.int64)])
                self._queued = np.concatenate([self._queued, np.zeros(grow, np.int64)])
                self._ttft = np.concatenate([self._ttft, np.full(grow, math.nan)])
            self._slot[instance] = slot
        return slot

    def slots(self, instances: Iterable[str]) -> IntArray:
        return np.fromiter((self.slot(n) for n in instances), dtype=np.int64)

    def columns(self, slots: IntArray) -> tuple[IntArray, IntArray, FloatArray]:
        """In-flight, queued prefill tokens and TTFT (NaN: unmeasured) of ``slots``."""
        return self._inflight[slots], self._queued[slots], self._ttft[slots]

    def load(self, instance: str) -> InstanceLoad:
        slot = self._slot.get(instance)
        if slot is None:
            return InstanceLoad()
        ttft = float(self._ttft[slot])
        return InstanceLoad(
            int(self._inflight[slot]),
            int(self._queued[slot]),
            None if math.isnan(ttft) else ttft,
        )

    def start(self, instance: str, prefill_tokens: int, now: float) -> Ticket:
        slot = self.slot(instance)
        self._inflight[slot] += 1
        self._queued[slot] += prefill_tokens
        return Ticket(next(self._ids), instance, prefill_tokens, now, slot=slot)

    def first_byte(self, ticket: Ticket, now: float) -> float:
        """Mark the first byte of the answer; returns the TTFT it measured."""
        ttft = max(0.0, now - ticket.started_at)
        if ticket.first_byte or ticket.done:
            return ttft
        ticket.first_byte = True
        ticket.first_byte_at = now
        slot = ticket.slot
        self._queued[slot] = max(0, int(self._queued[slot]) - ticket.prefill_tokens)
        prev = float(self._ttft[slot])
        self._ttft[slot] = ttft if math.isnan(prev) else prev + TTFT_EWMA_ALPHA * (ttft - prev)
        return ttft

    def finish(self, ticket: Ticket) -> None:
        """The request ended (answered, failed or cancelled); idempotent."""
        if ticket.done:
            return
        ticket.done = True
        slot = ticket.slot
        self._inflight[slot] = max(0, int(self._inflight[slot]) - 1)
        if not ticket.first_byte:
            self._queued[slot] = max(0, int(self._queued[slot]) - ticket.prefill_tokens)

    def forget(self, instance: str) -> None:
        slot = self._slot.get(instance)
        if slot is not None:
            self._inflight[slot] = 0
            self._queued[slot] = 0
            self._ttft[slot] = math.nan


class PendingPrefixes:
    """chunk hash → (instance, expiry) for prompts routed moments ago; bounded, TTL'd.

    ``max_entries`` bounds memory (oldest dropped first). An entry recorded with the request's
    load :class:`Ticket` lives while that request is still prefilling (its KV is not stored
    yet, so no admit event can have reached the index: a prefill longer than the TTL must not
    let the next same-prefix request go to a cold instance) and for ``ttl_s`` after its first
    byte, by which time the controller's index has normally caught up; a request that ended
    without an answer drops its entries. An entry without a ticket (a prefetch target) lives
    ``ttl_s`` from when it was recorded. Entries are also indexed by hash, so the pending hits
    of every instance are found from the prompt's first chunk, not by asking each instance.
    """

    def __init__(self, ttl_s: float = 2.0, max_entries: int = 200_000) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[str, int], tuple[float, Ticket | None]] = OrderedDict()
        self._by_hash: dict[int, set[str]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def record(
        self, instance: str, hashes: Sequence[int], now: float, ticket: Ticket | None = None
    ) -> None:
        entry = (now + self.ttl_s, ticket)
        for h in hashes:
            key = (instance, h)
            if self._entries.pop(key, None) is None:
                self._by_hash.setdefault(h, set()).add(instance)
            self._entries[key] = entry
        self._expire(now)
        while len(self._entries) > self.max_entries:
            self._drop(self._entries.popitem(last=False)[0])

    def _drop(self, key: tuple[str, int]) -> None:
        instance, h = key
        holders = self._by_hash.get(h)
        if holders is not None:
            holders.discard(instance)
            if not holders:
                del self._by_hash[h]

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
            self._drop(self._entries.popitem(last=False)[0])

    def hit(self, instance: str, hashes: Sequence[int], now: float) -> int:
        """Leading chunks of ``hashes`` recorded for ``instance`` and still alive."""
        n = 0
        for h in hashes:
            entry = self._entries.get((instance, h))
            if entry is None or not self._alive(entry, now):
                break
            n += 1
        return n

    def hits(self, hashes: Sequence[int], now: float) -> dict[str, int]:
        """Every instance with a live pending prefix of ``hashes``: its leading chunks."""
        if not hashes:
            return {}
        holders = self._by_hash.get(hashes[0])
        if not holders:
            return {}
        # :meth:`hit` for each holder; the chunks of one recorded prompt share one entry, so
        # an entry's liveness is checked once per run of it (a hot prefix has hundreds of holders)
        entries = self._entries
        ttl = self.ttl_s
        out: dict[str, int] = {}
        for inst in holders:
            n = 0
            last: tuple[float, Ticket | None] | None = None
            for h in hashes:
                entry = entries.get((inst, h))
                if entry is None:
                    break
                if entry is not last:
                    expiry, ticket = entry  # _alive, inlined
                    if ticket is None:
                        if expiry <= now:
                            break
                    elif ticket.first_byte_at is not None:
                        if ticket.first_byte_at + ttl <= now:
                            break
                    elif ticket.done:
                        break
                    last = entry
                n += 1
            if n:
                out[inst] = n
        return out


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
