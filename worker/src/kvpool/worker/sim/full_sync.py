"""A worker's full sync to the controller, with LMCache 0.5.6's freeze semantics.

Why this module exists: a restarted kvpool-controller (persistence ``full-sync``) knows nothing;
it answers the next heartbeat of each worker with a ``FullSyncCommand``, and each worker resends
every key of its CPU tier. While it does, LMCache freezes its engine: every store is dropped
(``store_skipped_frozen_tokens`` on the reference worker), so nothing the controller would have
to merge arrives mid-sync. A simulated worker must do the same, in the same order, with the
same knobs (``cache_controller/full_sync_sender.py``):

1. sleep ``uniform(0, full_sync_startup_delay_s)``; freeze;
2. keys = the LocalCPUBackend's chunk hashes, least recently used first (disk keys are never
   synced); ``batch_count = max(1, ceil(keys / full_sync_batch_size))``;
3. ``FullSyncStartMsg`` on the request socket, retried ``full_sync_max_retry_count`` times
   ``full_sync_retry_delay_s`` apart until accepted (else give up);
4. ``FullSyncBatchMsg`` per batch on PUSH, ``full_sync_batch_interval_ms`` apart (an empty sync
   still sends batch 0), then ``FullSyncEndMsg``;
5. up to ``full_sync_max_poll_attempts`` times: sleep ``full_sync_status_poll_interval_s``, then
   ``FullSyncStatusMsg``; stop when ``can_exit_freeze``; resend ``missing_batches`` (and a new
   End) at most ``full_sync_max_retry_count`` times;
6. unfreeze, whatever happened.
"""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from collections.abc import Awaitable, Callable

import msgspec

from kvpool.protocol import lmcache_wire as w
from kvpool.worker.sim.config import FullSyncParams

logger = logging.getLogger(__name__)

LOCATION = "LocalCPUBackend"

Request = Callable[[msgspec.Struct], Awaitable[object | None]]


class FullSync:
    """One worker's full-sync procedure; :meth:`run` is started by a ``FullSyncCommand``."""

    def __init__(
        self,
        params: FullSyncParams,
        instance_id: str,
        worker_id: int,
        *,
        request: Request,
        push: Callable[[msgspec.Struct], None],
        keys: Callable[[], list[int]],
        set_frozen: Callable[[bool], None],
        rng: random.Random | None = None,
    ) -> None:
        self.params = params
        self.instance_id = instance_id
        self.worker_id = worker_id
        self._request = request
        self._push = push
        self._keys = keys
        self._set_frozen = set_frozen
        self._rng = rng or random.Random()
        self.running = False
        self.counters = {"started": 0, "completed": 0, "failed": 0}

    def _batch(self, keys: list[int], sync_id: str, batch_id: int) -> w.FullSyncBatchMsg:
        size = self.params.batch_size
        return w.FullSyncBatchMsg(
            instance_id=self.instance_id,
            worker_id=self.worker_id,
            location=LOCATION,
            sync_id=sync_id,
            batch_id=batch_id,
            keys=keys[batch_id * size : (batch_id + 1) * size],
        )

    def _end(self, sync_id: str, total: int) -> w.FullSyncEndMsg:
        return w.FullSyncEndMsg(
            instance_id=self.instance_id,
            worker_id=self.worker_id,
            location=LOCATION,
            sync_id=sync_id,
            actual_total_keys=total,
        )

    async def run(self, reason: str | None) -> bool:
        """The whole sync; True when the controller let it exit the freeze."""
        if self.running:
            logger.warning("full sync already in progress, skipping (%s)", reason)
            return False
        self.running = True
        self.counters["started"] += 1
        p = self.params
        ok = False
        try:
            await asyncio.sleep(self._rng.uniform(0, p.startup_delay_s))
            logger.info("full sync of %s (%s): entering freeze mode", self.instance_id, reason)
            self._set_frozen(True)
            keys = self._keys()
            batch_count = max(1, -(-len(keys) // p.batch_size))
            sync_id = f"{self.instance_id}_{self.worker_id}_{uuid.uuid4().hex[:8]}"
            if not await self._start(sync_id, len(keys), batch_count):
                logger.error("full sync of %s: the controller never accepted it", self.instance_id)
                return False
            for batch_id in range(batch_count):
                self._push(self._batch(keys, sync_id, batch_id))
                if p.batch_interval_s > 0 and batch_id < batch_count - 1:
                    await asyncio.sleep(p.batch_interval_s)
            self._push(self._end(sync_id, len(keys)))
            ok = await self._poll(sync_id, keys)
            return ok
        except Exception:
            logger.exception("full sync of %s failed", self.instance_id)
            return False
        finally:
            self._set_frozen(False)
            self.running = False
            self.counters["completed" if ok else "failed"] += 1
            logger.info("full sync of %s: freeze mode exited", self.instance_id)

    async def _start(self, sync_id: str, total: int, batch_count: int) -> bool:
        msg = w.FullSyncStartMsg(
            instance_id=self.instance_id,
            worker_id=self.worker_id,
            location=LOCATION,
            sync_id=sync_id,
            total_keys=total,
            batch_count=batch_count,
        )
        for attempt in range(self.params.max_retry):
            reply = await self._request(msg)
            if isinstance(reply, w.FullSyncStartRetMsg) and reply.accepted:
                return True
            error = reply.error_msg if isinstance(reply, w.FullSyncStartRetMsg) else "no response"
            logger.warning(
                "FullSyncStart not accepted, attempt %d/%d: %s",
                attempt + 1,
                self.params.max_retry,
                error,
            )
            await asyncio.sleep(self.params.retry_delay_s)
        return False

    async def _poll(self, sync_id: str, keys: list[int]) -> bool:
        p = self.params
        resends = 0
        status_msg = w.FullSyncStatusMsg(
            instance_id=self.instance_id, worker_id=self.worker_id, sync_id=sync_id
        )
        for _ in range(p.max_polls):
            await asyncio.sleep(p.poll_interval_s)
            status = await self._request(status_msg)
            if not isinstance(status, w.FullSyncStatusRetMsg):
                continue
            if status.can_exit_freeze:
                return True
            if status.missing_batches and resends < p.max_retry:
                resends += 1
                for batch_id in status.missing_batches:
                    self._push(self._batch(keys, sync_id, batch_id))
                    if p.batch_interval_s > 0:
                        await asyncio.sleep(p.batch_interval_s)
                self._push(self._end(sync_id, len(keys)))
        logger.warning("full sync status poll timed out; exiting freeze mode anyway")
        return False
