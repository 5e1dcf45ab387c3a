"""Redis write-behind of the index, and reload after a restart.

Why write-behind: the controller must answer at memory speed, so Redis never sits on the
request path. Index changes (the same deltas the PUB stream carries) go into a bounded queue;
a background task writes them in pipelined batches. When the queue overflows or Redis fails,
the queue is dropped and the store is marked dirty: the next successful round rewrites the whole
index from a snapshot, so Redis converges to the truth instead of missing changes forever.
Redis being down never stops the controller; errors are counted. Redis restarted empty (no
persistence of its own) or flushed between two writes raises no error at all: a marker key
written with every full rewrite is checked every :data:`CHECK_INTERVAL_S`, and its absence
means the index there is gone, so the store rewrites it.

Layout under ``<namespace>:`` — ``workers`` (hash: ``instance\\x1fworker`` → msgpack record),
``locs:<instance>\\x1f<worker>`` (set of locations), ``keys:<instance>\\x1f<worker>\\x1f<location>``
(set of chunk hashes as decimal strings).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import redis.asyncio as aioredis

from kvpool.controller.metrics import Metrics
from kvpool.protocol.deltas import Delta, DeltaOp, Snapshot

logger = logging.getLogger(__name__)

SEP = "\x1f"
#: Seconds between checks that Redis still holds what was written (the marker key).
CHECK_INTERVAL_S = 2.0


class StoredWorker(msgspec.Struct, frozen=True, array_like=True):
    ip: str
    port: int
    peer_init_url: str | None
    registration_time: float


@dataclass
class LoadedState:
    workers: dict[tuple[str, int], StoredWorker]
    entries: list[tuple[str, int, str, list[int]]]

    @property
    def chunk_locations(self) -> int:
        return sum(len(keys) for *_, keys in self.entries)


class RedisStore:
    """Write-behind persistence of the controller's index into one Redis namespace."""

    def __init__(
        self,
        url: str,
        namespace: str,
        metrics: Metrics,
        queue_max_keys: int = 1_000_000,
        batch_keys: int = 50_000,
    ) -> None:
        self._redis = aioredis.Redis.from_url(
            url, socket_timeout=2.0, socket_connect_timeout=2.0, decode_responses=False
        )
        self.url = url
        self.ns = namespace
        self.metrics = metrics
        self.queue_max_keys = queue_max_keys
        self.batch_keys = batch_keys
        self._queue: deque[Delta] = deque()
        self._queued_keys = 0
        self._wake = asyncio.Event()
        self.dirty = False
        self.healthy = True
        self._logged_error = False
        self.flushed = asyncio.Event()
        self._checked_at = float("-inf")  # monotonic time of the last marker check

    # ------------------------------------------------------------------ keys

    def _workers_key(self) -> str:
        return f"{self.ns}:workers"

    def _marker_key(self) -> str:
        return f"{self.ns}:written"

    def _locs_key(self, instance_id: str, worker_id: int) -> str:
        return f"{self.ns}:locs:{instance_id}{SEP}{worker_id}"

    def _keys_key(self, instance_id: str, worker_id: int, location: str) -> str:
        return f"{self.ns}:keys:{instance_id}{SEP}{worker_id}{SEP}{location}"

    # ------------------------------------------------------------------ queue

    def submit(self, deltas: list[Delta]) -> None:
        """Queue changes for writing; never blocks. Overflow → drop and rewrite later."""
        if not deltas:
            return
        if self.dirty:
            return  # a full rewrite is pending; it will include these changes
        self._queue.extend(deltas)
        self._queued_keys += sum(len(d.keys) + 1 for d in deltas)
        if self._queued_keys > self.queue_max_keys:
            self.metrics.persistence_dropped += self._queued_keys
            logger.warning(
                "Redis write-behind queue over %d keys; dropping it and rewriting the index",
                self.queue_max_keys,
            )
            self._mark_dirty()
        self.flushed.clear()
        self._wake.set()

    def rewrite(self) -> None:
        """Rewrite the whole index from a snapshot on the next round (a standby that took over:
        whatever the old leader had queued is lost)."""
        self._mark_dirty()

    def _mark_dirty(self) -> None:
        self.dirty = True
        self._queue.clear()
        self._queued_keys = 0
        self._wake.set()

    @property
    def queued_keys(self) -> int:
        return self._queued_keys

    # ------------------------------------------------------------------ writer

    async def run(self, snapshot: Callable[[], Snapshot], retry_s: float = 1.0) -> None:
        """Background writer: drain the queue (or rewrite everything when dirty), forever."""
        while True:
            with contextlib.suppress(TimeoutError):  # at the latest, check the marker then
                async with asyncio.timeout(CHECK_INTERVAL_S):
                    await self._wake.wait()
            self._wake.clear()
            try:
                await self._check_marker()
                if self.dirty:
                    # Clear the flag with the snapshot taken, before awaiting: changes
                    # submitted during the rewrite are queued (not dropped as covered).
                    snap = snapshot()
                    self.dirty = False
                    await self._rewrite(snap)
                while self._queue:
                    await self._write_some()
                self._recovered()
                if not self._queue and not self.dirty:
                    self.flushed.set()
            except (aioredis.RedisError, OSError) as exc:
                self.metrics.persistence_errors += 1
                self.healthy = False
                if not self._logged_error:
                    self._logged_error = True
                    logger.error(
                        "Redis %s unavailable (%s); serving on, will rewrite later", self.url, exc
                    )
                self._mark_dirty()
                await asyncio.sleep(retry_s)

    async def _check_marker(self) -> None:
        """Every ``CHECK_INTERVAL_S``: no marker, no index (Redis restarted empty, or was
        flushed): rewrite it from a snapshot."""
        now = time.monotonic()
        if self.dirty or now - self._checked_at < CHECK_INTERVAL_S:
            return
        self._checked_at = now
        if not await self._redis.exists(self._marker_key()):
            logger.warning(
                "Redis %s holds none of the index (restarted empty or flushed): rewriting it",
                self.url,
            )
            self._mark_dirty()

    def _recovered(self) -> None:
        if not self.healthy:
            logger.info("Redis %s reachable again; index rewritten", self.url)
        self.healthy = True
        self._logged_error = False

    async def _write_some(self) -> None:
        pipe = self._redis.pipeline(transaction=False)
        budget = self.batch_keys
        taken = 0
        while self._queue and budget > 0:
            delta = self._queue.popleft()
            taken += len(delta.keys) + 1
            budget -= len(delta.keys) + 1
            self._stage(pipe, delta)
        self._queued_keys = max(0, self._queued_keys - taken)
        await pipe.execute()

    def _stage(self, pipe: Any, d: Delta) -> None:
        i, w, loc = d.instance_id, d.worker_id, d.location
        match d.op:
            case DeltaOp.ADMIT:
                if d.keys:
                    pipe.sadd(self._keys_key(i, w, loc), *d.keys)
                    pipe.sadd(self._locs_key(i, w), loc)
            case DeltaOp.EVICT:
                if d.keys:
                    pipe.srem(self._keys_key(i, w, loc), *d.keys)
            case DeltaOp.REPLACE:
                pipe.delete(self._keys_key(i, w, loc))
                if d.keys:
                    pipe.sadd(self._keys_key(i, w, loc), *d.keys)
                    pipe.sadd(self._locs_key(i, w), loc)
            case DeltaOp.CLEAR:
                pipe.delete(self._keys_key(i, w, loc))
                pipe.srem(self._locs_key(i, w), loc)
            case DeltaOp.WORKER_UP:
                url = d.url or ":0"
                host, _, port = url.rpartition(":")
                record = StoredWorker(host, int(port or 0), d.peer_init_url, time.time())
                pipe.hset(self._workers_key(), f"{i}{SEP}{w}", msgspec.msgpack.encode(record))
            case DeltaOp.WORKER_DOWN:
                pipe.hdel(self._workers_key(), f"{i}{SEP}{w}")
                pipe.delete(self._locs_key(i, w))

    async def _rewrite(self, snap: Snapshot) -> None:
        """Replace the namespace with the snapshot (after an overflow or an outage)."""
        stale = [k async for k in self._redis.scan_iter(match=f"{self.ns}:*", count=1000)]
        pipe = self._redis.pipeline(transaction=False)
        for start in range(0, len(stale), 1000):
            pipe.delete(*stale[start : start + 1000])
        for wk in snap.workers:
            host, _, port = wk.url.rpartition(":")
            record = StoredWorker(host, int(port or 0), wk.peer_init_url, 0.0)
            pipe.hset(
                self._workers_key(),
                f"{wk.instance_id}{SEP}{wk.worker_id}",
                msgspec.msgpack.encode(record),
            )
        for e in snap.entries:
            key = self._keys_key(e.instance_id, e.worker_id, e.location)
            for start in range(0, len(e.keys), self.batch_keys):
                pipe.sadd(key, *e.keys[start : start + self.batch_keys])
            if e.keys:
                pipe.sadd(self._locs_key(e.instance_id, e.worker_id), e.location)
        pipe.set(self._marker_key(), str(snap.seq))
        await pipe.execute()
        logger.info("Redis %s rewritten from a snapshot at seq %d", self.url, snap.seq)

    # ------------------------------------------------------------------ load

    async def load(self) -> LoadedState:
        """Read back everything written; raises ``redis.RedisError`` when Redis is down."""
        raw = await self._redis.hgetall(self._workers_key())
        workers: dict[tuple[str, int], StoredWorker] = {}
        for field, value in raw.items():
            instance_id, _, worker = field.decode().rpartition(SEP)
            try:
                workers[(instance_id, int(worker))] = msgspec.msgpack.decode(
                    value, type=StoredWorker
                )
            except (ValueError, msgspec.DecodeError) as exc:
                logger.warning("skipping unreadable stored worker %r: %s", field, exc)
        entries: list[tuple[str, int, str, list[int]]] = []
        for instance_id, worker_id in workers:
            locations = await self._redis.smembers(self._locs_key(instance_id, worker_id))
            for raw_loc in sorted(locations):
                location = raw_loc.decode()
                members = await self._redis.smembers(
                    self._keys_key(instance_id, worker_id, location)
                )
                entries.append((instance_id, worker_id, location, [int(k) for k in members]))
        return LoadedState(workers, entries)

    async def close(self) -> None:
        await self._redis.aclose()  # type: ignore[attr-defined]
