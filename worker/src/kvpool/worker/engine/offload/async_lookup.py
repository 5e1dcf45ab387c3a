"""LMCache's asynchronous lookup-and-prefetch, driven the way vLLM's scheduler drives it.

Why this module exists: LMCache's P2P backend answers only asynchronously (its synchronous
``contains`` is always False), so a peer's KV reaches this worker only through
``LMCacheEngine.async_lookup_and_prefetch``. In vLLM the scheduler asks
``LMCacheAsyncLookupClient`` for a request's hit on every step, gets ``None`` while the lookup
and prefetch run in the worker's storage manager, and schedules the request once the worker's
``LMCacheAsyncLookupServer`` answered; ``start_load_kv`` then retrieves with ``req_id`` equal to
the lookup id, and an aborted request's prefetched memory is released with
``cleanup_memory_objs`` once its prefetch finished. The reference engine is one process, so
this object plays the lookup server's role in process (the storage manager calls
``send_response_to_scheduler`` from LMCache's event-loop thread) and the lookup client's role
for the scheduler: pending until answered, a timeout that turns into a miss
(``lookup_timeout_ms``), and cancellation that frees what an abandoned prefetch holds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# An abandoned lookup whose answer never comes is forgotten after this many timeouts.
_FORGET_AFTER_TIMEOUTS = 10


@dataclass
class _Lookup:
    started: float
    hit: int | None = None  # None: LMCache has not answered yet
    cancelled: bool = False


class AsyncLookups:
    """Pending lookups by id; thread-safe (LMCache answers from its own loop thread)."""

    def __init__(
        self,
        timeout_s: float,
        *,
        release: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``release(lookup_id)`` frees the memory a finished prefetch holds (LMCache's
        ``cleanup_memory_objs``, which LMCache's own lookup server also calls off its loop)."""
        self.timeout_s = timeout_s
        self._release = release
        self._clock = clock
        self._lock = threading.Condition()
        self._lookups: dict[str, _Lookup] = {}
        self._on_answer: Callable[[], None] | None = None
        self.timeouts = 0
        self.released = 0

    def set_listener(self, on_answer: Callable[[], None] | None) -> None:
        """Called (from LMCache's thread) whenever a lookup is answered: wake the scheduler."""
        self._on_answer = on_answer

    # --- LMCache's side (the lookup server role) ----------------------------------------
    def send_response_to_scheduler(self, lookup_id: str, num_hit_tokens: int) -> None:
        release = False
        with self._lock:
            entry = self._lookups.get(lookup_id)
            if entry is not None:
                entry.hit = int(num_hit_tokens)
                if entry.cancelled:  # nobody will retrieve it: free the prefetch right away
                    del self._lookups[lookup_id]
                    release = True
            self._lock.notify_all()
        if release:
            self._release_now(lookup_id)
        listener = self._on_answer
        if listener is not None:
            try:
                listener()
            except Exception:  # a closed event loop: nobody is waiting any more
                logger.debug("lookup listener failed", exc_info=True)

    # --- the scheduler's side ------------------------------------------------------------
    def begin(self, lookup_id: str) -> None:
        with self._lock:
            self._lookups[lookup_id] = _Lookup(started=self._clock())

    def result(self, lookup_id: str) -> int | None:
        """Hit tokens once answered; None while pending; 0 (and cancelled) after the timeout."""
        with self._lock:
            entry = self._lookups.get(lookup_id)
            if entry is None:
                return 0
            if entry.hit is not None:
                return entry.hit
            if self._clock() - entry.started <= self.timeout_s:
                return None
            entry.cancelled = True
            self.timeouts += 1
        logger.warning(
            "lookup %s still unanswered after %.1fs: recomputing its prompt",
            lookup_id,
            self.timeout_s,
        )
        return 0

    def wait(self, lookup_id: str) -> int:
        """Block until ``result`` is not None (at most the timeout) and return it."""
        while True:
            hit = self.result(lookup_id)
            if hit is not None:
                return hit
            with self._lock:
                entry = self._lookups.get(lookup_id)
                if entry is not None and entry.hit is None:
                    self._lock.wait(0.05)

    def consumed(self, lookup_id: str) -> None:
        """The retrieve used (and released) the prefetched chunks: forget the lookup."""
        with self._lock:
            self._lookups.pop(lookup_id, None)

    def cancel(self, lookup_id: str) -> None:
        """The request is gone: free its prefetched memory now, or once it is answered."""
        with self._lock:
            entry = self._lookups.get(lookup_id)
            if entry is None:
                return
            entry.cancelled = True
        self.sweep()

    def sweep(self) -> None:
        """Release every cancelled lookup that LMCache answered; forget hopeless ones."""
        now = self._clock()
        with self._lock:
            done = [k for k, e in self._lookups.items() if e.cancelled and e.hit is not None]
            lost = [
                k
                for k, e in self._lookups.items()
                if e.cancelled
                and e.hit is None
                and now - e.started > self.timeout_s * _FORGET_AFTER_TIMEOUTS
            ]
            for key in done + lost:
                del self._lookups[key]
        for key in done:
            self._release_now(key)

    def _release_now(self, lookup_id: str) -> None:
        try:
            self._release(lookup_id)
            self.released += 1
        except Exception:
            logger.exception("releasing the prefetch of lookup %s failed", lookup_id)

    @property
    def pending(self) -> int:
        """Lookups not yet consumed or released (answered or not)."""
        with self._lock:
            return len(self._lookups)
