"""The end of an ``LMCacheOffload``: flush LMCache's pending writes, then close within a deadline.

Why this module exists: LMCache writes to disk and to the remote tier asynchronously, and its
shutdown can hang (with a Redis tier it does). ``flush`` waits, bounded, until those writes are
done and visible remotely; ``close`` stops kvpool's watchers, flushes, deregisters from the
controller and destroys the engine in a daemon thread that it gives up on at the deadline.
Apart from the store and retrieve path in :mod:`.lmcache_offload`, as a mixin like
:mod:`.memory_ops` and :mod:`.prefetch`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from lmcache.utils import CacheEngineKey
from lmcache.v1.cache_engine import LMCacheEngineBuilder

from kvpool.worker.engine.offload import tiers
from kvpool.worker.engine.offload.pd_buffer import ReceiverBuffer
from kvpool.worker.engine.offload.pd_sender import SenderGuard
from kvpool.worker.engine.offload.storage_ops import (
    close_nixl_side_channels,
    close_pd_sender_sockets,
    close_redis,
    deregister_first,
    flush_pending,
)

logger = logging.getLogger(__name__)


class ShutdownOps:
    """Mixin over the attributes ``LMCacheOffload`` sets up."""

    engine: Any
    instance_id: str
    closed_cleanly: bool | None
    _storage: Any
    _lock: threading.RLock
    _closed: bool
    _unconfirmed_remote: list[CacheEngineKey]
    _prober: tiers.HealthProber | None
    _pd_buffer: ReceiverBuffer | None
    _pd_sender: SenderGuard | None
    _remote_up: Callable[[], bool]

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
                if self._prober is not None:
                    self._prober.stop()
                if self._pd_buffer is not None:
                    self._pd_buffer.stop()
                flush_pending(self._storage, max(0.0, deadline_s * 0.5))
                close_redis(self._storage)
                deregister_first(self.engine, min(1.0, deadline_s * 0.2))
                close_nixl_side_channels(self._storage)
                if self._pd_sender is not None:
                    self._pd_sender.close()
                close_pd_sender_sockets(self._storage)
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
