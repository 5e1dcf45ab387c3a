"""A PD decoder with a CPU tier keeps its finished requests' KV there (for the gateway's bypass).

Why this module exists: LMCache 0.5.6's PD receiver stores nothing (vLLM's ``kv_consumer``
does not save), so no decoder ever holds a prompt and the gateway could never send the next
turn of a conversation straight to it. With ``local_cpu: true`` LMCache builds a
``LocalCPUBackend`` beside the ``PDBackend`` (``storage_backend.CreateStorageBackends``), but
the storage manager allocates every store from the PD buffer (``_get_allocator_backend``) and
``batched_put`` hands the chunks to every backend, the PD receiver included. This module
therefore stores around the storage manager: it allocates from the CPU backend itself (as
``p2p_guard`` does for peer reads), gathers and seals the chunks with kvpool's connector and
puts them into that backend only. LocalCPUBackend reports each admitted chunk to the
controller (``batched_msg_sender``, when the decoder registers), so the index knows what the
decoder holds; a plain request to the decoder then finds the chunks through LMCache's own
lookup and retrieve (backend order: the PD buffer, then the CPU tier) and prefills only the
rest. Whole chunks only: the controller indexes whole chunks, and a partial chunk's key would
not match the next turn's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig

from kvpool.worker.engine.offload.connector import TOKENS_KW, CPUPagedConnector
from kvpool.worker.engine.offload.tiers import BACKEND_OF_TIER, LOCAL_CPU

logger = logging.getLogger(__name__)

LOCAL_CPU_BACKEND = BACKEND_OF_TIER[LOCAL_CPU]


class ReceiverKeep:
    """Stores a PD receiver's finished requests into its ``LocalCPUBackend`` (whole chunks)."""

    def __init__(self, engine: Any, backend: Any, connector: CPUPagedConnector) -> None:
        self.engine = engine
        self.backend = backend
        self.connector = connector
        self.chunk_size = int(engine.config.chunk_size)

    @classmethod
    def of(
        cls, engine: Any, config: LMCacheEngineConfig, connector: CPUPagedConnector
    ) -> ReceiverKeep | None:
        """The keeper of a PD receiver configured with a CPU tier (``local_cpu: true`` and a
        ``max_local_cpu_size`` above 0), else None (it stores nothing, as before)."""
        if not (config.enable_pd and config.pd_role == "receiver" and config.local_cpu):
            return None
        backend = engine.storage_manager.storage_backends.get(LOCAL_CPU_BACKEND)
        return None if backend is None else cls(engine, backend, connector)

    def held_chunks(self, keys: Sequence[CacheEngineKey]) -> int:
        """How many of ``keys``, from the first, the CPU tier holds."""
        return int(self.backend.batched_contains(list(keys), False)) if keys else 0

    def store(
        self,
        chunks: Sequence[tuple[int, int, CacheEngineKey]],
        tokens: Sequence[int],
        kv_caches: Sequence[torch.Tensor],
        slots: torch.Tensor,
    ) -> int:
        """Put the whole ``chunks`` of ``tokens`` not held yet into the CPU tier; the tokens
        stored (fewer when the tier cannot allocate without evicting what it must keep)."""
        whole = [c for c in chunks if c[1] - c[0] == self.chunk_size]
        todo = whole[self.held_chunks([k for _, _, k in whole]) :]
        meta = self.engine.metadata
        objs: list[Any] = []
        for start, end, _ in todo:
            obj = self.backend.allocate(
                meta.get_shapes(end - start), meta.get_dtypes(), self.engine.fmt, busy_loop=False
            )
            if obj is None:  # full of pinned chunks: keep what fits
                break
            objs.append(obj)
        if not objs:
            return 0
        todo = todo[: len(objs)]
        try:
            self.connector.batched_from_gpu(
                objs,
                [s for s, _, _ in todo],
                [e for _, e, _ in todo],
                kvcaches=list(kv_caches),
                slot_mapping=slots,
                **{TOKENS_KW: list(tokens)},
            )
            self.backend.batched_submit_put_task([k for _, _, k in todo], objs)
        finally:
            for obj in objs:  # the backend took its own reference (LMCache's batched_put)
                obj.ref_count_down()
        return sum(e - s for s, e, _ in todo)
