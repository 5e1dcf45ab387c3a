"""Registration and admit/evict events reach the controller: LMCache's own and kvpool's.

Both run as real subprocesses started with LMCache's controller flags.

The worker registers through LMCache's worker client (``enable_controller``); the controller's
``/lookup`` sees this worker's chunks after a store, stops seeing them after an evict, and the
worker is gone from ``/query_worker_info`` after close (deregistered).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import torch

from kvpool.worker.engine.offload import LMCacheOffload


def poll(fn: Callable[[], Any], want: Callable[[Any], bool], timeout_s: float = 10) -> Any:
    deadline = time.monotonic() + timeout_s
    got = fn()
    while not want(got) and time.monotonic() < deadline:
        time.sleep(0.1)
        got = fn()
    return got


def test_controller_sees_admits_evicts_and_deregistration(
    make_offload: Callable[..., LMCacheOffload],
    paged_kv: Callable[..., Any],
    kv_controller: dict[str, Any],
    free_tcp_port: Callable[[], int],
) -> None:
    instance = "ctl-worker-0"
    off = make_offload(
        {
            "local_cpu": True,
            "enable_controller": True,
            "lmcache_instance_id": instance,
            "controller_pull_url": kv_controller["controller_pull_url"],
            "controller_reply_url": kv_controller["controller_reply_url"],
            "lmcache_worker_ports": [free_tcp_port()],
        }
    )
    tokens = torch.randint(3, 8000, (800,), generator=torch.Generator().manual_seed(31)).tolist()
    http = httpx.Client(base_url=kv_controller["http"], timeout=5)

    def lookup() -> dict[str, Any]:
        r = http.post("/lookup", json={"tokens": tokens})
        r.raise_for_status()
        layout: dict[str, Any] = r.json()["layout_info"]
        return layout

    def workers() -> list[Any]:
        r = http.post("/query_worker_info", json={"instance_id": instance, "worker_ids": [0]})
        return list(r.json().get("worker_infos", [])) if r.status_code == 200 else []

    assert poll(workers, lambda w: len(w) == 1), "worker never registered"
    off.store(tokens, paged_kv(seed=31), torch.arange(800))
    layout = poll(lookup, lambda got: instance in got)
    assert layout[instance] == ["LocalCPUBackend", 768]
    assert off.evict(chunk_hashes=off.chunk_hashes(tokens)[1:]) == 2
    layout = poll(lookup, lambda got: got.get(instance, [None, 0])[1] == 256)
    assert layout[instance] == ["LocalCPUBackend", 256]
    off.close(10)
    assert off.closed_cleanly
    assert poll(workers, lambda w: len(w) == 0) == []
