"""Optimistic prefix entries: which instance each just-routed prompt went to. Pure: the caller
passes the clock.

Why this module exists: the controller learns that an instance holds a prefix only after the
instance has prefilled it and LMCache has reported the admit (hundreds of milliseconds or more).
A burst of requests sharing one new prefix would, in that window, scatter over the pool and
prefill it N times. :class:`PendingPrefixes` remembers which instance each routed prompt's chunk
hashes went to, so the next request of the burst follows the first.

They stand for a second thing the index cannot see: the engine's own prefix cache on the device
(vLLM's HBM blocks). LMCache reports its tiers (DDR, disk, remote) to the controller, never
the device's, and where DDR is smaller than the device KV — or evicts sooner — an instance
still holds on the device the prompts it computed a few dozen seconds ago while the index says
it holds nothing. And a conversation's next turn, minutes later, is best sent back to the
instance that has its history while that instance keeps part of it, which is what sglang's
routing tree does. So an entry outlives the admit: ``ttl_s`` after the first byte (120 s by
default, ``guards.pendingTtlSeconds``). On the conversation trace's fleet benchmark (16 sim
instances, caches holding half of the window) 2 s gave kv-aware a simulated hit ratio of
0.08-0.16 against a pooled-cache bound of 0.23-0.28, 30 s 0.11-0.25, 120 s 0.19-0.25 with a
TTFT p90 as low or lower, in each of six windows (the benchmark's two and four held out).

At fleet scale a hot prefix (a shared system prompt) is pending on hundreds of instances at
once, so the answer is built like the index's (:mod:`kvpool.protocol.index_groups`): per chunk
hash, a bitmask of the instances with a live entry, and a lookup walks the prompt once, ANDing
masks; what it returns is where holders stop (chunks, bitmask), not one object per holder.
Entries die eagerly — at their deadline (a heap), or when their request ends without an answer
(the :class:`~kvpool.gateway.load.Ticket` tells) — so a mask only ever holds live entries.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvpool.gateway.candidates import PrefixHit
from kvpool.gateway.load import Ticket

__all__ = ["PendingPrefixes", "extend_hit", "merge_pending"]

#: ``(chunks, bitmask)``: the instances (bits of :meth:`PendingPrefixes.names`) whose pending
#: prefix of a prompt is ``chunks`` leading chunks long.
Ends = list[tuple[int, int]]


@dataclass(eq=False)
class _Record:
    """One routed prompt: its chunk hashes pending on one instance (bit ``inst``)."""

    inst: int
    hashes: tuple[int, ...]
    ticket: Ticket | None


class PendingPrefixes:
    """Chunk hashes of prompts routed moments ago, per instance; bounded, TTL'd.

    ``max_entries`` bounds memory in (instance, chunk hash) entries (oldest prompts dropped
    first). A prompt recorded with the request's load :class:`Ticket` lives while that request
    is still prefilling (its KV is not stored yet, so no admit event can have reached the index:
    a prefill longer than the TTL must not let the next same-prefix request go to a cold
    instance) and for ``ttl_s`` after its first byte, by which time the controller's index has
    normally caught up; a request that ended without an answer drops its entries at once. One
    without a ticket (a prefetch target) lives ``ttl_s`` from when it was recorded. An instance
    holds a hash while any live prompt recorded for it does.
    """

    def __init__(self, ttl_s: float, max_entries: int = 200_000) -> None:
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._names: list[str] = []
        self._bit: dict[str, int] = {}
        self._mask: dict[int, int] = {}  # chunk hash -> instances holding it
        self._count: dict[tuple[int, int], int] = {}  # (instance bit, hash) -> live prompts
        self._records: OrderedDict[int, _Record] = OrderedDict()  # oldest first
        self._size = 0  # entries of the live records
        self._deadlines: list[tuple[float, int]] = []  # (deadline, record id)
        self._by_ticket: dict[int, list[int]] = {}  # ticket id -> its records still prefilling
        self._ids = itertools.count()

    def __len__(self) -> int:
        return self._size

    def names(self) -> tuple[int, list[str]]:
        """(version, instance name of each bit): the list only grows; its length is the version."""
        return len(self._names), self._names

    # ------------------------------------------------------------------ recording

    def record(
        self, instance: str, hashes: Sequence[int], now: float, ticket: Ticket | None = None
    ) -> None:
        """``hashes`` were routed to ``instance`` at ``now`` (for the request of ``ticket``)."""
        self._expire(now)
        if not hashes or (ticket is not None and ticket.done and not ticket.first_byte):
            return
        inst = self._bit.get(instance)
        if inst is None:
            inst = self._bit[instance] = len(self._names)
            self._names.append(instance)
        keep = tuple(hashes[: self.max_entries])  # the leading chunks are what can hit
        rid = next(self._ids)
        self._records[rid] = _Record(inst, keep, ticket)
        self._size += len(keep)
        bit = 1 << inst
        mask, count = self._mask, self._count
        for h in keep:
            key = (inst, h)
            held = count.get(key, 0)
            if not held:
                mask[h] = mask.get(h, 0) | bit
            count[key] = held + 1
        if ticket is None:
            heapq.heappush(self._deadlines, (now + self.ttl_s, rid))
        elif ticket.first_byte_at is not None:
            heapq.heappush(self._deadlines, (ticket.first_byte_at + self.ttl_s, rid))
        else:
            self._by_ticket.setdefault(ticket.id, []).append(rid)
            ticket.on_change = self._ticket_changed
        while self._size > self.max_entries:
            self._drop(next(iter(self._records)))

    def forget(self, hashes: Iterable[int], instances: Iterable[str] | None = None) -> int:
        """Drop every live prompt recorded for ``instances`` (all when None) that holds any of
        ``hashes``: that KV was evicted through the memory API, so nothing may credit it any
        more (a record goes whole: its chunks before the evicted one could still hit, but an
        evict names a prefix from its start). Returns how many prompts were dropped."""
        gone = set(hashes)
        named = None if instances is None else set(instances)
        bits = None if named is None else {b for n, b in self._bit.items() if n in named}
        rids = [
            rid
            for rid, r in self._records.items()
            if (bits is None or r.inst in bits) and not gone.isdisjoint(r.hashes)
        ]
        for rid in rids:
            self._drop(rid)
        return len(rids)

    def _ticket_changed(self, ticket: Ticket) -> None:
        """The request's first byte (its entries live ``ttl_s`` more) or its end without one
        (they go now)."""
        rids = self._by_ticket.pop(ticket.id, None)
        if not rids:
            return
        if ticket.first_byte_at is not None:
            deadline = ticket.first_byte_at + self.ttl_s
            for rid in rids:
                heapq.heappush(self._deadlines, (deadline, rid))
        else:
            for rid in rids:
                self._drop(rid)

    def _drop(self, rid: int) -> None:
        record = self._records.pop(rid, None)
        if record is None:
            return  # already gone (a deadline of a dropped record)
        inst = record.inst
        clear = ~(1 << inst)
        mask, count = self._mask, self._count
        for h in record.hashes:
            key = (inst, h)
            held = count[key] - 1
            if held:
                count[key] = held
            else:
                del count[key]
                rest = mask[h] & clear
                if rest:
                    mask[h] = rest
                else:
                    del mask[h]
        self._size -= len(record.hashes)

    def _expire(self, now: float) -> None:
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            self._drop(heapq.heappop(deadlines)[1])

    # ------------------------------------------------------------------ lookups

    def ends(self, hashes: Sequence[int], now: float) -> Ends:
        """Where the instances' live pending prefixes of ``hashes`` stop: (chunks, bitmask)
        pairs with disjoint bitmasks, longest last."""
        self._expire(now)
        if not hashes:
            return []
        get = self._mask.get
        alive = get(hashes[0], 0)
        if not alive:
            return []
        out: Ends = []
        n = 1
        for h in itertools.islice(hashes, 1, None):
            still = get(h, 0) & alive
            if still != alive:
                out.append((n, alive & ~still))
                if not still:
                    return out
                alive = still
            n += 1
        out.append((n, alive))
        return out

    def hits(self, hashes: Sequence[int], now: float) -> dict[str, int]:
        """Every instance with a live pending prefix of ``hashes``: its leading chunks."""
        out: dict[str, int] = {}
        names = self._names
        for n, ending in self.ends(hashes, now):
            rest = ending
            while rest:
                low = rest & -rest
                rest ^= low
                out[names[low.bit_length() - 1]] = n
        return out

    def hit(self, instance: str, hashes: Sequence[int], now: float) -> int:
        """Leading chunks of ``hashes`` recorded for ``instance`` and still alive."""
        self._expire(now)
        inst = self._bit.get(instance)
        if inst is None:
            return 0
        count = self._count
        n = 0
        for h in hashes:
            if (inst, h) not in count:
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
