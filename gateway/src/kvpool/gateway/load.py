"""Per-instance load, as the router sees it. Pure: the caller passes the clock.

Why this module exists: the router weighs what an instance holds against how busy it is.
:class:`LoadTracker` counts what is in flight per instance: requests, prefill tokens not yet
answered by a first byte, and a recent-TTFT average; each admitted request holds a
:class:`Ticket` that it hands back on its first byte and at its end (the optimistic prefix
entries of :mod:`kvpool.gateway.pending` follow the same ticket).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from kvpool.gateway.candidates import FloatArray, InstanceLoad, IntArray

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
    #: called on the first byte and at an end without one (set by who follows the request)
    on_change: Callable[[Ticket], None] | None = None


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
        if ticket.on_change is not None:
            ticket.on_change(ticket)
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
            if ticket.on_change is not None:
                ticket.on_change(ticket)

    def forget(self, instance: str) -> None:
        slot = self._slot.get(instance)
        if slot is not None:
            self._inflight[slot] = 0
            self._queued[slot] = 0
            self._ttft[slot] = math.nan
