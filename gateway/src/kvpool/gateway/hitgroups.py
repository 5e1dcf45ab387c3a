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
        """One hit per configured instance name (the longest of its ids'); equal hits are one
        object, as :func:`kvpool.gateway.index_client.hits_by_name` hands them out."""
        out: dict[str, PrefixHit] = {}
        ids = self.ids
        for group, hit in zip(self.groups, self.hits(), strict=True):
            rest = group.instances
            while rest:
                low = rest & -rest
                rest ^= low
                name = name_of(ids[low.bit_length() - 1])
                prev = out.get(name)
                if prev is None or hit.hit_chunks > prev.hit_chunks:
                    out[name] = hit
        return out


class GroupPositions:
    """Maps groups to the positions of one list of candidates (``names``), caching the map
    from index instance ids to positions while the index's ids and version stay the same."""

    def __init__(self, names: Sequence[str], position: Callable[[str], int | None]) -> None:
        self._count = len(names)
        self._position = position
        self._key: tuple[int, int] | None = None
        self._ids: Sequence[str] | None = None  # kept so its id() is not reused while cached
        self._map: IntArray = np.zeros(0, dtype=np.int64)

    def _positions_of_ids(self, grouped: GroupedHits) -> IntArray:
        key = (id(grouped.ids), grouped.version)
        if key != self._key or len(self._map) < len(grouped.ids):
            ids = grouped.ids
            width = (len(ids) + 7) // 8 * 8  # whole bytes of bitmask
            out = np.full(width, -1, dtype=np.int64)
            for inst, instance_id in enumerate(ids):
                pos = self._position(name_of(instance_id))
                if pos is not None:
                    out[inst] = pos
            self._map, self._key, self._ids = out, key, ids
        return self._map

    def shared(self, grouped: GroupedHits) -> list[tuple[IntArray, PrefixHit]]:
        """(positions, hit) per group that has candidates, shortest hit first: where ids of
        one name fall in two groups the later (longer) entry is the one that counts, as
        :class:`kvpool.gateway.candidates.Candidates` reads them."""
        table = self._positions_of_ids(grouped)
        nbytes = len(table) // 8
        out: list[tuple[IntArray, PrefixHit]] = []
        order = sorted(range(len(grouped.groups)), key=lambda g: grouped.groups[g].hit_chunks)
        hits = grouped.hits()
        for g in order:
            mask = grouped.groups[g].instances
            if mask.bit_length() > len(table):
                continue  # ids newer than the table: cannot be (the key changes with them)
            bits = np.unpackbits(
                np.frombuffer(mask.to_bytes(nbytes, "little"), dtype=np.uint8), bitorder="little"
            )
            positions = table[bits.view(np.bool_)]
            positions = positions[positions >= 0]
            if len(positions):
                out.append((positions, hits[g]))
        return out

    def owners(self, shared: Sequence[tuple[IntArray, PrefixHit]]) -> IntArray:
        """Index into ``shared`` of the entry that counts for each position (-1: none)."""
        owner = np.full(self._count, -1, dtype=np.int64)
        for k, (positions, _) in enumerate(shared):
            owner[positions] = k
        return owner
