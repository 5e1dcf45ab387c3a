"""``LMCacheOffload``: the reference engine's KV offload over the real LMCache 0.5.6 engine.

Why this module exists: it implements :class:`kvpool.worker.offload_api.KVOffload` with
LMCache's own engine (``LMCacheEngineBuilder``, ``store``/``lookup``/``retrieve``), its storage
backends (local CPU, local disk, Redis, Mooncake — configured only through the LMCache YAML)
and its controller client (``enable_controller``). kvpool adds what LMCache lacks on a CPU box:
the paged connector (:mod:`.connector`), an integrity guard so a corrupted chunk from disk or a
remote tier is a miss (:mod:`.guard`), remote-tier bypass while the tier is down
(:mod:`.tiers`), per-tier metrics, and a close that returns within its deadline.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.metadata import LMCacheMetadata

from kvpool.worker.engine.offload import tiers
from kvpool.worker.engine.offload.config import OffloadConfigError, kv_dtype, load_config
from kvpool.worker.engine.offload.connector import (
    REPORT_KW,
    TOKENS_KW,
    CPUPagedConnector,
    RetrieveReport,
)
from kvpool.worker.engine.offload.storage_ops import (
    close_redis,
    deregister_first,
    disk_length_ok,
    flush_pending,
    remote_remove,
)

logger = logging.getLogger(__name__)

_MAX_UNCONFIRMED = 4096  # remote writes flush() waits for (the most recent ones)


def _leading_true(mask: torch.Tensor) -> int:
    if mask.numel() == 0 or bool(mask.all()):
        return int(mask.numel())
    return int((~mask).to(torch.int8).argmax())


def _no_broadcast(tensor: torch.Tensor, src: int) -> None:
    return None


def _no_broadcast_object(obj: Any, src: int) -> Any:
    return obj


class LMCacheOffload:
    """KV offload of one engine (one TP rank) through one LMCache engine instance."""

    def __init__(
        self,
        config: str | os.PathLike[str] | Mapping[str, Any] | LMCacheEngineConfig,
        *,
        instance_id: str,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype | str,
        model_name: str,
        world_size: int = 1,
        worker_id: int = 0,
        probe_interval_s: float = 2.0,
    ) -> None:
        os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")  # LMCache phones home otherwise
        cfg = config if isinstance(config, LMCacheEngineConfig) else load_config(config)
        if min(num_layers, num_kv_heads, head_dim, block_size) <= 0:
            raise OffloadConfigError("num_layers, num_kv_heads, head_dim, block_size must be > 0")
        if cfg.use_layerwise or cfg.enable_blending or cfg.enable_async_loading:
            raise OffloadConfigError(
                "use_layerwise, enable_blending and enable_async_loading are not supported by "
                "the CPU reference engine: set them to false"
            )
        if cfg.lmcache_instance_id is None:
            cfg.lmcache_instance_id = instance_id
        self.instance_id = str(cfg.lmcache_instance_id)
        self.config = cfg
        self.chunk_size: int = int(cfg.chunk_size)
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.block_size = block_size
        self.dtype = kv_dtype(dtype)
        self.model_name = model_name
        self.tiers = tiers.configured_tiers(cfg)
        self.connector = CPUPagedConnector(
            num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=self.dtype
        )
        metadata = LMCacheMetadata(
            model_name=model_name,
            world_size=world_size,
            local_world_size=world_size,
            worker_id=worker_id,
            local_worker_id=worker_id,
            kv_dtype=self.dtype,
            # LMCache sizes chunks as [2, L, T, kv_shape[3] * kv_shape[4]]: one "head" whose
            # width is the payload plus kvpool's guard.
            kv_shape=(num_layers, 2, self.chunk_size, 1, self.connector.row_width),
            chunk_size=self.chunk_size,
        )
        self._payload_bytes_per_token = (
            2 * num_layers * num_kv_heads * head_dim * self.connector.dtype.itemsize
        )
        self._lock = threading.RLock()
        self._pinned: dict[CacheEngineKey, list[str]] = {}
        self._unconfirmed_remote: list[CacheEngineKey] = []  # stored, not yet seen remotely
        self._metrics: dict[str, float] = {}
        self._closed = False
        self.closed_cleanly: bool | None = None
        remote = tiers.remote_tier_name(cfg.remote_url)
        addr = tiers.remote_probe_address(cfg)
        self._remote_health = (
            tiers.RemoteHealth(remote, addr, interval_s=probe_interval_s)
            if remote is not None and addr is not None
            else None
        )
        try:
            self.engine: LMCacheEngine = LMCacheEngineBuilder.get_or_create(
                self.instance_id,
                cfg,
                metadata,
                self.connector,
                _no_broadcast,
                _no_broadcast_object,
            )
            self.engine.post_init()
        except Exception as e:
            LMCacheEngineBuilder.destroy(self.instance_id)
            raise OffloadConfigError(f"LMCache engine {self.instance_id!r} failed: {e}") from e
        assert self.engine.storage_manager is not None
        self._storage = self.engine.storage_manager
        logger.info(
            "LMCache offload %s ready: tiers %s, chunk %d tokens, %d bytes/token",
            self.instance_id,
            self.tiers,
            self.chunk_size,
            self._payload_bytes_per_token,
        )

    # --- helpers ---------------------------------------------------------------------------
    def _count(self, name: str, value: float = 1.0) -> None:
        self._metrics[name] = self._metrics.get(name, 0.0) + value

    def _chunks(self, tokens: Sequence[int]) -> list[tuple[int, int, CacheEngineKey]]:
        db = self.engine.token_database
        return [(s, e, k) for s, e, k in db.process_tokens(tokens=list(tokens))]

    def chunk_hashes(self, token_ids: Sequence[int]) -> list[int]:
        """LMCache's chunk hashes of the full chunks of ``token_ids`` (what the controller sees)."""
        return [k.chunk_hash for _, _, k in self._chunks(token_ids)]

    def chunk_keys(self, token_ids: Sequence[int]) -> list[str]:
        """LMCache's storage keys (``CacheEngineKey.to_string()``) of the full chunks."""
        return [k.to_string() for _, _, k in self._chunks(token_ids)]

    def _check_caches(self, kv_caches: Sequence[torch.Tensor], slot_mapping: torch.Tensor) -> None:
        self.connector.check_caches(kv_caches, slot_mapping, self.block_size)

    def _refresh_health(self) -> None:
        h = self._remote_health
        if h is None:
            return
        changed = h.refresh()
        if changed is not None:
            self._storage.set_backend_bypass(tiers.REMOTE_BACKEND, not changed)
            if not changed:
                self._count(f"tier_down_events.{h.tier}")

    def _drop_chunk(self, key: CacheEngineKey) -> None:
        """Remove a chunk that failed verification from every tier (local and remote)."""
        self._count("corrupt_chunks")
        self._storage.remove(key, list(tiers.BACKEND_OF_TIER.values()))
        remote_remove(self._storage, key)

    # --- KVOffload -------------------------------------------------------------------------
    def lookup(self, token_ids: Sequence[int]) -> int:
        with self._lock:
            self._refresh_health()
            if not token_ids:
                return 0
            return int(self.engine.lookup(list(token_ids)))

    def store(
        self,
        token_ids: Sequence[int],
        kv_caches: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor,
    ) -> None:
        tokens = list(token_ids)
        n = len(tokens)
        if n == 0:
            return
        self._check_caches(kv_caches, slot_mapping)
        if slot_mapping.numel() < n:
            raise ValueError(f"slot_mapping has {slot_mapping.numel()} slots for {n} tokens")
        with self._lock:
            self._refresh_health()
            storable = n if self.config.save_unfull_chunk else n - n % self.chunk_size
            done = int(self.engine.lookup(tokens))
            done -= done % self.chunk_size
            if storable <= done:
                return
            mask = torch.ones(n, dtype=torch.bool)
            mask[:done] = False
            self.engine.store(
                tokens,
                mask=mask,
                kvcaches=list(kv_caches),
                slot_mapping=slot_mapping[:n].to(torch.long),
                **{TOKENS_KW: tokens},
            )
            nbytes = (storable - done) * self._payload_bytes_per_token
            if self._remote_health is not None and self._remote_up():
                self._unconfirmed_remote.extend(
                    k for s, _, k in self._chunks(tokens[:storable]) if s >= done
                )
                del self._unconfirmed_remote[:-_MAX_UNCONFIRMED]  # bounded: flush may never come
            for tier in self.tiers:
                if tier in tiers.BACKEND_OF_TIER or self._remote_up():
                    self._count(f"stored_bytes.{tier}", nbytes)

    def _remote_up(self) -> bool:
        return self._remote_health is None or self._remote_health.up

    def retrieve(
        self,
        token_ids: Sequence[int],
        num_tokens: int,
        kv_caches: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor,
    ) -> int:
        tokens = list(token_ids)
        n = min(num_tokens, len(tokens))
        if n <= 0:
            return 0
        self._check_caches(kv_caches, slot_mapping)
        if slot_mapping.numel() < n:
            raise ValueError(f"slot_mapping has {slot_mapping.numel()} slots for {n} tokens")
        # Whole stored chunks cover the first n tokens; slots past n are -1 (not written).
        span = min(len(tokens), -(-n // self.chunk_size) * self.chunk_size)
        slots = torch.full((span,), -1, dtype=torch.long)
        slots[:n] = slot_mapping[:n].to(torch.long)
        req_id = f"kvpool-{uuid.uuid4().hex}"
        with self._lock:
            self._refresh_health()
            hit = int(self.engine.lookup(tokens[:span], lookup_id=req_id, pin=True))
            mapping = {loc: list(keys) for loc, keys in self.engine.lookup_pins[req_id].items()}
            hit = self._check_disk_lengths(tokens[:hit], mapping)
            # LMCache maps the prefix to tiers in backend order, local CPU first: those chunks
            # were sealed here or verified on their way in.
            local = len(mapping.get(tiers.BACKEND_OF_TIER[tiers.LOCAL_CPU], ()))
            report = RetrieveReport(trusted_starts={i * self.chunk_size for i in range(local)})
            loaded = 0
            try:
                if hit > 0:
                    mask = self.engine.retrieve(
                        tokens[:hit],
                        kvcaches=list(kv_caches),
                        slot_mapping=slots[:hit],
                        req_id=req_id,
                        **{TOKENS_KW: tokens[:hit], REPORT_KW: report},
                    )
                    loaded = _leading_true(mask)
            except Exception:
                logger.exception("LMCache retrieve failed for %d tokens: recomputing", hit)
                self._count("retrieve_failures")
                loaded = 0
            finally:
                self.engine.lookup_unpin(req_id)
            if report.verified_end is not None:
                loaded = min(loaded, report.verified_end)
                by_start = {s: k for s, _, k in self._chunks(tokens[:hit])}
                for start in report.bad_chunk_starts:
                    if start in by_start:
                        self._drop_chunk(by_start[start])
            self._account_loaded(mapping, loaded)
            loaded = min(loaded, n)
            self._count("lookup_requests")
            if loaded:
                self._count("lookup_hit_tokens", loaded)
            else:
                self._count("lookup_miss_requests")
            return loaded

    def _check_disk_lengths(
        self, tokens: list[int], mapping: Mapping[str, list[CacheEngineKey]]
    ) -> int:
        """Hit length after dropping the first disk chunk whose file has the wrong size."""
        on_disk = set(mapping.get(tiers.BACKEND_OF_TIER[tiers.LOCAL_DISK], ()))
        for start, _, key in self._chunks(tokens) if on_disk else ():
            if key in on_disk and not disk_length_ok(self._storage, key):
                self._drop_chunk(key)
                return start
        return len(tokens)

    def _account_loaded(self, mapping: Mapping[str, list[CacheEngineKey]], loaded: int) -> None:
        pos = 0
        for backend, keys in mapping.items():
            tier = tiers.tier_of_backend(backend, self.tiers)
            for _ in keys:
                end = min(pos + self.chunk_size, loaded)
                if end <= pos:
                    return
                self._count(f"loaded_bytes.{tier}", (end - pos) * self._payload_bytes_per_token)
                pos = end

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
            self._refresh_health()
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

    def metrics(self) -> dict[str, float]:
        out = dict(self._metrics)
        h = self._remote_health
        if h is not None:
            out[f"tier_up.{h.tier}"] = 1.0 if h.up else 0.0
            errors = float(h.errors)
            backend = self._storage.storage_backends.get(tiers.REMOTE_BACKEND)
            if backend is not None:
                errors += backend.get_blocking_failed_count + backend.put_failed_count
            out[f"tier_errors.{h.tier}"] = errors
        return out

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait (bounded) until LMCache's asynchronous disk and remote writes are done."""
        deadline = time.monotonic() + timeout_s
        if not flush_pending(self._storage, timeout_s):
            return False
        remote = self._storage.storage_backends.get(tiers.REMOTE_BACKEND)
        while True:
            with self._lock:
                keys = self._unconfirmed_remote
                if not keys or remote is None or not self._remote_up():
                    keys.clear()
                    return True
                seen = remote.batched_contains(list(keys))
                del keys[:seen]
                if not keys:
                    return True
            if time.monotonic() >= deadline:
                logger.warning("%d chunk writes to the remote tier not visible yet", len(keys))
                with self._lock:
                    keys.clear()  # lost or evicted remotely; the next flush starts afresh
                return False
            time.sleep(0.02)

    def close(self, deadline_s: float) -> None:
        """Flush pending disk/remote writes, deregister, close LMCache, within ``deadline_s``.

        The work runs in a daemon thread; if LMCache hangs (it can with a Redis tier), close
        gives up at the deadline, logs it and sets ``closed_cleanly = False``. LMCache's
        non-daemon threads may then keep the interpreter alive: the process must exit with
        ``os._exit``.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        t0 = time.monotonic()
        done = threading.Event()

        def _run() -> None:
            try:
                flush_pending(self._storage, max(0.0, deadline_s * 0.5))
                close_redis(self._storage)
                deregister_first(self.engine, min(1.0, deadline_s * 0.2))
                LMCacheEngineBuilder.destroy(self.instance_id)
            except Exception:
                logger.exception("closing LMCache engine %s failed", self.instance_id)
            finally:
                done.set()

        threading.Thread(target=_run, name=f"kvpool-close-{self.instance_id}", daemon=True).start()
        self.closed_cleanly = done.wait(max(0.0, deadline_s - (time.monotonic() - t0)))
        if not self.closed_cleanly:
            logger.warning(
                "LMCache engine %s did not close within %.1fs: giving up on it",
                self.instance_id,
                deadline_s,
            )
