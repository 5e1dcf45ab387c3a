"""The controller's pure chunk index: which instance, worker (TP rank) and tier holds each chunk.

Why it exists: the gateway routes by the longest cached prefix and P2P asks for a peer that
holds a prompt's KV on the *same* TP rank; both questions are answered here, on every request,
so they must be cheap. LMCache's own controller (``RegistryTree``) keeps one ``set`` per
(instance, worker, location) and finds a chunk by scanning every set of every worker; its
lookup cost grows with the number of workers and it cannot say *how much* each instance holds.

Layout (no I/O, no threads, no logging):

- every (instance, worker, location) that holds at least one chunk is interned to a small
  integer *slot*; the slot's keys live in one ``set`` (``worker_keys``, purge and full sync
  are proportional to that worker's keys, never a scan of the whole index);
- ``chunk hash -> slot bitmask`` (a Python ``int``); identical masks are shared objects, so a
  chunk costs one dict entry whatever the number of holders;
- a bitmask of *instances* is derived per distinct slot mask and memoised, so the
  longest-prefix scan does one dict probe and one ``&`` per chunk, and only re-derives
  per-instance work where the holder set changes (runs of equal masks are counted at once).

A *chunk-location* is one (chunk hash, instance, worker, location) fact; ``len(index)`` counts
them. Keys are LMCache chunk hashes: Python ``int`` of any sign and size (64-bit in practice).

Tier order (used to pick "the" location of a hit, fastest first) is ``TIER_ORDER``; unknown
location names rank after the known ones, by name.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["TIER_ORDER", "ChunkIndex", "InstanceHit", "tier_rank"]

#: LMCache storage backends (``str(backend)`` is the location a worker reports), fastest
#: first: host memory, then local storage, then remote stores. Unknown names come after.
TIER_ORDER: tuple[str, ...] = (
    "LocalCPUBackend",
    "PDBackend",
    "MaruBackend",
    "LocalDiskBackend",
    "GdsBackend",
    "NixlStorageBackend",
    "RemoteBackend",
    "P2PBackend",
)
_TIER_RANK = {name: rank for rank, name in enumerate(TIER_ORDER)}

#: Memo tables are dropped and rebuilt when they grow past this many entries.
_MEMO_LIMIT = 1 << 16


def tier_rank(location: str) -> tuple[int, str]:
    """Sort key of a location: known tiers by ``TIER_ORDER``, then unknown ones by name."""
    return (_TIER_RANK.get(location, len(TIER_ORDER)), location)


@dataclass(frozen=True)
class InstanceHit:
    """How much of a prompt one instance holds.

    ``hit_chunks``: leading consecutive chunks held by the instance (any worker, any tier).
    ``per_location``: of those chunks, how many each tier holds; a chunk held in two tiers
    counts in both, so the values may sum to more than ``hit_chunks``.
    ``workers``: the worker ids (TP ranks) holding the first chunk, ascending.
    """

    instance_id: str
    hit_chunks: int
    per_location: dict[str, int]
    workers: tuple[int, ...]


@dataclass(frozen=True)
class _Decoded:
    """What a slot mask means: its instances and its (instance, location) groups."""

    inst_mask: int
    slots: tuple[int, ...]
    groups: tuple[tuple[int, str], ...]  # distinct (instance index, location)


@dataclass(frozen=True)
class _Run:
    """A stretch of consecutive prompt chunks with the same holders."""

    mask: int
    length: int
    alive: int  # instances that hold every chunk up to and including this run


class ChunkIndex:
    """chunk hash -> {(instance, worker, location)}, with per-slot key sets for fast purge."""

    def __init__(self) -> None:
        self._chunks: dict[int, int] = {}
        self._count = 0
        # slot tables (index = slot id); a slot exists iff its key set is non-empty
        self._slot_keys: list[set[int]] = []
        self._slot_id: list[tuple[str, int, str] | None] = []
        self._slot_inst: list[int] = []
        self._slot_of: dict[tuple[str, int, str], int] = {}
        self._free_slots: list[int] = []
        # instances interned to small indices for instance bitmasks
        self._inst_of: dict[str, int] = {}
        self._inst_name: list[str] = []
        self._inst_slots: dict[str, int] = {}  # instance -> mask of its slots
        self._free_insts: list[int] = []
        self._rank_slots: dict[int, int] = {}  # worker id -> mask of slots with that id
        self._canon: dict[int, int] = {}
        self._memo: dict[int, _Decoded] = {}

    # ------------------------------------------------------------------ slots
    def _slot(self, instance_id: str, worker_id: int, location: str) -> int:
        ident = (instance_id, worker_id, location)
        slot = self._slot_of.get(ident)
        if slot is not None:
            return slot
        inst = self._inst_of.get(instance_id)
        if inst is None:
            if self._free_insts:
                inst = heapq.heappop(self._free_insts)
                self._inst_name[inst] = instance_id
            else:
                inst = len(self._inst_name)
                self._inst_name.append(instance_id)
            self._inst_of[instance_id] = inst
        if self._free_slots:
            slot = heapq.heappop(self._free_slots)
            self._slot_id[slot] = ident
            self._slot_inst[slot] = inst
        else:
            slot = len(self._slot_keys)
            self._slot_keys.append(set())
            self._slot_id.append(ident)
            self._slot_inst.append(inst)
        self._slot_of[ident] = slot
        bit = 1 << slot
        self._inst_slots[instance_id] = self._inst_slots.get(instance_id, 0) | bit
        self._rank_slots[worker_id] = self._rank_slots.get(worker_id, 0) | bit
        return slot

    def _release(self, slot: int) -> None:
        """Forget an empty slot (and its instance when that was its last slot)."""
        ident = self._slot_id[slot]
        assert ident is not None and not self._slot_keys[slot]
        instance_id, worker_id, _ = ident
        nbit = ~(1 << slot)
        del self._slot_of[ident]
        self._slot_id[slot] = None
        heapq.heappush(self._free_slots, slot)
        rank = self._rank_slots[worker_id] & nbit
        if rank:
            self._rank_slots[worker_id] = rank
        else:
            del self._rank_slots[worker_id]
        inst_mask = self._inst_slots[instance_id] & nbit
        if inst_mask:
            self._inst_slots[instance_id] = inst_mask
        else:
            del self._inst_slots[instance_id]
            inst = self._inst_of.pop(instance_id)
            heapq.heappush(self._free_insts, inst)
        # masks that mention the slot are gone from the index; their memos must go too
        self._memo.clear()
        self._canon.clear()

    def _decode(self, mask: int) -> _Decoded:
        decoded = self._memo.get(mask)
        if decoded is not None:
            return decoded
        inst_mask = 0
        slots: list[int] = []
        groups: dict[tuple[int, str], None] = {}
        rest = mask
        while rest:
            low = rest & -rest
            slot = low.bit_length() - 1
            rest ^= low
            inst = self._slot_inst[slot]
            ident = self._slot_id[slot]
            assert ident is not None
            inst_mask |= 1 << inst
            slots.append(slot)
            groups[(inst, ident[2])] = None
        decoded = _Decoded(inst_mask, tuple(slots), tuple(groups))
        if len(self._memo) >= _MEMO_LIMIT:
            self._memo.clear()
        self._memo[mask] = decoded
        return decoded

    # ----------------------------------------------------------- mutations
    def _add(self, slot: int, keys: Iterable[int]) -> int:
        held = self._slot_keys[slot]
        new = set(keys)
        new.difference_update(held)
        if not new:
            return 0
        held.update(new)
        canon = self._canon
        if len(canon) >= _MEMO_LIMIT:
            canon.clear()
        bit = 1 << slot
        bit = canon.setdefault(bit, bit)
        chunks = self._chunks
        get = chunks.get
        for key in new:
            mask = get(key)
            if mask is None:
                chunks[key] = bit
            else:
                mask |= bit
                chunks[key] = canon.setdefault(mask, mask)
        self._count += len(new)
        return len(new)

    def _drop(self, slot: int, keys: Iterable[int] | None) -> int:
        """Remove ``keys`` (all of the slot's keys when None) from a slot; release it if empty."""
        held = self._slot_keys[slot]
        if keys is None:
            gone = held
            self._slot_keys[slot] = set()
        else:
            gone = held.intersection(keys)
            if not gone:
                return 0
            held.difference_update(gone)
        canon = self._canon
        if len(canon) >= _MEMO_LIMIT:
            canon.clear()
        nbit = ~(1 << slot)
        chunks = self._chunks
        for key in gone:
            mask = chunks[key] & nbit
            if mask:
                chunks[key] = canon.setdefault(mask, mask)
            else:
                del chunks[key]
        self._count -= len(gone)
        if not self._slot_keys[slot]:
            self._release(slot)
        return len(gone)

    def admit(self, instance_id: str, worker_id: int, location: str, keys: Sequence[int]) -> int:
        """Record that the worker's ``location`` tier holds ``keys``; returns how many are new."""
        if not keys:
            return 0
        return self._add(self._slot(instance_id, worker_id, location), keys)

    def evict(self, instance_id: str, worker_id: int, location: str, keys: Sequence[int]) -> int:
        """Record that the worker's tier dropped ``keys``; returns how many it really held."""
        slot = self._slot_of.get((instance_id, worker_id, location))
        if slot is None or not keys:
            return 0
        return self._drop(slot, keys)

    def clear(
        self, instance_id: str, worker_id: int | None = None, location: str | None = None
    ) -> int:
        """Forget what an instance holds, narrowed to one worker and/or one location.

        Returns the number of chunk-locations removed.
        """
        mask = self._inst_slots.get(instance_id, 0)
        removed = 0
        while mask:
            low = mask & -mask
            mask ^= low
            slot = low.bit_length() - 1
            ident = self._slot_id[slot]
            assert ident is not None
            if worker_id is not None and ident[1] != worker_id:
                continue
            if location is not None and ident[2] != location:
                continue
            removed += self._drop(slot, None)
        return removed

    def remove_worker(self, instance_id: str, worker_id: int) -> int:
        """Purge everything one worker holds (dead or deregistered); returns how many."""
        return self.clear(instance_id, worker_id)

    def remove_instance(self, instance_id: str) -> int:
        """Purge everything an instance holds; returns how many chunk-locations."""
        return self.clear(instance_id)

    def replace(self, instance_id: str, worker_id: int, location: str, keys: Sequence[int]) -> None:
        """End of a full sync: the worker's ``location`` tier now holds exactly ``keys``."""
        wanted = set(keys)
        slot = self._slot_of.get((instance_id, worker_id, location))
        if slot is None:
            if wanted:
                self._add(self._slot(instance_id, worker_id, location), wanted)
            return
        held = self._slot_keys[slot]
        stale = held - wanted
        wanted.difference_update(held)
        if wanted:
            self._add(slot, wanted)
        if stale:
            self._drop(slot, stale)

    # -------------------------------------------------------------- queries
    def worker_keys(self, instance_id: str, worker_id: int, location: str) -> list[int]:
        """The keys one worker's tier holds, in no particular order."""
        slot = self._slot_of.get((instance_id, worker_id, location))
        return [] if slot is None else list(self._slot_keys[slot])

    def locations_of(self, instance_id: str, worker_id: int) -> list[str]:
        """The tiers where a worker holds at least one chunk, fastest first."""
        found = [
            loc for (inst, wid, loc) in self._slot_of if inst == instance_id and wid == worker_id
        ]
        return sorted(found, key=tier_rank)

    def _scan(self, hashes: Sequence[int], slot_filter: int) -> tuple[dict[int, int], list[_Run]]:
        """Per-instance leading hits over the slots in ``slot_filter`` (-1: all slots).

        Stops at the first chunk that no instance still in the race holds.
        """
        get = self._chunks.get
        decode = self._decode
        hits: dict[int, int] = {}
        runs: list[_Run] = []
        alive = 0
        prev = -1  # no mask equals it, so the first chunk always opens a run
        start = 0
        n = 0
        for key in hashes:
            mask = get(key, 0) & slot_filter
            if mask != prev:
                still = decode(mask).inst_mask if mask else 0
                if n:
                    still &= alive
                    runs.append(_Run(prev, n - start, alive))
                    ended = alive & ~still
                    while ended:
                        low = ended & -ended
                        ended ^= low
                        hits[low.bit_length() - 1] = n
                if not still:
                    alive = 0
                    break
                alive = still
                prev = mask
                start = n
            n += 1
        if alive:
            runs.append(_Run(prev, n - start, alive))
            while alive:
                low = alive & -alive
                alive ^= low
                hits[low.bit_length() - 1] = n
        return hits, runs

    def prefix_hits(self, hashes: Sequence[int]) -> dict[str, InstanceHit]:
        """Longest cached prefix of a prompt's chained chunk hashes, per instance.

        Only instances holding the first chunk appear. See ``InstanceHit`` for the fields.
        """
        hits, runs = self._scan(hashes, -1)
        if not hits:
            return {}
        per_loc: dict[int, dict[str, int]] = {inst: {} for inst in hits}
        for run in runs:
            for inst, loc in self._decode(run.mask).groups:
                if run.alive >> inst & 1:
                    counts = per_loc[inst]
                    counts[loc] = counts.get(loc, 0) + run.length
        workers: dict[int, list[int]] = {inst: [] for inst in hits}
        for slot in self._decode(runs[0].mask).slots:
            listed = workers[self._slot_inst[slot]]
            ident = self._slot_id[slot]
            assert ident is not None
            if ident[1] not in listed:
                listed.append(ident[1])
        result: dict[str, InstanceHit] = {}
        for inst, n in hits.items():
            name = self._inst_name[inst]
            result[name] = InstanceHit(name, n, per_loc[inst], tuple(sorted(workers[inst])))
        return result

    def p2p_lookup(
        self, hashes: Sequence[int], requester_instance: str, worker_id: int
    ) -> list[tuple[str, str, int, int]]:
        """Peers that hold a prefix of ``hashes`` on the same TP rank as the requester.

        Returns ``(instance_id, location, num_hit_chunks, worker_id)`` for every other instance
        whose worker ``worker_id`` holds at least the first chunk, longest first, ties by
        instance id. ``location`` is the fastest tier (``TIER_ORDER``) holding the first chunk.
        """
        allowed = self._rank_slots.get(worker_id, 0) & ~self._inst_slots.get(requester_instance, 0)
        if not allowed or not hashes:
            return []
        hits, runs = self._scan(hashes, allowed)
        if not hits:
            return []
        best: dict[int, str] = {}
        for inst, loc in self._decode(runs[0].mask).groups:
            if inst not in best or tier_rank(loc) < tier_rank(best[inst]):
                best[inst] = loc
        found = [(self._inst_name[inst], best[inst], n, worker_id) for inst, n in hits.items()]
        found.sort(key=lambda row: (-row[2], row[0]))
        return found

    def stats(self) -> dict[str, int]:
        """Sizes: chunk_locations, chunks, instances, workers, and ``location:<name>`` counts."""
        out = {
            "chunk_locations": self._count,
            "chunks": len(self._chunks),
            "instances": len(self._inst_slots),
            "workers": len({(inst, wid) for (inst, wid, _) in self._slot_of}),
        }
        for (_, _, loc), slot in self._slot_of.items():
            name = f"location:{loc}"
            out[name] = out.get(name, 0) + len(self._slot_keys[slot])
        return out

    def __len__(self) -> int:
        return self._count
