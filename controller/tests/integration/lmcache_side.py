"""Stock LMCache worker-side code wired to a controller: ``LMCacheWorker`` + ``LocalCPUBackend``.

Why: the compatibility requirement is that LMCache's own worker code talks to our controller
unchanged. This module builds exactly that: LMCache's ``LMCacheWorker`` (register, heartbeat,
control replies, full sync) and a real ``LocalCPUBackend`` whose puts and removes go through
LMCache's ``BatchedMessageSender`` as admit/evict events. The one stand-in is the engine object
the worker holds (a full ``LMCacheEngine`` needs a paged GPU connector): it exposes only what
the worker calls — ``storage_manager.local_cpu_backend``, ``freeze``, ``clear``, ``health`` —
and forwards to the real backend.

Run as a script it becomes a worker process (``READY`` on stdout once its keys are admitted),
so tests can SIGKILL it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

import msgspec
import torch
import zmq
from lmcache.utils import CacheEngineKey
from lmcache.v1.cache_controller.message import BatchedP2PLookupMsg, DeRegisterMsg
from lmcache.v1.cache_controller.worker import LMCacheWorker
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

CHUNK = 16
SHAPE = torch.Size([2, 2, CHUNK, 2, 8])


class _EngineShim:
    """The part of ``LMCacheEngine`` that ``LMCacheWorker`` calls, backed by a real backend."""

    def __init__(self) -> None:
        self.storage_manager = SimpleNamespace(local_cpu_backend=None)
        self.frozen = False

    def freeze(self, on: bool) -> None:
        self.frozen = on

    def clear(self, locations: Any = None) -> int:
        return int(self.storage_manager.local_cpu_backend.clear())

    def health(self) -> int:
        return 0


class LMCacheSide:
    """One LMCache worker (one TP rank of one instance) connected to a controller."""

    def __init__(
        self,
        instance_id: str,
        ports: dict[str, int],
        worker_port: int,
        worker_id: int = 0,
        world_size: int = 1,
        heartbeat_s: int | None = 1,
        p2p_port: int | None = None,
        cpu_gb: float = 0.02,
    ) -> None:
        cfg: dict[str, Any] = {
            "chunk_size": CHUNK,
            "local_cpu": True,
            "max_local_cpu_size": cpu_gb,
            "enable_controller": True,
            "lmcache_instance_id": instance_id,
            "controller_pull_url": f"127.0.0.1:{ports['pull']}",
            "controller_reply_url": f"127.0.0.1:{ports['reply']}",
            "lmcache_worker_ports": [worker_port] * world_size,
            "lmcache_worker_heartbeat_delay_time": 0,
            "extra_config": {
                "kv_msg_batch_timeout": 0.005,
                "full_sync_startup_delay_s": 0.0,
                "full_sync_status_poll_interval_s": 0.2,
                "full_sync_batch_interval_ms": 0,
                # LMCache waits this long for a reply to a heartbeat sent just before the
                # controller died (default 30 s) before it retries; kvpool renders it short.
                "worker_socket_recv_timeout_ms": 3000,
            },
        }
        if heartbeat_s:
            cfg["lmcache_worker_heartbeat_time"] = heartbeat_s
        if p2p_port is not None:
            cfg.update(
                enable_p2p=True,
                p2p_host="127.0.0.1",
                p2p_init_ports=[p2p_port] * world_size,
                p2p_lookup_ports=[p2p_port + 1] * world_size,
            )
        self.config = LMCacheEngineConfig.from_dict(cfg)
        self.metadata = LMCacheMetadata(
            model_name="m",
            world_size=world_size,
            local_world_size=world_size,
            worker_id=worker_id,
            local_worker_id=worker_id,
            kv_dtype=torch.float16,
            kv_shape=(2, 2, CHUNK, 2, 8),
        )
        self.engine = _EngineShim()
        self.worker = LMCacheWorker(self.config, self.metadata, self.engine)  # type: ignore[arg-type]
        self.backend = LocalCPUBackend(self.config, self.metadata, lmcache_worker=self.worker)
        self.engine.storage_manager.local_cpu_backend = self.backend
        self.worker_id = worker_id

    def _key(self, chunk_hash: int) -> CacheEngineKey:
        return CacheEngineKey(
            "m", self.metadata.world_size, self.worker_id, chunk_hash, torch.float16
        )

    def admit(self, hashes: list[int]) -> None:
        for h in hashes:
            obj = self.backend.allocate(SHAPE, torch.float16)
            assert obj is not None, "LocalCPUBackend out of memory"
            self.backend.submit_put_task(self._key(h), obj)
            obj.ref_count_down()  # as the engine does after a store: the cache owns it now
        self.backend.batched_msg_sender.flush()  # type: ignore[union-attr]

    def evict(self, hashes: list[int]) -> None:
        for h in hashes:
            self.backend.remove(self._key(h))
        self.backend.batched_msg_sender.flush()  # type: ignore[union-attr]

    def p2p_lookup(self, hashes: list[int]) -> list[tuple[str, str, int, str]]:
        msg = BatchedP2PLookupMsg(
            hashes=hashes, instance_id=self.config.lmcache_instance_id, worker_id=self.worker_id
        )
        fut = asyncio.run_coroutine_threadsafe(
            self.worker.async_put_and_wait_msg(msg), self.worker.loop
        )
        return list(fut.result(timeout=10).layout_info)

    def close(self, deregistered: Callable[[], bool] | None = None) -> None:
        """Release, deregister, close. With ``deregistered`` (a check on the controller), the
        deregister is re-sent (at most 3 times) until the controller saw it: under load,
        LMCache's worker can drop its own queued message when its loop stops. A heartbeat
        LMCache sent before its loop stopped can still arrive after the deregister and register
        the worker again (the controller re-registers a heartbeating worker it does not know, as
        after a purge); then, with the loop stopped and no heartbeat left to come, one more
        ``DeRegisterMsg`` goes on LMCache's wire (msgpack over a PUSH to the pull URL)."""
        self.backend.clear()  # releases the memory objects (and sends their evictions)
        self.backend.batched_msg_sender.flush()  # type: ignore[union-attr]
        for _ in range(3):
            self.worker.deregister()
            # LMCache's close() stops the loop right after queueing the deregister: let it go.
            deadline = time.monotonic() + 10
            while not self.worker.msg_queue.empty() and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.3)
            if deregistered is None:
                break
            if _until(deregistered, 5):
                break
        self.backend.close()  # sender thread, allocator
        self.worker.close()
        if deregistered is not None and not deregistered():
            self._push_deregister()
            _until(deregistered, 5)
        # LMCache's close() leaves its loop's tasks pending; keep the objects alive so their
        # finalisers run at interpreter exit, not at a random GC in the middle of a test.
        _CLOSED.append(self)

    def _push_deregister(self) -> None:
        msg = DeRegisterMsg(
            instance_id=self.worker.lmcache_instance_id,
            worker_id=self.worker.worker_id,
            ip=self.worker.lmcache_worker_ip,
            port=self.worker.lmcache_worker_port,
        )
        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        try:
            sock.connect(f"tcp://{self.config.controller_pull_url}")
            sock.send_multipart([msgspec.msgpack.encode(msg)])
        finally:
            sock.close()


def _until(check: Callable[[], bool], timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and not check():
        time.sleep(0.05)
    return check()


_CLOSED: list[LMCacheSide] = []


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--instance", required=True)
    ap.add_argument("--ports", required=True, help="JSON role -> port of the controller")
    ap.add_argument("--worker-port", type=int, required=True)
    ap.add_argument("--admit", default="", help="comma-separated chunk hashes")
    ap.add_argument("--heartbeat", type=int, default=1)
    ap.add_argument("--cpu-gb", type=float, default=0.02, help="LocalCPUBackend size")
    args = ap.parse_args()
    ports = json.loads(args.ports)
    side = LMCacheSide(
        args.instance, ports, args.worker_port, heartbeat_s=args.heartbeat, cpu_gb=args.cpu_gb
    )
    time.sleep(0.5)  # registration is asynchronous in LMCacheWorker
    hashes = [int(h) for h in args.admit.split(",") if h]
    side.admit(hashes)
    time.sleep(0.2)
    print("READY", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())
