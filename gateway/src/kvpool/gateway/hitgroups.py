"""The index's grouped answer (:mod:`kvpool.protocol.index_groups`) as routing takes it.

Why this module exists: at a thousand instances a prompt that starts with a shared system
prompt has hundreds of holders, nearly all holding the same chunks in the same tiers. The
replica answers such a lookup as a few groups, each a bitmask of index instance ids; this
module turns each group into the candidate positions that hold it (numpy, no Python object per
holder) and, where a caller needs one hit per configured name (the HTTP fallback's shape,
small pools with P2P groups, ``/memory``), expands it. Instance ids are ``name~fingerprint``;
several ids may name one configured instance (a restart with a new fingerprint not yet gone
from the index): the longest hit wins, as in the per-name answer. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvpool.gateway.candidates import IntArray, PrefixHit
from kvpool.gateway.pending import merge_pending
from kvpool.protocol.domain import split_instance_id
from kvpool.protocol.index import HitGroup

__all__ = ["GroupPositions", "GroupedHits", "name_of"]

#: instance id -> configured name (ids are few and long-lived; dropped when it grows past this)
_NAMES: dict[str, str] = {}
_NAMES_LIMIT = 1 << 16


def name_of(instance_id: str) -> str:
    """The configured instance name of a controller instance id (``name~fingerprint``)."""
    name = _NAMES.get(instance_id)
    if name is None:
        if len(_NAMES) >= _NAMES_LIMIT:
            _NAMES.clear()
        name = _NAMES[instance_id] = split_instance_id(instance_id)[0]
    return name


@dataclass(frozen=True)
class GroupedHits:
    """An index answer: ``groups`` (disjoint bitmasks of index instance ids) over the index's
    ``ids`` (instance id of each index instance id, the index's own list: read only) at
    ``version`` (:meth:`kvpool.protocol.index.ChunkIndex.instance_names`)."""

    groups: Sequence[HitGroup]
    ids: Sequence[str]
    version: int

    def __bool__(self) -> bool:
        return bool(self.groups)

    def hits(self) -> list[PrefixHit]:
        """One :class:`PrefixHit` per group, in the order of :attr:`groups`."""
        return [PrefixHit(g.hit_chunks, g.per_location) for g in self.groups]

    def by_name(self) -> dict[str, PrefixHit]:
        """One hit per configured instance name (the longest of its ids'; of two as long, the
        later group's); a group's hit is one object for all its members."""
        out: dict[str, PrefixHit] = {}
        ids = self.ids
        for group, hit in zip(self.groups, self.hits(), strict=True):
            rest = group.instances
            while rest:
                low = rest & -rest
                rest ^= low
                name = name_of(ids[low.bit_length() - 1])
                prev = out.get(name)
                if prev is None or hit.hit_chunks >= prev.hit_chunks:
                    out[name] = hit  # ties: the later group, as GroupPositions.shared orders
        return out


class GroupPositions:
    """Maps bitmasks of instance ids to the positions of one list of candidates (``count`` of
    them, ``position`` of a configured name), caching each id list's map while its version
    stays (the index's instance ids; the pending prefixes' names)."""

    def __init__(self, count: int, position: Callable[[str], int | None]) -> None:
        self._count = count
        self._position = position
        # id(ids) -> (version, ids kept so their id() is not reused while cached, map)
        self._tables: dict[int, tuple[int, Sequence[str], IntArray]] = {}

    def table(self, ids: Sequence[str], version: int, resolve: Callable[[str], str]) -> IntArray:
        """Position of each id's configured name (``resolve``), -1 where none, padded to whole
        bytes of bitmask."""
        cached = self._tables.get(id(ids))
        if cached is not None and cached[0] == version and cached[1] is ids:
            return cached[2]
        out = np.full((len(ids) + 7) // 8 * 8, -1, dtype=np.int64)
        for i, value in enumerate(ids):
            pos = self._position(resolve(value))
            if pos is not None:
                out[i] = pos
        if len(self._tables) >= 4:
            self._tables.clear()
        self._tables[id(ids)] = (version, ids, out)
        return out

    @staticmethod
    def positions(table: IntArray, mask: int) -> IntArray:
        """The positions of the ids set in ``mask`` (ids without a candidate left out)."""
        bits = np.unpackbits(
            np.frombuffer(mask.to_bytes(len(table) // 8, "little"), dtype=np.uint8),
            bitorder="little",
        )
        found = table[bits.view(np.bool_)]
        return found[found >= 0]

    def shared(self, grouped: GroupedHits) -> list[tuple[IntArray, PrefixHit]]:
        """(positions, hit) per group that has candidates, shortest hit first: where ids of
        one name fall in two groups the later (longer) entry is the one that counts, as
        :class:`kvpool.gateway.candidates.Candidates` reads them."""
        table = self.table(grouped.ids, grouped.version, name_of)
        hits = grouped.hits()
        out: list[tuple[IntArray, PrefixHit]] = []
        for g in sorted(range(len(hits)), key=lambda g: hits[g].hit_chunks):
            positions = self.positions(table, grouped.groups[g].instances)
            if len(positions):
                out.append((positions, hits[g]))
        return out

    def owners(self, shared: Sequence[tuple[IntArray, PrefixHit]]) -> IntArray:
        """Index into ``shared`` of the entry that counts for each position (-1: none)."""
        owner = np.full(self._count, -1, dtype=np.int64)
        for k, (positions, _) in enumerate(shared):
            owner[positions] = k
        return owner

    def with_pending(
        self,
        shared: Sequence[tuple[IntArray, PrefixHit]],
        ends: Sequence[tuple[int, int]],
        table: IntArray,
    ) -> list[tuple[IntArray, PrefixHit]]:
        """Entries to append to ``shared`` for the pending prefixes that reach further than
        what the index says a position holds (``ends``: (chunks, bitmask over ``table``'s ids)
        as :meth:`kvpool.gateway.pending.PendingPrefixes.ends` gives them): one per distinct
        (index hit, pending chunks), the hit :func:`~kvpool.gateway.pending.merge_pending`
        makes of them."""
        owner = self.owners(shared)
        held = np.array([hit.hit_chunks for _, hit in shared] + [0], dtype=np.int64)  # [-1]: 0
        out: list[tuple[IntArray, PrefixHit]] = []
        for chunks, mask in ends:
            positions = self.positions(table, mask)
            own = owner[positions]
            further = held[own] < chunks
            positions, own = positions[further], own[further]
            for k in np.unique(own).tolist():
                merged = merge_pending(shared[k][1] if k >= 0 else None, chunks)
                if merged is not None:
                    out.append((positions[own == k], merged))
        return out
