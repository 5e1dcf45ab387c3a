"""The few storage operations LMCache 0.5.6 leaves out: remote removal, disk length checks,
write flushing and a Redis close that does not deadlock.

Why this module exists: LMCache's ``RemoteBackend.remove`` calls ``remove_sync``, which neither
its Redis nor its Mooncake connector implements, so evicting a chunk (or dropping one that
failed its integrity check) would leave it in the shared tier forever. This module removes it
with the connector's own client (redis-py's ``DELETE`` on LMCache's two keys per chunk,
Mooncake's ``remove``). ``flush_pending`` waits, bounded, for LMCache's asynchronous disk and
remote writes before a close. ``disk_length_ok`` catches a truncated chunk file before
LMCache's ``readinto`` fills the rest of the buffer with whatever it held before.
``close_redis`` closes LMCache's Redis connector without its ``close``, which deadlocks in
0.5.6 (it waits on its own event loop from inside that loop). ``close_nixl_side_channels``
closes the NIXL channels' init sockets that 0.5.6 never closes, whose ``zmq`` context ``term``
otherwise blocks a P2P or PD worker's close (and so its SIGTERM exit) forever.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from typing import Any

import torch
from lmcache.utils import CacheEngineKey

from kvpool.worker.engine.offload.tiers import (
    BACKEND_OF_TIER,
    LOCAL_DISK,
    REMOTE_BACKEND,
)

logger = logging.getLogger(__name__)

_REMOVE_TIMEOUT_S = 2.0


def _connector(storage: Any, *, even_if_bypassed: bool = False) -> tuple[Any, Any] | None:
    backend = storage.storage_backends.get(REMOTE_BACKEND)
    if backend is None or backend.connection is None:
        return None
    if not even_if_bypassed and storage.is_backend_bypassed(REMOTE_BACKEND):
        return None
    conn = backend.connection
    return backend, getattr(conn, "_connector", conn)


def remote_remove(storage: Any, key: CacheEngineKey) -> bool:
    """Remove ``key`` from the remote tier; False when absent, unsupported or unreachable."""
    found = _connector(storage)
    if found is None:
        return False
    backend, conn = found
    name = key.to_string()
    try:
        store = getattr(conn, "store", None)
        if store is not None and hasattr(store, "remove"):  # Mooncake
            return bool(store.remove(name, force=True) == 0)  # force: ignore read leases
        client = getattr(conn, "connection", None)
        if client is not None and hasattr(client, "delete"):  # redis.asyncio
            fut = asyncio.run_coroutine_threadsafe(
                client.delete(name + "kv_bytes", name + "metadata"), backend.loop
            )
            return bool(fut.result(_REMOVE_TIMEOUT_S))
    except Exception as e:
        logger.warning("removing chunk %s from the remote tier failed: %s", name, e)
        return False
    logger.debug("remote connector %s cannot remove chunks", type(conn).__name__)
    return False


def pending_writes(storage: Any) -> int:
    """Chunks LMCache has accepted but not yet written to disk or the remote tier."""
    n = 0
    disk = storage.storage_backends.get(BACKEND_OF_TIER[LOCAL_DISK])
    if disk is not None:
        n += len(disk.disk_worker.put_tasks)
    remote = storage.storage_backends.get(REMOTE_BACKEND)
    if remote is not None:
        n += len(remote.put_tasks)
    return n


def flush_pending(storage: Any, budget_s: float) -> bool:
    """Wait up to ``budget_s`` for pending writes; True when none is left."""
    deadline = time.monotonic() + budget_s
    while True:
        left = pending_writes(storage)
        if left == 0:
            return True
        if time.monotonic() >= deadline:
            logger.warning("%d chunk writes still pending at close: giving up on them", left)
            return False
        time.sleep(0.02)


def close_redis(storage: Any, timeout_s: float = 2.0) -> bool:
    """Close LMCache's ``redis://`` connector safely and detach it; True when it was one.

    ``RedisConnector.close`` awaits a *synchronous* ``pq_executor.shutdown`` on the loop that
    shutdown itself waits for, so it never returns. Here the executor is stopped without
    waiting and the client closed, both on that loop, then the backend forgets the
    connection (its own close then only logs that it had none).
    """
    found = _connector(storage, even_if_bypassed=True)  # a dead Redis hangs LMCache's close too
    if found is None:
        return False
    backend, conn = found
    executor = getattr(conn, "pq_executor", None)
    client = getattr(conn, "connection", None)
    if executor is None or client is None or not hasattr(client, "aclose"):
        return False

    async def _close() -> None:
        await executor.shutdown_async(wait=False)
        await client.aclose()

    try:
        asyncio.run_coroutine_threadsafe(_close(), backend.loop).result(timeout_s)
    except Exception as e:
        logger.warning("closing the Redis connection failed: %s", e)
    backend.connection = None
    return True


def close_nixl_side_channels(storage: Any, timeout_s: float = 1.0) -> int:
    """Close the NIXL channels' init side channels (linger 0) on their event loops; how many.

    LMCache 0.5.6's ``NixlChannel.close`` terms the process-wide ``zmq.asyncio`` context but
    never closes the REP socket its async init loop listens on (the P2P backend's
    ``p2p_init_ports``, a PD receiver's ``pd_peer_init_port``), and ``term`` waits until every
    socket of the context is closed: the backend's close, so LMCache's, never returned.
    Closing it on the loop that awaits it ends that loop (its pending ``recv`` is cancelled);
    ``running`` is cleared first so the loop does not retry.
    """
    closed = 0
    for backend in list(storage.storage_backends.values()):
        channel: Any = getattr(backend, "transfer_channel", None)
        sockets = list(getattr(channel, "side_channels", None) or [])
        loop = getattr(channel, "event_loop", None)
        if channel is None or not sockets or loop is None or not channel.async_mode:
            continue  # nothing to close here (a sync channel's thread owns its socket)
        channel.running = False

        async def _close(sockets: list[Any] = sockets) -> None:
            for sock in sockets:
                sock.close(linger=0)

        try:
            asyncio.run_coroutine_threadsafe(_close(), loop).result(timeout_s)
        except Exception as e:
            logger.warning("closing the NIXL side channels of %s failed: %s", backend, e)
            continue
        channel.side_channels = []
        closed += len(sockets)
    return closed


def close_pd_sender_sockets(storage: Any, timeout_s: float = 1.0) -> int:
    """Close a PD sender's proxy and alloc sockets (linger 0) on its loop; how many.

    LMCache 0.5.6's ``PDBackendAsync.close`` terms the sender's own ``zmq.asyncio`` context
    but never closes its PUSH socket to the proxy (and closes the alloc sockets with an
    infinite linger), so ``term`` never returned once the sender had transferred KV.
    """
    backend = storage.storage_backends.get("PDBackend")
    loop = getattr(backend, "_sender_loop", None)
    if backend is None or loop is None or not loop.is_running():
        return 0
    sockets = [getattr(backend, "_async_proxy_socket", None)]
    sockets += list(getattr(backend, "_async_alloc_sockets", {}).values())
    live = [sock for sock in sockets if sock is not None]

    async def _close() -> None:
        for sock in live:
            sock.close(linger=0)

    try:
        asyncio.run_coroutine_threadsafe(_close(), loop).result(timeout_s)
    except Exception as e:
        logger.warning("closing the PD sender's sockets failed: %s", e)
        return 0
    return len(live)


def disk_length_ok(storage: Any, key: CacheEngineKey) -> bool:
    """The chunk file of ``key`` has exactly the bytes its shape and dtype need."""
    disk = storage.storage_backends.get(BACKEND_OF_TIER[LOCAL_DISK])
    meta = None if disk is None else disk.dict.get(key)
    if meta is None or meta.shape is None or meta.dtype is None:
        return True  # not on disk (LMCache will miss) or nothing to compare with
    want = math.prod(meta.shape) * torch.empty((), dtype=meta.dtype).element_size()
    try:
        have = os.stat(meta.path).st_size
    except OSError:
        return False
    if have != want:
        logger.warning("chunk file %s has %d bytes, expected %d: a miss", meta.path, have, want)
        return False
    return True


def deregister_first(engine: Any, budget_s: float = 1.0) -> bool:
    """Send LMCache's DeRegister and let it reach the wire before LMCache closes.

    ``LMCacheWorker.close`` queues the message on its loop and stops that loop right away,
    then closes the PUSH socket with linger 0: the controller never hears it and keeps a dead
    worker registered. Here the message is queued first and given time to leave.
    """
    worker = getattr(engine, "lmcache_worker", None)
    if worker is None:
        return False
    worker.deregister()
    deadline = time.monotonic() + budget_s
    while not worker.msg_queue.empty() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))  # ZMQ's I/O thread sends it
    return bool(worker.msg_queue.empty())


def pin_controller_requests(engine: Any) -> bool:
    """Run LMCache's controller requests on the controller client's own event loop, one at a
    time; True when the engine has a controller client.

    LMCache's P2P backend awaits ``LMCacheWorker.async_put_and_wait_msg`` on the storage
    manager's loop, but the DEALER socket belongs to the worker's loop: the reply then waits
    until that loop wakes up for something else (measured: 0.4-5 s per P2P lookup, often past
    the 3 s lookup timeout). Two requests in flight on one DEALER can also take each other's
    replies. LMCache-Ascend pins the call to the worker loop the same way.
    """
    worker = getattr(engine, "lmcache_worker", None)
    if worker is None:
        return False
    original = worker.async_put_and_wait_msg
    loop = worker.loop
    lock: list[asyncio.Lock] = []  # created on the worker loop, on first use

    async def _serialized(msg: Any) -> Any:
        if not lock:
            lock.append(asyncio.Lock())
        async with lock[0]:
            return await original(msg)

    async def pinned(msg: Any) -> Any:
        if asyncio.get_running_loop() is loop:
            return await _serialized(msg)
        fut = asyncio.run_coroutine_threadsafe(_serialized(msg), loop)
        return await asyncio.wrap_future(fut)

    worker.async_put_and_wait_msg = pinned
    return True
