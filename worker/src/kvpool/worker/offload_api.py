"""The contract between the reference engine's scheduler and its KV offload (LMCache).

Why this module exists: the engine core (model math, paged KV, block manager, scheduler) and
the LMCache integration (CPU paged connector, LMCache engine, tiers, controller registration)
are built and tested separately. The engine only ever calls these methods, from its compute
thread, with its own paged caches: per layer a tensor in the vLLM flash NHD layout
``[2, num_blocks, block_size, num_kv_heads, head_dim]`` and a slot mapping (int64,
``block_id * block_size + offset``) with one slot per token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch

from kvpool.worker.engine_api import KVTransferParams


class KVOffload(Protocol):
    chunk_size: int

    def lookup(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of ``token_ids`` the cache can supply (any tier)."""
        ...

    def retrieve(
        self,
        token_ids: Sequence[int],
        num_tokens: int,
        kv_caches: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor,
    ) -> int:
        """Load the KV of ``token_ids[:num_tokens]`` into ``kv_caches`` at
        ``slot_mapping[:num_tokens]``. Returns the number of leading tokens actually loaded
        (0 on any failure). A corrupted or missing chunk is a miss, never wrong KV."""
        ...

    def store(
        self,
        token_ids: Sequence[int],
        kv_caches: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store the KV of ``token_ids`` (one slot per token) into the configured tiers."""
        ...

    def evict(
        self,
        *,
        token_ids: Sequence[int] | None = None,
        chunk_hashes: Sequence[int] | None = None,
        locations: Sequence[str] | None = None,
    ) -> int: ...

    def prefetch(self, token_ids: Sequence[int]) -> int: ...

    def pin(self, token_ids: Sequence[int]) -> int: ...

    def unpin(self, token_ids: Sequence[int]) -> int: ...

    def memory_stats(self) -> dict[str, object]: ...

    def metrics(self) -> dict[str, float]: ...

    def close(self, deadline_s: float) -> None:
        """Flush pending stores, deregister, close; return within ``deadline_s`` regardless."""
        ...


@runtime_checkable
class AsyncKVOffload(KVOffload, Protocol):
    """An offload whose prefix lookups answer asynchronously (LMCache with async loading,
    needed for P2P), and that can hand a prompt to a PD receiver. The scheduler starts a
    lookup when a request waits, admits the request once ``lookup_result`` is not None, and
    loads with ``retrieve(..., lookup_id=...)``; a request that goes away cancels it."""

    async_loading: bool  # False: lookups answer synchronously (the KVOffload path)
    skip_last_n_tokens: int

    def start_lookup(self, token_ids: Sequence[int], lookup_id: str | None = None) -> str: ...

    def lookup_result(self, lookup_id: str) -> int | None: ...

    def cancel_lookup(self, lookup_id: str) -> None: ...

    def set_lookup_listener(self, on_answer: Callable[[], None] | None) -> None: ...

    def retrieve(
        self,
        token_ids: Sequence[int],
        num_tokens: int,
        kv_caches: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor,
        *,
        lookup_id: str | None = None,
    ) -> int: ...

    def store(
        self,
        token_ids: Sequence[int],
        kv_caches: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor,
        *,
        kv_transfer: KVTransferParams | None = None,
    ) -> None: ...
