"""The chunk index's per-slot records: a slot's bit and key log, and the scan's small results.

Why a module of its own: :mod:`kvpool.protocol.index` is the index's logic (admission, eviction,
purge and sweep, the prefix scan); these are the plain records it keeps — one per
(instance, worker, location) *slot*, with the append-only log of the keys it admitted that
purge, full sync and ``worker_keys`` walk — and the memoised meaning of a slot mask. Nothing
here knows the index; the index is their only user.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain

__all__ = ["Decoded", "Run", "Slot"]


@dataclass(frozen=True)
class Decoded:
    """What a slot mask means: its instances, (instance, location) pairs and workers."""

    inst_mask: int
    groups: tuple[tuple[int, str], ...]
    workers: dict[int, tuple[int, ...]]  # instance index -> its worker ids, ascending
    locations: dict[str, int]  # location -> bitmask of the instances holding it there


@dataclass(frozen=True)
class Run:
    """A stretch of consecutive prompt chunks with the same holders."""

    mask: int
    length: int
    alive: int  # instances that hold every chunk up to and including this run


class Slot:
    """One (instance, worker, location): its bit, live key count and key log."""

    __slots__ = ("big", "bit", "count", "ident", "inst", "log", "swept")

    def __init__(self, ident: tuple[str, int, str], inst: int, bit: int) -> None:
        self.ident = ident
        self.inst = inst
        self.bit = bit
        self.count = 0
        self.log = array("q")
        self.big: list[int] = []  # keys that do not fit in int64 (or are not ints at all)
        self.swept = 0  # once purged: how many logged keys have been swept

    def append(self, keys: list[int]) -> None:
        size = len(self.log)
        try:
            self.log.extend(keys)
        except (OverflowError, TypeError):
            del self.log[size:]
            for key in keys:
                try:
                    self.log.append(key)
                except (OverflowError, TypeError):
                    self.big.append(key)

    def logged(self) -> Iterable[int]:
        """Every key ever logged (stale and repeated ones included)."""
        return chain(self.log, self.big)

    def logged_range(self, start: int, stop: int) -> Iterable[int]:
        """``list(self.logged())[start:stop]`` without walking the keys before ``start``."""
        n = len(self.log)
        return chain(self.log[start:stop], self.big[max(0, start - n) : max(0, stop - n)])
