r"""Full sync: a worker resends every key it holds, and the index takes exactly that set.

Why: after a controller restart without Redis (or a failed sync) the index knows nothing about
a worker's keys. LMCache's workers answer a ``FullSyncCommand`` (sent on a heartbeat reply) with
``FullSyncStartMsg`` → ``FullSyncBatchMsg``\ s → ``FullSyncEndMsg`` and poll
``FullSyncStatusMsg``. Keys are staged in the registry's session and replace the worker's
entries for that tier atomically at the end, so a half-finished sync never shows up in lookups
and stale keys from before it disappear. Incremental events during the sync are dropped (the
worker is frozen meanwhile, as LMCache's own controller assumes).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvpool.controller.registry import SyncState
from kvpool.protocol import lmcache_wire as p
from kvpool.protocol.deltas import DeltaOp

if TYPE_CHECKING:
    from kvpool.controller.service import ControllerService

logger = logging.getLogger(__name__)


def sync_start(svc: ControllerService, msg: p.FullSyncStartMsg) -> p.FullSyncStartRetMsg:
    record = svc.registry.get(msg.instance_id, msg.worker_id)
    if record is None:
        return p.FullSyncStartRetMsg(msg.sync_id, False, "worker not registered")
    error = svc.registry.start_sync(
        record, msg.location, msg.sync_id, msg.total_keys, msg.batch_count, svc.clock()
    )
    if error is not None:
        return p.FullSyncStartRetMsg(msg.sync_id, False, error)
    svc.metrics.full_syncs["started"] += 1
    logger.info(
        "full sync %s of %s/%s started: %d keys in %d batches",
        msg.sync_id,
        msg.instance_id,
        msg.worker_id,
        msg.total_keys,
        msg.batch_count,
    )
    return p.FullSyncStartRetMsg(msg.sync_id, True)


def sync_batch(svc: ControllerService, msg: p.FullSyncBatchMsg) -> None:
    record = svc.worker_for_event(msg.instance_id, msg.worker_id)
    if record is None:
        return
    if not svc.registry.sync_batch(record, msg.sync_id, msg.batch_id, msg.keys, svc.clock()):
        svc.bad("sync_batch", f"batch {msg.batch_id} of unknown sync {msg.sync_id}")


def sync_end(svc: ControllerService, msg: p.FullSyncEndMsg) -> None:
    record = svc.worker_for_event(msg.instance_id, msg.worker_id)
    if record is None:
        return
    sync = svc.registry.end_sync(record, msg.sync_id, svc.clock())
    if sync is None:
        svc.bad("sync_end", f"end of unknown sync {msg.sync_id}")
        return
    keys = sync.keys
    sync.keys = []
    svc.index.replace(msg.instance_id, msg.worker_id, sync.location, keys)
    svc.emit(DeltaOp.REPLACE, msg.instance_id, msg.worker_id, sync.location, keys)
    svc.metrics.full_syncs["completed"] += 1
    if len(keys) != msg.actual_total_keys or sync.missing_batches():
        logger.warning(
            "full sync %s of %s/%s: %d keys received, worker reported %d",
            msg.sync_id,
            msg.instance_id,
            msg.worker_id,
            len(keys),
            msg.actual_total_keys,
        )
    logger.info(
        "full sync %s of %s/%s completed: %d keys",
        msg.sync_id,
        msg.instance_id,
        msg.worker_id,
        len(keys),
    )


def sync_status(svc: ControllerService, msg: p.FullSyncStatusMsg) -> p.FullSyncStatusRetMsg:
    record = svc.registry.get(msg.instance_id, msg.worker_id)
    sync = record.sync if record is not None else None
    ours = sync is not None and sync.sync_id == msg.sync_id
    complete = ours and sync is not None and sync.state is SyncState.COMPLETED
    missing = sync.missing_batches() if ours and sync is not None else []
    progress = svc.registry.sync_progress()
    can_exit = complete or progress >= svc.settings.full_sync_completion_threshold
    return p.FullSyncStatusRetMsg(msg.sync_id, complete, progress, can_exit, missing)
