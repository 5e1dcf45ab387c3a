"""Bounded KV caches of one simulated instance, at LMCache chunk granularity.

Why this module exists: the simulated engine must admit and evict exactly as a real worker
would, because the controller's index (and through it the gateway's routing) is built from
those admit and evict events. Two kinds of cache:

- :class:`DeviceCache` — vLLM's paged KV in accelerator memory with automatic prefix caching.
  Running requests hold their blocks (shared full chunks are reference counted); when a
  request ends its full chunks stay cached and are reclaimed least-recently-used first when
  new blocks are needed. A chunk becoming cached / reclaimed is a device event (vLLM publishes
  these as ``BlockStored`` / ``BlockRemoved``).
- :class:`LRUTier` — one LMCache storage backend (``LocalCPUBackend``, ``LocalDiskBackend``):
  a put admits a chunk (evicting the least recently used to make room), a hit touches it. Each
  admit and evict is an event with LMCache's location name, as LMCache's worker reports it to
  the controller.

Keys are LMCache chunk hashes (ints). Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["DEVICE", "DeviceCache", "KvEvent", "LRUTier"]

#: The location name of device events (vLLM's prefix cache; not an LMCache backend).
DEVICE = "device"

KvOp = Literal["admit", "evict"]


@dataclass(frozen=True)
class KvEvent:
    """A chunk entering (``admit``) or leaving (``evict``) a tier, as the worker reports it."""

    op: KvOp
    location: str
    key: int


class LRUTier:
    """One LMCache backend: at most ``capacity`` chunks, least recently used evicted first."""

    def __init__(self, location: str, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"{location}: capacity must be >= 0 chunks, got {capacity}")
        self.location = location
        self.capacity = capacity
        self._keys: OrderedDict[int, None] = OrderedDict()
        self._pinned: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: int) -> bool:
        return key in self._keys

    def keys(self) -> list[int]:
        """Every chunk held, least recently used first."""
        return list(self._keys)

    def touch(self, key: int) -> None:
        """A hit: the chunk becomes the most recently used."""
        if key in self._keys:
            self._keys.move_to_end(key)

    def put(self, keys: Iterable[int], events: list[KvEvent]) -> int:
        """Admit chunks not yet held, evicting unpinned LRU chunks for room; returns how many
        were admitted. As in LMCache, a chunk already held is neither admitted again nor made
        more recent, and a store that finds no room (everything else pinned) stops there."""
        n = 0
        for key in keys:
            if key in self._keys:
                continue
            if len(self._keys) >= self.capacity and not self._make_room(events):
                break
            self._keys[key] = None
            events.append(KvEvent("admit", self.location, key))
            n += 1
        return n

    def _make_room(self, events: list[KvEvent]) -> bool:
        for old in self._keys:
            if old not in self._pinned:
                del self._keys[old]
                events.append(KvEvent("evict", self.location, old))
                return True
        return False

    def remove(self, keys: Iterable[int], events: list[KvEvent]) -> int:
        """Drop chunks (the memory API's evict, the controller's clear); returns how many."""
        n = 0
        for key in keys:
            if key in self._keys and key not in self._pinned:
                del self._keys[key]
                events.append(KvEvent("evict", self.location, key))
                n += 1
        return n

    def pin(self, keys: Iterable[int]) -> int:
        n = 0
        for key in keys:
            if key in self._keys:
                self._pinned[key] = self._pinned.get(key, 0) + 1
                n += 1
        return n

    def unpin(self, keys: Iterable[int]) -> int:
        n = 0
        for key in keys:
            count = self._pinned.get(key)
            if count is None:
                continue
            n += 1
            if count > 1:
                self._pinned[key] = count - 1
            else:
                del self._pinned[key]
        return n

    @property
    def pinned(self) -> int:
        return len(self._pinned)


class DeviceCache:
    """vLLM's paged KV with prefix caching, counted in blocks, keyed by full chunks.

    ``capacity_blocks`` blocks of ``block_size`` tokens; a cached chunk occupies
    ``chunk_size // block_size`` blocks. A request reserves all the blocks it will ever need
    when it is scheduled (its prompt and every token it may generate), so it is never
    preempted. A chunk is *ready* (reusable by another request, published as stored) once its
    KV has been computed or loaded; a chunk held but not ready yet is being computed.
    """

    def __init__(self, capacity_blocks: int, blocks_per_chunk: int) -> None:
        if blocks_per_chunk < 1:
            raise ValueError("a chunk must hold at least one block")
        self.capacity_blocks = capacity_blocks
        self.blocks_per_chunk = blocks_per_chunk
        self._refs: dict[int, int] = {}  # chunk -> requests holding it
        self._ready: set[int] = set()  # held chunks whose KV exists
        self._idle: OrderedDict[int, None] = OrderedDict()  # ready, held by nobody: LRU first
        self._anonymous = 0  # blocks held by requests outside cached chunks

    @property
    def used_blocks(self) -> int:
        return (len(self._refs) + len(self._idle)) * self.blocks_per_chunk + self._anonymous

    def __contains__(self, key: int) -> bool:
        return key in self._idle or key in self._ready

    def __len__(self) -> int:
        """Chunks whose KV is in device memory (held or idle)."""
        return len(self._ready) + len(self._idle)

    def keys(self) -> list[int]:
        return [*self._ready, *self._idle]

    def match(self, keys: Sequence[int]) -> int:
        """Leading ``keys`` whose KV is in device memory."""
        n = 0
        for key in keys:
            if key not in self._idle and key not in self._ready:
                break
            n += 1
        return n

    def fits(self, keys: Sequence[int], anonymous_blocks: int) -> bool:
        """Could a request holding ``keys`` (full chunks) and ``anonymous_blocks`` more be
        scheduled now, reclaiming idle chunks it does not itself use?"""
        unique = dict.fromkeys(keys)
        new = sum(1 for k in unique if k not in self._refs and k not in self._idle)
        own_idle = sum(1 for k in unique if k in self._idle)
        free = (
            self.capacity_blocks
            - self.used_blocks
            + (len(self._idle) - own_idle) * (self.blocks_per_chunk)
        )
        return new * self.blocks_per_chunk + anonymous_blocks <= free

    def acquire(self, keys: Sequence[int], anonymous_blocks: int, events: list[KvEvent]) -> None:
        """Hold ``keys`` and ``anonymous_blocks`` for a request (call :meth:`fits` first);
        idle chunks are reclaimed least recently used first to make room."""
        for key in dict.fromkeys(keys):
            if key in self._idle:  # a cached chunk reused: its KV exists (no new admit)
                del self._idle[key]
                self._refs[key] = 1
                self._ready.add(key)
            else:
                self._refs[key] = self._refs.get(key, 0) + 1
        self._anonymous += anonymous_blocks
        while self.used_blocks > self.capacity_blocks and self._idle:
            key, _ = self._idle.popitem(last=False)
            events.append(KvEvent("evict", DEVICE, key))

    def mark_ready(self, keys: Iterable[int], events: list[KvEvent]) -> None:
        """The KV of these held chunks now exists (computed or loaded)."""
        for key in keys:
            if key in self._refs and key not in self._ready:
                self._ready.add(key)
                events.append(KvEvent("admit", DEVICE, key))

    def release(self, keys: Sequence[int], anonymous_blocks: int) -> None:
        """A request ended: its ready chunks stay cached (idle); a chunk it held that was never
        computed is freed. As vLLM frees a request's blocks, the tail goes first: the last
        chunk becomes the least recently used, so a shared prefix outlives its extensions."""
        for key in reversed(dict.fromkeys(keys)):
            count = self._refs.get(key)
            if count is None:
                continue
            if count > 1:
                self._refs[key] = count - 1
                continue
            del self._refs[key]
            if key in self._ready:
                self._ready.discard(key)
                self._idle[key] = None
        self._anonymous -= anonymous_blocks

    def drop(self, keys: Iterable[int], events: list[KvEvent]) -> int:
        """Reclaim idle chunks now (the memory API's evict of the device tier)."""
        n = 0
        for key in keys:
            if key in self._idle:
                del self._idle[key]
                events.append(KvEvent("evict", DEVICE, key))
                n += 1
        return n
