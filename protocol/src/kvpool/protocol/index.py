"""The pure chunk index: which instance, worker (TP rank) and tier holds each chunk.

Why it exists: the gateway routes by the longest cached prefix and P2P asks for a peer that
holds a prompt's KV on the *same* TP rank; both questions are answered here, on every request,
so they must be cheap. It lives in kvpool.protocol because two components keep one: the
controller (the source of truth) and every gateway (its replica, fed by
:mod:`kvpool.protocol.deltas`), and a replica must answer exactly as the controller would.

LMCache's own controller (``RegistryTree``) keeps one ``set`` per (instance, worker, location)
and finds a chunk by probing every set of every worker; its lookup cost grows with the number
of workers and it cannot say *how much* each instance holds.

Layout (no I/O, no threads, no logging):

- every (instance, worker, location) holding at least one chunk is interned to a small integer
  *slot*;
- ``chunk hash -> slot bitmask`` (a Python ``int``) is the single source of truth; equal masks
  are shared objects, so a chunk costs one dict entry whatever the number of holders;
- each slot keeps an append-only log of the keys it admitted (8 bytes a key in an
  ``array('q')``; keys outside int64 in a list). Evictions leave stale entries that the mask
  filters out; the log is compacted when it is more than half stale. Purge, ``worker_keys`` and
  full sync walk one slot's log, never the whole index;
- purging a whole slot (``remove_worker``, ``clear``) is O(1): the slot is detached at once —
  it leaves every query, count and listing — and its bit becomes *dead*: scans mask dead bits
  out, and the keys of its log are swept from the masks later, a bounded step at a time
  (:meth:`ChunkIndex.sweep`, a few keys per admitted or evicted key, everything before
  :meth:`ChunkIndex.stats`). LMCache drops a dead worker's own sets; here the masks are shared,
  so the per-key work cannot vanish, but it no longer stalls the caller (a million-key worker
  purged on a TTL used to block the controller's loop for about half a second);
- a bitmask of *instances* is derived per distinct slot mask and memoised. The longest-prefix
  scan (:mod:`kvpool.protocol.index_scan`) fetches masks a block at a time in C and only does
  per-instance work where the holder set changes.

A *chunk-location* is one (chunk hash, instance, worker, location) fact; ``len(index)`` counts
them. Keys are LMCache chunk hashes: Python ``int`` of any sign and size (64-bit in practice).

Tier order (used to pick "the" location of a hit, fastest first) is
:func:`kvpool.protocol.tiers.tier_rank` (``TIER_ORDER`` lists the known names in that order);
unknown names rank after the known ones.
"""

from __future__ import annotations

import heapq
from array import array
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvpool.protocol.index_groups import HitGroup, hit_groups, per_instance
from kvpool.protocol.index_scan import SCAN_BLOCK, scan
from kvpool.protocol.index_slots import Decoded as _Decoded
from kvpool.protocol.index_slots import Run as _Run
from kvpool.protocol.index_slots import Slot as _Slot
from kvpool.protocol.tiers import BACKENDS, tier_rank

__all__ = ["SCAN_BLOCK", "TIER_ORDER", "ChunkIndex", "HitGroup", "InstanceHit", "tier_rank"]

#: LMCache storage backends (``str(backend)`` is the location a worker reports), fastest
#: first, as :mod:`kvpool.protocol.tiers` ranks them. Unknown names come after.
TIER_ORDER: tuple[str, ...] = tuple(sorted((b.name for b in BACKENDS), key=tier_rank))

#: Memo tables are dropped and rebuilt when they grow past this many entries.
_MEMO_LIMIT = 1 << 16
#: ... or when the decoded masks they hold name more (instance, location) pairs than this.
_MEMO_WEIGHT = 1 << 18
#: A slot log is compacted when it holds more than twice its live keys plus this slack.
_LOG_SLACK = 256
#: Keys of purged slots swept per admitted/evicted key (at least ``_SWEEP_MIN`` a call).
_SWEEP_PER_KEY = 2
_SWEEP_MIN = 256


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


