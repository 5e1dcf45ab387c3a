"""The asynchronous lookup-and-prefetch half of ``LMCacheOffload`` (P2P needs it).

Why this module exists: with ``enable_async_loading`` every retrieve goes through LMCache's
``async_lookup_and_prefetch`` and a retrieve keyed by the lookup id (LMCache then reads the
prefetched chunks from its event manager, not from the tiers). These methods start, answer,
consume and cancel such lookups so that no prefetched chunk is ever left pinned; see
:mod:`.async_lookup` for the lookup-server role.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.event_manager import EventStatus, EventType

from kvpool.worker.engine.offload import tiers
from kvpool.worker.engine.offload.async_lookup import AsyncLookups
from kvpool.worker.engine.offload.connector import REPORT_KW, TOKENS_KW, RetrieveReport

logger = logging.getLogger(__name__)


def leading_true(mask: torch.Tensor) -> int:
    """Length of the all-True prefix of a retrieve mask."""
    if mask.numel() == 0 or bool(mask.all()):
        return int(mask.numel())
    return int((~mask).to(torch.int8).argmax())


class PrefetchOps:
    """Mixin over the attributes ``LMCacheOffload`` sets up."""

    engine: Any
    chunk_size: int
    async_lookups: AsyncLookups | None
    _storage: Any
    _lock: threading.RLock
    _count: Callable[..., None]
    _chunks: Callable[[Sequence[int]], list[tuple[int, int, CacheEngineKey]]]

    # --- asynchronous lookup and prefetch (P2P) ---------------------------------------------
    def start_lookup(self, token_ids: Sequence[int], lookup_id: str | None = None) -> str:
        """Start LMCache's lookup-and-prefetch for ``token_ids``; returns the lookup id."""
        lookups = self.async_lookups
        if lookups is None:
            raise RuntimeError("start_lookup needs enable_async_loading")
        lid = lookup_id or f"kvpool-{uuid.uuid4().hex}"
        lookups.begin(lid)
        tokens = list(token_ids)
        if not tokens:
            lookups.send_response_to_scheduler(lid, 0)
            return lid
        lookups.sweep()
        self.engine.async_lookup_and_prefetch(lookup_id=lid, tokens=tokens, pin=True)
        return lid

    def _engine_retrieve(
        self,
        tokens: list[int],
        kv_caches: Sequence[torch.Tensor],
        slots: torch.Tensor,
        req_id: str,
        report: RetrieveReport,
    ) -> int | None:
        """LMCache's retrieve of ``tokens`` into the paged caches: tokens loaded, or None
        when LMCache failed (the caller recomputes)."""
        try:
            mask = self.engine.retrieve(
                tokens,
                kvcaches=list(kv_caches),
                slot_mapping=slots[: len(tokens)],
                req_id=req_id,
                **{TOKENS_KW: tokens, REPORT_KW: report},
            )
        except Exception:
            logger.exception("LMCache retrieve failed for %d tokens: recomputing", len(tokens))
            self._count("retrieve_failures")
            return None
        return leading_true(mask)

    @property
    def async_loading(self) -> bool:
        return self.async_lookups is not None

    def set_lookup_listener(self, on_answer: Callable[[], None] | None) -> None:
        """``on_answer()`` runs (on LMCache's thread) whenever a lookup is answered."""
        if self.async_lookups is not None:
            self.async_lookups.set_listener(on_answer)

    def lookup_result(self, lookup_id: str) -> int | None:
        """Hit tokens of a started lookup; None while LMCache is still looking and pulling."""
        if self.async_lookups is None:
            return 0
        return self.async_lookups.result(lookup_id)

    def cancel_lookup(self, lookup_id: str) -> None:
        """The request will not retrieve: release its prefetched chunks (now or on answer)."""
        if self.async_lookups is not None:
            self.async_lookups.cancel(lookup_id)

    def _release_prefetch(self, lookup_id: str) -> None:
        self.engine.cleanup_memory_objs(lookup_id)

    def _forget_event(self, lookup_id: str) -> None:
        """LMCache's retrieve released the prefetched chunks but keeps the event: drop it."""
        events = self.engine.event_manager
        if events.get_event_status(EventType.LOADING, lookup_id) == EventStatus.DONE:
            events.pop_event(EventType.LOADING, lookup_id)

    def pending_prefetches(self) -> int:
        """Lookups (and their prefetched chunks) not yet retrieved or released."""
        return 0 if self.async_lookups is None else self.async_lookups.pending

    def _retrieve_prefetched(
        self,
        tokens: list[int],
        hit: int,
        n: int,
        kv_caches: Sequence[torch.Tensor],
        slots: torch.Tensor,
        lookup_id: str,
    ) -> int:
        assert self.async_lookups is not None
        if hit <= 0:
            self.async_lookups.cancel(lookup_id)
            self._count("lookup_requests")
            self._count("lookup_miss_requests")
            return 0
        with self._lock:
            cpu = self._storage.storage_backends.get(tiers.BACKEND_OF_TIER[tiers.LOCAL_CPU])
            # Chunks still in this process's DDR were sealed here or verified on the way in;
            # a peer's (P2P) or a lower tier's are verified before they reach the cache.
            report = RetrieveReport(
                trusted_starts={
                    s for s, _, k in self._chunks(tokens[:hit]) if cpu and cpu.contains(k)
                }
            )
            got = self._engine_retrieve(tokens[:hit], kv_caches, slots, lookup_id, report)
            if got is None:
                self.async_lookups.cancel(lookup_id)
            else:
                self._forget_event(lookup_id)
                self.async_lookups.consumed(lookup_id)
            loaded = got or 0
            if report.verified_end is not None:
                loaded = min(loaded, report.verified_end)
            remote = len(range(0, hit, self.chunk_size)) - len(report.trusted_starts)
            if remote > 0:
                self._count("p2p_or_lower_tier_chunks", remote)
            loaded = min(loaded, n)
            self._count("lookup_requests")
            if loaded:
                self._count("lookup_hit_tokens", loaded)
            else:
                self._count("lookup_miss_requests")
            return loaded
