r"""Full sync: a worker resends every key it holds, and the index takes exactly that set.

Why: after a controller restart without Redis (or a failed sync) the index knows nothing about
a worker's keys. LMCache's workers answer a ``FullSyncCommand`` (sent on a heartbeat reply) with
``FullSyncStartMsg`` → ``FullSyncBatchMsg``\ s → ``FullSyncEndMsg`` and poll
``FullSyncStatusMsg``. Keys are staged in the registry's session and replace the worker's
entries for that tier atomically at the end, so a half-finished sync never shows up in lookups
and stale keys from before it disappear. Incremental events during the sync are dropped (the
worker is frozen meanwhile, as LMCache's own controller assumes).

The handlers take a :class:`SyncHost` — the few parts of the service they use — so this module
does not import :mod:`kvpool.controller.service` (which dispatches to it): no import circle.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from kvpool.controller.metrics import Metrics
from kvpool.controller.registry import Registry, SyncState, WorkerRecord
from kvpool.controller.settings import ControllerSettings
from kvpool.protocol import lmcache_wire as p
from kvpool.protocol.deltas import DeltaOp
from kvpool.protocol.index import ChunkIndex

logger = logging.getLogger(__name__)


class SyncHost(Protocol):
    """What a full sync needs from the controller service."""

    settings: ControllerSettings
    index: ChunkIndex
    registry: Registry
    metrics: Metrics
    clock: Callable[[], float]

    def bad(self, kind: str, detail: str) -> None: ...

    def worker_for_event(self, instance_id: str, worker_id: int) -> WorkerRecord | None: ...

    def emit(
        self, op: DeltaOp, instance_id: str, worker_id: int, location: str, keys: list[int]
    ) -> None: ...


def sync_start(svc: SyncHost, msg: p.FullSyncStartMsg) -> p.FullSyncStartRetMsg:
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


def sync_batch(svc: SyncHost, msg: p.FullSyncBatchMsg) -> None:
    record = svc.worker_for_event(msg.instance_id, msg.worker_id)
    if record is None:
        return
    if not svc.registry.sync_batch(record, msg.sync_id, msg.batch_id, msg.keys, svc.clock()):
        svc.bad("sync_batch", f"batch {msg.batch_id} of unknown sync {msg.sync_id}")


def sync_end(svc: SyncHost, msg: p.FullSyncEndMsg) -> None:
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


def sync_status(svc: SyncHost, msg: p.FullSyncStatusMsg) -> p.FullSyncStatusRetMsg:
    record = svc.registry.get(msg.instance_id, msg.worker_id)
    sync = record.sync if record is not None else None
    ours = sync is not None and sync.sync_id == msg.sync_id
    complete = ours and sync is not None and sync.state is SyncState.COMPLETED
    missing = sync.missing_batches() if ours and sync is not None else []
    progress = svc.registry.sync_progress()
    can_exit = complete or progress >= svc.settings.full_sync_completion_threshold
    return p.FullSyncStatusRetMsg(msg.sync_id, complete, progress, can_exit, missing)
