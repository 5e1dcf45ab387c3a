"""The decode side of PD: the receiver's buffer, its usage, and the transfers nobody claims.

Why this module exists: LMCache 0.5.6's PD receiver (``PDBackendAsync``, its default
``pd_backend_mode: async``, or ``PDBackend`` with ``sync``; both stored as the storage
manager's ``"PDBackend"``) allocates pages of its paged buffer when a sender asks, keeps each
chunk's memory object in ``.data`` under its chunk key, and frees it only when the decoder
retrieves that chunk (``remove_after_retrieve``). A transfer nobody retrieves (a prefill-only
answer, a client gone, a proxy restarted between prefill and decode) stays; once the buffer is
full the receiver's allocation waits forever (``pd_allocation_timeout_sec`` is infinite by
default), the sender's allocations for that decoder queue behind it, and no transfer to it
completes any more. This module frees:

- what stays unclaimed longer than a TTL: :class:`UnclaimedTracker` decides (pure),
  :class:`ReceiverBuffer` frees on its own daemon thread, holding the offload's lock, which
  the decoder holds while it looks up and retrieves, so a chunk being retrieved is never
  freed under it;
- a transfer the proxy says it will not claim (:meth:`ReceiverBuffer.release`), one
  reference per chunk, as a retrieve would.

Both drop references the way LMCache's own retrieve does (the backend's ``remove``, plus the
caller's ``ref_count_down`` for the sync backend, as ``LMCacheEngine.retrieve`` does), so the
async backend also wakes the allocations waiting for a free page.

A chunk sent twice (two prompts with a common prefix) is one memory object whose reference
count LMCache raised for the second transfer: the tracker restarts its clock whenever that
count grows, a release drops one reference like a retrieve, and the TTL drops them all. A
request id released twice (a retried call) is released once: a second drop would take the
other transfer's reference.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from lmcache.v1.storage_backend.pd_backend import PDBackend

from kvpool.protocol.domain import split_instance_id

logger = logging.getLogger(__name__)

PD_BACKEND = "PDBackend"
RELEASED_IDS = 65_536  # request ids remembered, so a repeated release is a no-op
K = TypeVar("K", bound=Hashable)


@dataclass
class _Seen:
    page: int  # the buffer page holding the chunk (a new page: a new transfer)
    refs: int  # LMCache's reference count: one per transfer not yet retrieved
    since: float


class UnclaimedTracker(Generic[K]):
    """Which chunks of a receiver's buffer have waited ``ttl_s`` without being claimed.

    Fed the buffer's content at each scan; a chunk's clock starts when it is first seen (or
    sits on a new page) and restarts when its reference count grows (another transfer of it).
    Pure: the caller passes the time.
    """

    def __init__(self, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.ttl_s = ttl_s
        self._seen: dict[K, _Seen] = {}

    def __len__(self) -> int:
        return len(self._seen)

    def observe(self, held: Mapping[K, tuple[int, int]], now: float) -> list[K]:
        """``held``: every chunk in the buffer now, as (page, references). Returns the chunks
        whose clock started ``ttl_s`` or more before ``now``."""
        for key in [k for k in self._seen if k not in held]:
            del self._seen[key]  # retrieved or released since the last scan
        expired: list[K] = []
        for key, (page, refs) in held.items():
            seen = self._seen.get(key)
            if seen is None or seen.page != page or refs > seen.refs:
                self._seen[key] = _Seen(page, refs, now)
                continue
            seen.refs = refs  # fewer: one transfer of it was claimed; the rest keep the clock
            if now - seen.since >= self.ttl_s:
                expired.append(key)
        return expired

    def forget(self, key: K) -> None:
        self._seen.pop(key, None)


def scan_interval_s(ttl_s: float) -> float:
    """A quarter of the TTL, within [0.05 s, 1 s]: a chunk is freed at most this late."""
    return min(1.0, max(0.05, ttl_s / 4))


class ReceiverBuffer:
    """A PD receiver's buffer (LMCache's ``PDBackend``): usage, the TTL reaper, releases.

    ``lock`` is the offload's lock (held by the decoder's lookups and retrieves). Counters are
    engine metrics (chunks and bytes freed by the TTL, released by the proxy).
    """

    def __init__(
        self,
        backend: Any,
        ttl_s: float,
        instance_id: str,
        lock: threading.RLock,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backend = backend
        self.tracker: UnclaimedTracker[Any] = UnclaimedTracker(ttl_s)
        self.instance = split_instance_id(instance_id)[0]
        self._lock = lock
        self._clock = clock
        allocators = backend.memory_allocator
        on_cpu = backend.corrected_device == "cpu"
        self._pages = allocators.cpu_allocator if on_cpu else allocators.gpu_allocator
        # LMCache's sync PDBackend.remove leaves the reference to its caller (cache_engine.py)
        self._caller_drops_ref = isinstance(backend, PDBackend)
        self.counters: dict[str, float] = {
            "pd_unclaimed_freed_total": 0.0,
            "pd_unclaimed_freed_bytes_total": 0.0,
            "pd_released_total": 0.0,
            "pd_released_bytes_total": 0.0,
        }
        self._released: OrderedDict[str, None] = OrderedDict()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def of(
        cls, storage: Any, ttl_s: float | None, instance_id: str, lock: threading.RLock
    ) -> ReceiverBuffer | None:
        """The receiver buffer of ``storage`` with its reaper running; None without a TTL
        (not a receiver) or without LMCache's PD backend."""
        backend = storage.storage_backends.get(PD_BACKEND)
        if ttl_s is None or backend is None:
            return None
        buffer = cls(backend, ttl_s, instance_id, lock)
        buffer.start()
        return buffer

    # --- the reaper thread -------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name=f"kvpool-pd-reaper-{self.instance}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        interval = scan_interval_s(self.tracker.ttl_s)
        while not self._stop.wait(interval):
            try:
                self.reap()
            except Exception:
                logger.exception("PD buffer scan of %s failed", self.instance)

    def stop(self) -> None:
        self._stop.set()

    # --- what the buffer holds -----------------------------------------------------------------
    def usage(self) -> dict[str, float]:
        """Bytes of the buffer in use (pages not on the allocator's free list), its capacity,
        and the chunks LMCache holds for decodes."""
        pages = self._pages
        capacity = int(pages.buffer_size)
        free = len(pages.free_blocks) * int(pages.align_bytes)
        with self.backend.data_lock:
            chunks = len(self.backend.data)
        return {
            "pd_buffer_capacity_bytes": float(capacity),
            "pd_buffer_used_bytes": float(capacity - free),
            "pd_buffer_chunks": float(chunks),
        }

    def metrics(self) -> dict[str, float]:
        return {
            **self.counters,
            **self.usage(),
            "pd_unclaimed_ttl_seconds": self.tracker.ttl_s,
        }

    # --- freeing ---------------------------------------------------------------------------------
    def _drop_ref(self, key: Any, obj: Any) -> int:
        """Drop one reference of ``key`` as a retrieve would; the bytes returned to the buffer
        (its page's, when that was the last reference). Caller holds the offload's lock."""
        if self.backend.data.get(key) is not obj:
            return 0  # gone since it was seen (the alloc loop rolled it back)
        self.backend.remove(key)
        if self._caller_drops_ref:
            obj.ref_count_down()
        if obj.get_ref_count() > 0:
            return 0
        self.tracker.forget(key)
        return int(obj.get_physical_size())

    def reap(self, now: float | None = None) -> tuple[int, int]:
        """Free every chunk unclaimed for the TTL; (chunks, bytes) freed."""
        now = self._clock() if now is None else now
        chunks = freed = 0
        with self._lock:  # never under a lookup or a retrieve
            with self.backend.data_lock:
                objs = dict(self.backend.data)
            held = {k: (int(o.meta.address), int(o.get_ref_count())) for k, o in objs.items()}
            for key in self.tracker.observe(held, now):
                obj = objs[key]
                for _ in range(max(held[key][1], 1)):  # every transfer of it
                    freed += self._drop_ref(key, obj)
                chunks += 1
        if chunks:
            self.counters["pd_unclaimed_freed_total"] += chunks
            self.counters["pd_unclaimed_freed_bytes_total"] += freed
            self._log("pd_unclaimed_freed", chunks, freed, ttl_s=self.tracker.ttl_s)
        return chunks, freed

    def release(self, keys: Iterable[Any], req_id: str | None = None) -> tuple[int, int]:
        """Drop one transfer of each chunk in ``keys`` (the proxy will not decode it), as a
        retrieve would; (chunks released, bytes returned to the buffer). Once per ``req_id``."""
        chunks = freed = 0
        with self._lock:
            if req_id is not None:
                if req_id in self._released:
                    return 0, 0
                self._released[req_id] = None
                while len(self._released) > RELEASED_IDS:
                    self._released.popitem(last=False)
            for key in keys:
                obj = self.backend.data.get(key)
                if obj is None:
                    continue  # claimed, freed already, or never sent
                freed += self._drop_ref(key, obj)
                chunks += 1
        self.counters["pd_released_total"] += chunks
        self.counters["pd_released_bytes_total"] += freed
        self._log("pd_released", chunks, freed, req_id=req_id)
        return chunks, freed

    def _log(self, event: str, chunks: int, freed: int, **fields: object) -> None:
        used = self.usage()["pd_buffer_used_bytes"]
        extra = {"event": event, "instance": self.instance, "chunks": chunks, "bytes": freed,
                 "buffer_used_bytes": int(used), **fields}  # fmt: skip
        logger.info(" ".join(f"{k}={v}" for k, v in extra.items()), extra=extra)
