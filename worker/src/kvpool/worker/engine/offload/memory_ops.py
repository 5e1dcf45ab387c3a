"""The agent memory API of ``LMCacheOffload``: evict, prefetch, pin, unpin, memory stats.

Why this module exists: these operations work on LMCache's storage backends directly (remove a
chunk from chosen tiers and from the remote tier, pull lower-tier chunks into DDR with their
integrity checked, pin chunks so eviction skips them) and are separate from the store and
retrieve path; keeping them in a mixin keeps ``lmcache_offload`` readable.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig

from kvpool.worker.engine.offload import tiers
from kvpool.worker.engine.offload.connector import CPUPagedConnector
from kvpool.worker.engine.offload.storage_ops import remote_remove
from kvpool.worker.engine.offload.tiers import RemoteHealth


class MemoryOps:
    """Mixin over the attributes ``LMCacheOffload`` sets up."""

    engine: Any
    config: LMCacheEngineConfig
    connector: CPUPagedConnector
    tiers: list[str]
    _storage: Any
    _lock: threading.RLock
    _pinned: dict[CacheEngineKey, list[str]]
    _metrics: dict[str, float]
    chunk_size: int
    _remote_health: RemoteHealth | None
    _count: Callable[..., None]
    _chunks: Callable[[Sequence[int]], list[tuple[int, int, CacheEngineKey]]]
    _drop_chunk: Callable[[CacheEngineKey], None]

    def evict(
        self,
        *,
        token_ids: Sequence[int] | None = None,
        chunk_hashes: Sequence[int] | None = None,
        locations: Sequence[str] | None = None,
    ) -> int:
        if (token_ids is None) == (chunk_hashes is None):
            raise ValueError("evict: give exactly one of token_ids or chunk_hashes")
        backends = (
            None if locations is None else [tiers.backend_for(t, self.tiers) for t in locations]
        )
        with self._lock:
            if token_ids is not None:
                keys = [k for _, _, k in self._chunks(token_ids)]
            else:
                db = self.engine.token_database
                keys = [db._make_key_by_hash(int(h)) for h in chunk_hashes or ()]
            removed = 0
            for key in keys:
                if key in self._pinned:
                    self._count("evict_skipped_pinned")
                    continue
                local = [
                    b for b in tiers.BACKEND_OF_TIER.values() if backends is None or b in backends
                ]
                n = self._storage.remove(key, local) if local else 0
                if backends is None or tiers.REMOTE_BACKEND in backends:
                    n += int(remote_remove(self._storage, key))
                removed += int(n > 0)
            self._count("evicted_chunks", removed)
            return removed

    def prefetch(self, token_ids: Sequence[int]) -> int:
        tokens = list(token_ids)
        with self._lock:
            chunks = self._chunks(tokens)
            span = {k: (s, e) for s, e, k in chunks}
            _, mapping = self._storage.batched_contains([k for _, _, k in chunks])
            for backend, keys in mapping.items():
                if backend == tiers.BACKEND_OF_TIER[tiers.LOCAL_CPU]:
                    continue
                objs = self._storage.batched_get(list(keys), location=backend)
                ok = True
                for key, obj in zip(keys, objs, strict=True):
                    if obj is None:
                        ok = False
                        continue
                    s, e = span[key]
                    if ok and not self.connector.check(obj, tokens[s:e]):
                        self._drop_chunk(key)
                        ok = False
                    obj.ref_count_down()
                tier = tiers.tier_of_backend(backend, self.tiers)
                self._count(f"prefetched_chunks.{tier}", len(keys))
                if not ok:
                    break
            return int(self.engine.lookup(tokens, search_range=["LocalCPUBackend"]))

    def _local_backends(self) -> list[tuple[str, Any]]:
        sb = self._storage.storage_backends
        return [(n, sb[n]) for n in tiers.BACKEND_OF_TIER.values() if n in sb]

    def pin(self, token_ids: Sequence[int]) -> int:
        with self._lock:
            pinned_to = 0
            for _, end, key in self._chunks(token_ids):
                if key not in self._pinned:
                    where = [name for name, b in self._local_backends() if b.pin(key)]
                    if not where:
                        break
                    self._pinned[key] = where
                pinned_to = end
            return pinned_to

    def unpin(self, token_ids: Sequence[int]) -> int:
        with self._lock:
            unpinned_to = 0
            backends = dict(self._local_backends())
            for _, end, key in self._chunks(token_ids):
                where = self._pinned.pop(key, None)
                if where is None:
                    break
                for name in where:
                    backends[name].unpin(key)
                unpinned_to = end
            return unpinned_to

    def memory_stats(self) -> dict[str, object]:
        out = tiers.local_tier_stats(self._storage, self.config)
        if self._remote_health is not None:
            out[self._remote_health.tier] = {
                "chunks": None,  # shared by every worker of the pool; the controller counts
                "bytes": None,
                "capacity_bytes": None,
                "up": self._remote_health.up,
            }
        return {
            "tiers": out,
            "pinned_chunks": len(self._pinned),
            "chunk_size": self.chunk_size,
            "hit_tokens": self._metrics.get("lookup_hit_tokens", 0.0),
            "miss_requests": self._metrics.get("lookup_miss_requests", 0.0),
        }
