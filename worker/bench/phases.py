"""Wall time of named LMCache and kvpool calls inside one benchmark process.

Why this module exists: a P2P pull or a PD push is one number at the end (bytes over seconds),
but the issue asks where the time goes on both sides of the transfer: the controller lookup,
allocations, descriptor lists and the NIXL write, the notifications, kvpool's gather and seal.
``transfer_bench``'s role processes wrap the methods that bound those phases (bench-only
instrumentation: the product is never patched) and write the per-call milliseconds next to
their result, so the JSON says which phase grew when a ratio moves.
"""

from __future__ import annotations

import asyncio
import functools
import statistics
import time
from collections import defaultdict
from typing import Any


class Phases:
    """Milliseconds of every call of each wrapped method, by label."""

    def __init__(self) -> None:
        self.ms: dict[str, list[float]] = defaultdict(list)

    def wrap(self, owner: Any, name: str, label: str) -> None:
        """Time every call of ``owner.name`` (a class or a module attribute) as ``label``."""
        fn = getattr(owner, name)
        sink = self.ms[label]
        if asyncio.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def timed_async(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return await fn(*args, **kwargs)
                finally:
                    sink.append((time.perf_counter() - t0) * 1e3)

            setattr(owner, name, timed_async)
            return

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sink.append((time.perf_counter() - t0) * 1e3)

        setattr(owner, name, timed)

    def medians(self, skip: int = 0) -> dict[str, float]:
        """Median milliseconds per label, over the calls after the first ``skip`` (warm-up)."""
        return {k: statistics.median(v[skip:] or v) for k, v in self.ms.items() if v}


def p2p_requester(phases: Phases) -> None:
    """B, the puller: the controller's answer, then its allocation and the peer round trip
    (which includes all of A's work)."""
    from lmcache.v1.storage_backend.p2p_backend import P2PBackend

    phases.wrap(P2PBackend, "batched_async_contains", "controller_lookup")
    phases.wrap(P2PBackend, "batched_get_non_blocking", "alloc_and_peer_round_trip")


def p2p_holder(phases: Phases) -> None:
    """A, the holder: serving one pull, and the NIXL write inside it."""
    from lmcache.v1.storage_backend.p2p_backend import P2PBackend
    from lmcache.v1.transfer_channel.nixl_channel import NixlChannel

    phases.wrap(P2PBackend, "_handle_batched_lookup_and_get", "serve_pull")
    phases.wrap(NixlChannel, "async_batched_write", "nixl_write")
    phases.wrap(NixlChannel, "get_local_mem_indices", "descriptor_indexes")


def pd_sender(phases: Phases) -> None:
    """The prefill side: the store call (allocation, gather, seal, submit), the receiver's
    allocation round trip, the NIXL write and the proxy notification."""
    from lmcache.v1.cache_engine import LMCacheEngine
    from lmcache.v1.storage_backend.pd_backend_async import PDBackendAsync
    from lmcache.v1.transfer_channel.nixl_channel import NixlChannel

    from kvpool.worker.engine.offload.connector import CPUPagedConnector

    phases.wrap(LMCacheEngine, "store", "store_call")
    phases.wrap(PDBackendAsync, "allocate", "local_alloc_per_chunk")
    phases.wrap(CPUPagedConnector, "batched_from_gpu", "gather_and_seal")
    phases.wrap(PDBackendAsync, "_async_remote_allocate", "remote_alloc_round_trip")
    phases.wrap(NixlChannel, "async_batched_write", "nixl_write")
    phases.wrap(PDBackendAsync, "_send_proxy_notif", "proxy_notif")


def pd_receiver(phases: Phases) -> None:
    """The decode side: allocating the pages the sender asked for."""
    from lmcache.v1.storage_backend.pd_backend_async import PDBackendAsync

    phases.wrap(PDBackendAsync, "_handle_alloc_request", "alloc_request")