class ChunkIndex:
    """chunk hash -> {(instance, worker, location)}, with per-slot key logs for fast purge."""

    def __init__(self) -> None:
        self._chunks: dict[int, int] = {}
        self._count = 0
        self._slots: list[_Slot | None] = []  # index = slot id
        self._slot_of: dict[tuple[str, int, str], int] = {}
        self._free_slots: list[int] = []
        self._inst_of: dict[str, int] = {}  # instances interned for instance bitmasks
        self._inst_name: list[str] = []
        self._free_insts: list[int] = []
        self._inst_slots: dict[str, int] = {}  # instance -> mask of its slots
        self._rank_slots: dict[int, int] = {}  # worker id -> mask of slots with that id
        self._canon: dict[int, int] = {}
        self._memo: dict[int, _Decoded] = {}
        self._memo_weight = 0
        self._inst_version = 0  # changes whenever an instance id gets a (new) name
        self._dead = 0  # bits of purged slots that masks may still carry
        self._graves: deque[_Slot] = deque()  # purged slots whose keys are not swept yet

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
            self._inst_version += 1
        slot = heapq.heappop(self._free_slots) if self._free_slots else len(self._slots)
        record = _Slot(ident, inst, 1 << slot)
        if slot == len(self._slots):
            self._slots.append(record)
        else:
            self._slots[slot] = record
        self._slot_of[ident] = slot
        self._inst_slots[instance_id] = self._inst_slots.get(instance_id, 0) | record.bit
        self._rank_slots[worker_id] = self._rank_slots.get(worker_id, 0) | record.bit
        return slot

    def _detach(self, record: _Slot) -> None:
        """Forget a slot's identity (and its instance when that was its last slot)."""
        instance_id, worker_id, _ = record.ident
        nbit = ~record.bit
        del self._slot_of[record.ident]
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
            heapq.heappush(self._free_insts, self._inst_of.pop(instance_id))

    def _free(self, slot: int) -> None:
        """Make a slot id reusable: no mask carries its bit any more."""
        self._slots[slot] = None
        heapq.heappush(self._free_slots, slot)
        # masks that mentioned the slot are gone from the index; their memos must go too
        self._memo.clear()
        self._memo_weight = 0
        self._canon.clear()

    def _release(self, slot: int) -> None:
        """Forget an empty slot (and its instance when that was its last slot)."""
        record = self._slots[slot]
        assert record is not None and record.count == 0
        self._detach(record)
        self._free(slot)

    def _purge(self, slot: int) -> int:
        """Take a whole slot out of the index now; its keys are swept later. Returns how many
        chunk-locations it held."""
        record = self._record(slot)
        removed = record.count
        record.count = 0
        self._count -= removed
        self._detach(record)
        self._dead |= record.bit
        self._graves.append(record)
        # memos stay valid: scans mask the dead bit out, so no mask holding it is decoded
        # until the slot id is reused, and _free clears them then
        return removed

    def sweep(self, budget: int | None = None) -> int:
        """Clear up to ``budget`` logged keys of purged slots from the masks (None: all).

        Returns how many keys are still to sweep. Queries are exact whether or not this ran;
        it only bounds memory and lets the slot ids be reused.
        """
        chunks = self._chunks
        get = chunks.get
        canon = self._canon
        while self._graves and (budget is None or budget > 0):
            record = self._graves[0]
            bit = record.bit
            nbit = ~bit
            logged = len(record.log) + len(record.big)
            stop = logged if budget is None else min(logged, record.swept + budget)
            start = record.swept
            for key in record.logged_range(start, stop):
                mask = get(key)
                if mask is not None and mask & bit:
                    mask &= nbit
                    if mask:
                        chunks[key] = canon.setdefault(mask, mask)
                    else:
                        del chunks[key]
            record.swept = stop
            if budget is not None:
                budget -= stop - start
            if stop == logged:
                self._graves.popleft()
                self._dead &= nbit
                self._free(bit.bit_length() - 1)
            if len(canon) >= _MEMO_LIMIT:
                canon.clear()
        return sum(len(r.log) + len(r.big) - r.swept for r in self._graves)

    def _sweep_some(self, keys: int) -> None:
        if self._graves:
            self.sweep(max(_SWEEP_MIN, _SWEEP_PER_KEY * keys))

    def _record(self, slot: int) -> _Slot:
        record = self._slots[slot]
        assert record is not None
        return record

    def _decode(self, mask: int) -> _Decoded:
        decoded = self._memo.get(mask)
        if decoded is not None:
            return decoded
        inst_mask = 0
        groups: dict[tuple[int, str], None] = {}
        workers: dict[int, set[int]] = {}
        locations: dict[str, int] = {}
        rest = mask
        while rest:
            low = rest & -rest
            rest ^= low
            record = self._record(low.bit_length() - 1)
            bit = 1 << record.inst
            inst_mask |= bit
            groups[(record.inst, record.ident[2])] = None
            workers.setdefault(record.inst, set()).add(record.ident[1])
            locations[record.ident[2]] = locations.get(record.ident[2], 0) | bit
        ranks = {inst: tuple(sorted(ids)) for inst, ids in workers.items()}
        decoded = _Decoded(inst_mask, tuple(groups), ranks, locations)
        # bounded by what the entries hold, not their number: a mask of a thousand holders
        # decodes to tens of kilobytes, and masks change as holders come and go
        self._memo_weight += len(groups)
        if len(self._memo) >= _MEMO_LIMIT or self._memo_weight > _MEMO_WEIGHT:
            self._memo.clear()
            self._memo_weight = len(groups)
        self._memo[mask] = decoded
        return decoded

    # ----------------------------------------------------------- mutations
    def _add(self, slot: int, keys: Iterable[int]) -> int:
        record = self._record(slot)
        bit = record.bit
        canon = self._canon
        if len(canon) >= _MEMO_LIMIT:
            canon.clear()
        keep = canon.setdefault
        chunks = self._chunks
        get = chunks.get
        added: list[int] = []
        push = added.append
        for key in keys:
            mask = get(key)
            if mask is None:
                chunks[key] = bit
                push(key)
            elif not mask & bit:
                mask |= bit
                chunks[key] = keep(mask, mask)
                push(key)
        if added:
            record.count += len(added)
            self._count += len(added)
            record.append(added)
        return len(added)

    def _drop(self, slot: int, keys: Iterable[int]) -> int:
        """Remove ``keys`` from a slot; release the slot when it ends up empty."""
        record = self._record(slot)
        bit = record.bit
        nbit = ~bit
        canon = self._canon
        if len(canon) >= _MEMO_LIMIT:
            canon.clear()
        keep = canon.setdefault
        chunks = self._chunks
        get = chunks.get
        removed = 0
        for key in keys:
            mask = get(key)
            if mask is not None and mask & bit:
                mask &= nbit
                if mask:
                    chunks[key] = keep(mask, mask)
                else:
                    del chunks[key]
                removed += 1
        if removed:
            record.count -= removed
            self._count -= removed
            if not record.count:
                self._release(slot)
            elif len(record.log) + len(record.big) > 2 * record.count + _LOG_SLACK:
                live = self._live(record)
                record.log, record.big = array("q"), []
                record.append(live)
        return removed

    def _live(self, record: _Slot) -> list[int]:
        get = self._chunks.get
        bit = record.bit
        return [key for key in dict.fromkeys(record.logged()) if get(key, 0) & bit]

    def admit(self, instance_id: str, worker_id: int, location: str, keys: Sequence[int]) -> int:
        """Record that the worker's ``location`` tier holds ``keys``; returns how many are new."""
        if not keys:
            return 0
        self._sweep_some(len(keys))
        # a new slot has no bits yet, so non-empty keys always leave it non-empty
        return self._add(self._slot(instance_id, worker_id, location), keys)

    def evict(self, instance_id: str, worker_id: int, location: str, keys: Sequence[int]) -> int:
        """Record that the worker's tier dropped ``keys``; returns how many it really held."""
        slot = self._slot_of.get((instance_id, worker_id, location))
        if slot is None or not keys:
            return 0
        self._sweep_some(len(keys))
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
            record = self._record(slot)
            if worker_id is not None and record.ident[1] != worker_id:
                continue
            if location is not None and record.ident[2] != location:
                continue
            removed += self._purge(slot)
        return removed

    def remove_worker(self, instance_id: str, worker_id: int) -> int:
        """Purge everything one worker holds (dead or deregistered); returns how many."""
        return self.clear(instance_id, worker_id)

    def remove_instance(self, instance_id: str) -> int:
        """Purge everything an instance holds; returns how many chunk-locations."""
        return self.clear(instance_id)

    def replace(self, instance_id: str, worker_id: int, location: str, keys: Sequence[int]) -> None:
        """End of a full sync: the worker's ``location`` tier now holds exactly ``keys``."""
        wanted = dict.fromkeys(keys)
        slot = self._slot_of.get((instance_id, worker_id, location))
        if slot is None:
            if wanted:
                self._add(self._slot(instance_id, worker_id, location), wanted)
            return
        record = self._record(slot)
        stale = [key for key in self._live(record) if key not in wanted]
        self._add(slot, wanted)
        if stale:
            self._drop(slot, stale)

    # -------------------------------------------------------------- queries
    def worker_keys(self, instance_id: str, worker_id: int, location: str) -> list[int]:
        """The keys one worker's tier holds, in no particular order."""
        slot = self._slot_of.get((instance_id, worker_id, location))
        return [] if slot is None else self._live(self._record(slot))

    def locations_of(self, instance_id: str, worker_id: int) -> list[str]:
        """The tiers where a worker holds at least one chunk, fastest first."""
        found = [
            loc for (inst, wid, loc) in self._slot_of if inst == instance_id and wid == worker_id
        ]
        return sorted(found, key=tier_rank)

    def _scan(
        self, hashes: Iterable[int], slot_filter: int
    ) -> tuple[list[tuple[int, int]], list[_Run]]:
        """Leading hits counting only the slots in ``slot_filter`` (-1: all): see
        :func:`kvpool.protocol.index_scan.scan`."""
        return scan(self._chunks.get, self._decode, hashes, slot_filter)

    def prefix_hits(self, hashes: Sequence[int]) -> dict[str, InstanceHit]:
        """Longest cached prefix of a prompt's chained chunk hashes, per instance.

        Only instances holding the first chunk appear. See ``InstanceHit`` for the fields.
        """
        ends, runs = self._scan(hashes, ~self._dead)
        hits = per_instance(ends)
        if not hits:
            return {}
        per_loc: dict[int, dict[str, int]] = {inst: {} for inst in hits}
        for run in runs:
            for inst, loc in self._decode(run.mask).groups:
                if run.alive >> inst & 1:
                    counts = per_loc[inst]
                    counts[loc] = counts.get(loc, 0) + run.length
        workers = self._decode(runs[0].mask).workers  # every hit instance holds the first chunk
        result: dict[str, InstanceHit] = {}
        for inst, n in hits.items():
            name = self._inst_name[inst]
            result[name] = InstanceHit(name, n, per_loc[inst], workers[inst])
        return result

    def prefix_groups(self, hashes: Sequence[int]) -> list[HitGroup]:
        """:meth:`prefix_hits` as groups of instances holding exactly the same (a bitmask of
        instance indexes each; :meth:`instance_names` names them): its cost grows with the
        number of distinct answers, not of holders. Only instances holding the first chunk."""
        ends, runs = self._scan(hashes, ~self._dead)
        return hit_groups(ends, runs, self._decode) if ends else []

    def instance_names(self) -> tuple[int, list[str]]:
        """(version, instance id of each instance index): the version changes whenever an
        index gets a name, so a caller may keep what it derived from the list until then. An
        index whose instance left keeps its last name until reused; no answer includes it."""
        return self._inst_version, self._inst_name

    def p2p_lookup(
        self, hashes: Sequence[int], requester_instance: str, worker_id: int
    ) -> list[tuple[str, str, int, int]]:
        """Peers that hold a prefix of ``hashes`` on the same TP rank as the requester.

        Returns ``(instance_id, location, num_hit_chunks, worker_id)`` for every other instance
        whose worker ``worker_id`` holds at least the first chunk, longest first, ties by
        instance id. ``location`` is the fastest tier (``TIER_ORDER``) holding the first chunk.
        """
        allowed = self._rank_slots.get(worker_id, 0) & ~self._inst_slots.get(requester_instance, 0)
        if not allowed:
            return []
        ends, runs = self._scan(hashes, allowed)
        hits = per_instance(ends)
        if not hits:
            return []
        best: dict[int, str] = {}
        for inst, loc in self._decode(runs[0].mask).groups:
            if inst not in best or tier_rank(loc) < tier_rank(best[inst]):
                best[inst] = loc
        found = [(self._inst_name[inst], best[inst], n, worker_id) for inst, n in hits.items()]
        found.sort(key=lambda row: (-row[2], row[0]))
        return found

    def stats(self, *, sweep: bool = True) -> dict[str, int]:
        """Sizes: chunk_locations, chunks, instances, workers, and ``location:<name>`` counts.

        ``sweep=False`` (a metrics scrape, a stats reply) never sweeps first, so a scrape after
        a large purge costs O(workers), not the purged keys: ``chunks`` then still counts the
        keys only purged workers held, until :meth:`sweep` (the controller's sweep loop, in
        bounded steps) clears them; every other figure is exact either way."""
        if sweep:
            self.sweep()
        out = {
            "chunk_locations": self._count,
            "chunks": len(self._chunks),
            "instances": len(self._inst_slots),
            "workers": len({(inst, wid) for (inst, wid, _) in self._slot_of}),
        }
        for slot in self._slot_of.values():
            record = self._record(slot)
            name = f"location:{record.ident[2]}"
            out[name] = out.get(name, 0) + record.count
        return out

    def __len__(self) -> int:
        return self._count
