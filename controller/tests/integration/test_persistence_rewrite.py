"""Changes submitted while the Redis write-behind rewrites the whole index are kept.

Real redis-server (started by the fixture). The rewrite is wrapped so that a change arrives
after the snapshot was taken and before the rewrite finished — the window in which the store
used to treat new changes as covered by the rewrite and drop them (found in review).
"""

from __future__ import annotations

import asyncio
from typing import Any

from kvpool.controller.metrics import Metrics
from kvpool.controller.persistence import RedisStore
from kvpool.protocol.deltas import Delta, DeltaOp, Snapshot


async def test_changes_during_a_rewrite_reach_redis(redis_server: dict[str, Any]) -> None:
    store = RedisStore(redis_server["url"], "rewrite-test", Metrics())
    real_rewrite = store._rewrite
    late = [
        Delta(1, DeltaOp.WORKER_UP, "a~0123456789ab", 0, url="10.0.0.1:7000"),
        Delta(2, DeltaOp.ADMIT, "a~0123456789ab", 0, "LocalCPUBackend", [11, 22]),
    ]

    async def rewrite_with_a_change_in_flight(snap: Snapshot) -> None:
        store.submit(late)  # arrives after the (empty) snapshot was taken
        await real_rewrite(snap)

    store._rewrite = rewrite_with_a_change_in_flight  # type: ignore[method-assign]
    writer = asyncio.create_task(store.run(lambda: Snapshot("e", 0, [], [])))
    try:
        store._mark_dirty()
        store.flushed.clear()
        await asyncio.wait_for(store.flushed.wait(), 10)
        loaded = await store.load()
    finally:
        writer.cancel()
        await asyncio.gather(writer, return_exceptions=True)
        await store.close()
    assert ("a~0123456789ab", 0) in loaded.workers
    entries = [(i, w, loc, sorted(keys)) for i, w, loc, keys in loaded.entries]
    assert entries == [("a~0123456789ab", 0, "LocalCPUBackend", [11, 22])]
