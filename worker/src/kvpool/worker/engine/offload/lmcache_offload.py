"""``LMCacheOffload``: the reference engine's KV offload over the real LMCache 0.5.6 engine.

Why this module exists: it implements :class:`kvpool.worker.offload_api.KVOffload` with
LMCache's own engine (``LMCacheEngineBuilder``, ``store``/``lookup``/``retrieve``), its storage
backends (local CPU, local disk, Redis, Mooncake — configured only through the LMCache YAML)
and its controller client (``enable_controller``). kvpool adds what LMCache lacks on a CPU box:
the paged connector (:mod:`.connector`), an integrity guard so a corrupted chunk from disk or a
remote tier is a miss (:mod:`.guard`), remote-tier bypass while the tier is down
(:mod:`.tiers`), per-tier metrics, and a close that returns within its deadline
(:mod:`.shutdown`).
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.metadata import LMCacheMetadata

from kvpool.worker.engine.offload import p2p_guard, pd, pd_sender, tiers
from kvpool.worker.engine.offload.async_lookup import AsyncLookups
from kvpool.worker.engine.offload.config import (
    OffloadConfigError,
    kv_dtype,
    load_config,
    refuse_unsupported,
)
from kvpool.worker.engine.offload.connector import (
    TOKENS_KW,
    CPUPagedConnector,
    RetrieveReport,
)
from kvpool.worker.engine.offload.memory_ops import MemoryOps
from kvpool.worker.engine.offload.pd_buffer import ReceiverBuffer
from kvpool.worker.engine.offload.pd_keep import LOCAL_CPU_BACKEND, ReceiverKeep
from kvpool.worker.engine.offload.prefetch import PrefetchOps
from kvpool.worker.engine.offload.registration import RegistrationCheck
from kvpool.worker.engine.offload.shutdown import ShutdownOps
from kvpool.worker.engine.offload.storage_ops import (
    disk_length_ok,
    pin_controller_requests,
    remote_remove,
)
from kvpool.worker.engine_api import KVTransferParams

logger = logging.getLogger(__name__)

_MAX_UNCONFIRMED = 4096  # remote writes flush() waits for (the most recent ones)


def _no_broadcast(tensor: torch.Tensor, src: int) -> None:
    return None


def _no_broadcast_object(obj: Any, src: int) -> Any:
    return obj


class LMCacheOffload(MemoryOps, PrefetchOps, ShutdownOps):
    """KV offload of one engine (one TP rank) through one LMCache engine instance.

    With ``enable_async_loading`` (required for P2P: LMCache's peer backend answers only
    asynchronously) the engine's scheduler starts a lookup per request (``start_lookup``),
    schedules it once ``lookup_result`` is not None and retrieves with ``lookup_id``; the
    blocking ``retrieve`` without a lookup id does the same in one call.
    """

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
        refuse_unsupported(cfg, (num_layers, num_kv_heads, head_dim, block_size))
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
        self.pd_role = pd.pd_role(cfg)
        # vLLM's skip_last_n_tokens for a PD decoder: its prompt ends with the prefill's token.
        self.skip_last_n_tokens = 1 if self.pd_role == "receiver" else 0
        pd_ttl_s = pd.unclaimed_ttl_s(cfg)  # before LMCache starts: a bad value is refused
        self.async_lookups: AsyncLookups | None = (
            AsyncLookups(cfg.lookup_timeout_ms / 1000.0, release=self._release_prefetch)
            if cfg.enable_async_loading
            else None
        )
        self.connector = CPUPagedConnector(
            num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=self.dtype
        )
        self._payload_bytes_per_token = (
            2 * num_layers * num_kv_heads * head_dim * self.connector.dtype.itemsize
        )
        # bytes LMCache holds per full chunk: payload and guard (the PD store's group size)
        self._chunk_bytes = self.connector.get_shape(self.chunk_size).numel() * self.dtype.itemsize
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
        self.engine: LMCacheEngine = self._start_engine(cfg, world_size, worker_id)
        assert self.engine.storage_manager is not None
        self._storage = self.engine.storage_manager
        self._attach(cfg, pd_ttl_s)
        logger.info(
            "LMCache offload %s ready: tiers %s, chunk %d tokens, %d bytes/token",
            self.instance_id,
            self.tiers,
            self.chunk_size,
            self._payload_bytes_per_token,
        )

    def _start_engine(
        self, cfg: LMCacheEngineConfig, world_size: int, worker_id: int
    ) -> LMCacheEngine:
        """LMCache's engine for this instance, started (its lookup server is ours); a failure
        destroys what it built and is raised as an ``OffloadConfigError``."""
        metadata = LMCacheMetadata(
            model_name=self.model_name,
            world_size=world_size,
            local_world_size=world_size,
            worker_id=worker_id,
            local_worker_id=worker_id,
            kv_dtype=self.dtype,
            # LMCache sizes chunks as [2, L, T, kv_shape[3] * kv_shape[4]]: one "head" whose
            # width is the payload plus kvpool's guard.
            kv_shape=(self.num_layers, 2, self.chunk_size, 1, self.connector.row_width),
            chunk_size=self.chunk_size,
        )
        try:
            engine = LMCacheEngineBuilder.get_or_create(
                self.instance_id,
                cfg,
                metadata,
                self.connector,
                _no_broadcast,
                _no_broadcast_object,
            )
            engine.post_init(async_lookup_server=self.async_lookups)
            pin_controller_requests(engine)
        except Exception as e:
            LMCacheEngineBuilder.destroy(self.instance_id)
            raise OffloadConfigError(f"LMCache engine {self.instance_id!r} failed: {e}") from e
        return engine

    def _attach(self, cfg: LMCacheEngineConfig, pd_ttl_s: float | None) -> None:
        """What kvpool adds to the started engine's backends, and its own watchers."""
        # A PD receiver frees transfers nobody claims (LMCache frees only on retrieve).
        self._pd_buffer = ReceiverBuffer.of(self._storage, pd_ttl_s, self.instance_id, self._lock)
        # A PD sender's transfers end in bounded time and find a restarted decoder again.
        self._pd_sender = pd_sender.install(self._storage) if self.pd_role == "sender" else None
        # A PD receiver with a CPU tier keeps its finished requests there (the gateway's bypass).
        self._pd_keep = ReceiverKeep.of(self.engine, cfg, self.connector)
        # A dead or frozen P2P peer delays one lookup, not every lookup while it is gone.
        self._p2p = p2p_guard.install(self._storage, cfg.lookup_timeout_ms / 1000.0)
        self._registration = (
            RegistrationCheck(self.engine, str(cfg.controller_reply_url), self.instance_id)
            if cfg.enable_controller and cfg.controller_reply_url
            else None
        )
        self._prober = (
            tiers.HealthProber(self._remote_health, self._on_remote_health)
            if self._remote_health is not None
            else None
        )

    @property
    def lmcache_frozen(self) -> bool:
        """LMCache is in its full-sync freeze: every store is dropped until it ends."""
        return bool(self.engine.is_frozen())

    @property
    def controller_refusal(self) -> str | None:
        """Why the controller refused this worker's registration (None: accepted or no
        controller); the worker is then not ready."""
        return None if self._registration is None else self._registration.refusal

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

    def _on_remote_health(self, up: bool) -> None:
        """Called from the prober's thread when the remote tier goes down or comes back."""
        self._storage.set_backend_bypass(tiers.REMOTE_BACKEND, not up)
        if not up and self._remote_health is not None:
            self._count(f"tier_down_events.{self._remote_health.tier}")

    def _drop_chunk(self, key: CacheEngineKey) -> None:
        """Remove a chunk that failed verification from every tier (local and remote)."""
        self._count("corrupt_chunks")
        self._storage.remove(key, list(tiers.BACKEND_OF_TIER.values()))
        remote_remove(self._storage, key)

    # --- KVOffload -------------------------------------------------------------------------
    def lookup(self, token_ids: Sequence[int]) -> int:
        with self._lock:
            if not token_ids:
                return 0
            return int(self.engine.lookup(list(token_ids)))

    def store(
        self,
        token_ids: Sequence[int],
        kv_caches: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor,
        *,
        kv_transfer: KVTransferParams | None = None,
    ) -> None:
        """Store into the tiers; a PD sender hands the KV to ``kv_transfer``'s receiver
        instead (and stores nothing without it); a PD receiver stores only with a CPU tier,
        there (``pd_keep``; vLLM's kv_consumer does not save)."""
        tokens = list(token_ids)
        n = len(tokens)
        if n == 0 or (self.pd_role == "receiver" and self._pd_keep is None):
            return
        if self.pd_role == "sender" and kv_transfer is None:
            return
        self._check_caches(kv_caches, slot_mapping)
        if slot_mapping.numel() < n:
            raise ValueError(f"slot_mapping has {slot_mapping.numel()} slots for {n} tokens")
        with self._lock:
            storable = n if self.config.save_unfull_chunk else n - n % self.chunk_size
            extra: dict[str, Any] = {TOKENS_KW: tokens}
            groups = [(0, n)]
            if self._pd_keep is not None:
                self._keep(tokens[:storable], kv_caches, slot_mapping[:n].to(torch.long))
                return
            if kv_transfer is not None:
                done = 0  # the receiver has nothing yet: send the whole prompt
                extra["req_id"] = kv_transfer.req_id
                groups = pd.store_groups(storable, self.chunk_size, self._chunk_bytes)
            else:
                done = int(self.engine.lookup(tokens))
                done -= done % self.chunk_size
            if storable <= done:
                return
            if self.engine.is_frozen():
                # LMCache's engine drops every store while a full sync to the controller runs
                # (its freeze mode, after a controller restart): count it, never as bytes stored
                self._count("store_skipped_frozen_tokens", storable - done)
                logger.info(
                    "store of %d tokens skipped: LMCache is frozen for a full sync to the "
                    "controller (the prompt is recomputed if it comes back before it ends)",
                    storable - done,
                )
                return
            slots = slot_mapping[:n].to(torch.long)
            total_chunks = -(-storable // self.chunk_size)
            with pd_sender.tracking(self._pd_sender, kv_transfer, total_chunks):
                for start, end in groups:  # a PD prompt in groups (pd.store_groups), else one
                    if kv_transfer is not None:
                        extra["transfer_spec"] = pd.transfer_spec(
                            kv_transfer, total_chunks, last=end == groups[-1][1]
                        )
                    mask = torch.ones(end, dtype=torch.bool)
                    mask[: max(start, done)] = False
                    self.engine.store(
                        tokens[:end],
                        mask=mask,
                        kvcaches=list(kv_caches),
                        slot_mapping=slots[:end],
                        **extra,
                    )
            if kv_transfer is not None:
                self._count("pd_sent_bytes", (storable - done) * self._payload_bytes_per_token)
                self._count("pd_sent_requests")
                return
            nbytes = (storable - done) * self._payload_bytes_per_token
            if self._remote_health is not None and self._remote_up():
                self._unconfirmed_remote.extend(
                    k for s, _, k in self._chunks(tokens[:storable]) if s >= done
                )
                del self._unconfirmed_remote[:-_MAX_UNCONFIRMED]  # bounded: flush may never come
            for tier in self.tiers:
                if tier in tiers.BACKEND_OF_TIER or self._remote_up():
                    self._count(f"stored_bytes.{tier}", nbytes)

    def _keep(
        self, tokens: list[int], kv_caches: Sequence[torch.Tensor], slots: torch.Tensor
    ) -> None:
        """PD receiver with a CPU tier: keep the whole chunks of ``tokens`` there."""
        assert self._pd_keep is not None
        if self.engine.is_frozen():  # LMCache's own stores are dropped too (see store)
            self._count("store_skipped_frozen_tokens", len(tokens))
            return
        kept = self._pd_keep.store(self._chunks(tokens), tokens, kv_caches, slots)
        if kept:
            self._count(f"stored_bytes.{tiers.LOCAL_CPU}", kept * self._payload_bytes_per_token)
            self._count("pd_kept_tokens", kept)

    def _remote_up(self) -> bool:
        return self._remote_health is None or self._remote_health.up

    def retrieve(
        self,
        token_ids: Sequence[int],
        num_tokens: int,
        kv_caches: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor,
        *,
        lookup_id: str | None = None,
    ) -> int:
        """Load the hit into the paged caches. With async loading, ``lookup_id`` names a
        lookup started with ``start_lookup`` and answered; without it a lookup is started
        and waited for here."""
        tokens = list(token_ids)
        n = min(num_tokens, len(tokens))
        if n <= 0:
            if lookup_id is not None:
                self.cancel_lookup(lookup_id)
            return 0
        self._check_caches(kv_caches, slot_mapping)
        if slot_mapping.numel() < n:
            raise ValueError(f"slot_mapping has {slot_mapping.numel()} slots for {n} tokens")
        # Whole stored chunks cover the first n tokens; slots past n are -1 (not written).
        span = min(len(tokens), -(-n // self.chunk_size) * self.chunk_size)
        slots = torch.full((span,), -1, dtype=torch.long)
        slots[:n] = slot_mapping[:n].to(torch.long)
        if self.async_lookups is not None:
            if lookup_id is None:
                lookup_id = self.start_lookup(tokens[:span])
                hit = self.async_lookups.wait(lookup_id)
            else:
                hit = self.lookup_result(lookup_id) or 0
            return self._retrieve_prefetched(tokens, min(hit, span), n, kv_caches, slots, lookup_id)
        req_id = f"kvpool-{uuid.uuid4().hex}"
        with self._lock:
            hit = int(self.engine.lookup(tokens[:span], lookup_id=req_id, pin=True))
            mapping = {loc: list(keys) for loc, keys in self.engine.lookup_pins[req_id].items()}
            hit = self._check_disk_lengths(tokens[:hit], mapping)
            # LMCache maps the prefix to tiers in backend order (a PD decoder's buffer first,
            # then local CPU): local CPU chunks were sealed here or verified on their way in.
            report = RetrieveReport(trusted_starts=self._local_starts(mapping))
            try:
                got = (
                    self._engine_retrieve(tokens[:hit], kv_caches, slots, req_id, report)
                    if hit > 0
                    else 0
                )
                loaded = got or 0
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

    def _local_starts(self, mapping: Mapping[str, list[CacheEngineKey]]) -> set[int]:
        """The token starts of the chunks ``mapping`` (backend -> keys, in prefix order) serves
        from local CPU."""
        pos, out = 0, set[int]()
        for backend, keys in mapping.items():
            if backend == LOCAL_CPU_BACKEND:
                out.update(range(pos, pos + len(keys) * self.chunk_size, self.chunk_size))
            pos += len(keys) * self.chunk_size
        return out

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

    def release_transfer(self, token_ids: Sequence[int], req_id: str | None = None) -> int:
        """PD receiver: free the transfer of the prompt ``token_ids`` that no decode will
        claim (one reference per chunk, as a retrieve would); the chunks released."""
        if self._pd_buffer is None:
            raise OffloadConfigError("this instance is not a PD receiver (pd_role: receiver)")
        keys = [k for _, _, k in self._chunks(token_ids)]
        return self._pd_buffer.release(keys, req_id)[0]

    async def pd_transfer_result(self, req_id: str) -> str | None:
        """PD sender: None once the decoder has the KV of ``req_id`` (or nothing was sent for
        it), else why not (the transfer failed, or no outcome in ``RESULT_TIMEOUT_S``)."""
        sender = self._pd_sender
        return None if sender is None else await sender.result(req_id, pd_sender.RESULT_TIMEOUT_S)

    def metrics(self) -> dict[str, float]:
        out = dict(self._metrics)
        if self._pd_buffer is not None:
            out.update(self._pd_buffer.metrics())
        if self._pd_sender is not None:
            out.update(self._pd_sender.counters)
        if self._p2p is not None:
            out.update(self._p2p.counters, p2p_held_buffers=float(self._p2p.held_buffers))
        out["lmcache_frozen"] = 1.0 if self.engine.is_frozen() else 0.0
        if self.async_lookups is not None:
            out["pending_prefetches"] = float(self.pending_prefetches())
        h = self._remote_health
        if h is not None:
            out[f"tier_up.{h.tier}"] = 1.0 if h.up else 0.0
            errors = float(h.errors)
            backend = self._storage.storage_backends.get(tiers.REMOTE_BACKEND)
            if backend is not None:
                errors += backend.get_blocking_failed_count + backend.put_failed_count
            out[f"tier_errors.{h.tier}"] = errors
        return out
