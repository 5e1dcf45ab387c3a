"""P2P between two ``kvpool-worker`` processes through LMCache 0.5.6's P2P backend over NIXL.

All real: kvpool-controller (LMCache wire protocol), two reference workers with the real LMCache
engine, NIXL over UCX on 127.0.0.1 (``transfer_channel: nixl``; never py_socket or
mock_memory, which move no data). Worker B serves a prompt that only worker A computed: B's
scheduler waits on LMCache's asynchronous lookup, LMCache pulls A's chunks, B's greedy answer
equals A's cold answer. Then: everything a pull holds is given back (on the holder and the
puller; after a completed pull, after 1000 pulls aborted at once, after a puller killed
mid-pull), a conversation's next turn hits the previous answer, A killed without deregistering
never makes B hang, and a worker of another cache domain that the controller refuses is not
ready, with the reason.

Upstream LMCache 0.5.6's P2P is push-only: the holder pins the chunks only while it writes
them into the puller's buffers; there is no pending-pull lease and no TTL (that is
LMCache-Ascend's pull mode, ``p2p_pull_pending_ttl``; see README). The 1000-pull check drives
this process's own LMCache engine as the puller, so it runs in seconds and can read LMCache's
allocator.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from transfer_stack import (  # loaded by conftest
    CHANNEL,
    FINGERPRINT,
    cached,
    complete,
    engine_metric,
    tokens,
    worker_env,
)

from kvpool.worker.engine.offload import LMCacheOffload

Stack = Any


def wait_for(fn: object, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if fn():  # type: ignore[operator]
            return
        time.sleep(0.2)
    raise AssertionError(f"condition not met within {timeout_s}s")


def test_peer_prefix_is_pulled_and_answers_like_a_cold_run(stack: Stack) -> None:
    ctl = stack.controller(ttl_s=4.0)
    # C belongs to another cache domain (another PYTHONHASHSEED): the controller refuses it.
    c = stack.worker("p2p-c", stack.p2p_config("p2p-c", ctl, seed="7"), wait=False, seed="7")
    killed = start_killed_puller(stack, ctl)
    a = stack.worker("p2p-a", stack.p2p_config("p2p-a", ctl), wait=False)
    b = stack.worker("p2p-b", stack.p2p_config("p2p-b", ctl), wait=False)
    stack.wait_ready("p2p-a", a)
    stack.wait_ready("p2p-b", b)
    http = httpx.Client(base_url=ctl["http"], timeout=5)

    # 1. A computes the prompt cold; the controller learns A's chunks.
    prompt = tokens(700, seed=1)
    cold = complete(a, prompt, 12)
    assert cached(cold) == 0

    def a_indexed() -> bool:
        r = http.post("/lookup", json={"tokens": prompt})
        return any(k.startswith("p2p-a") for k in r.json().get("layout_info", {}))

    wait_for(a_indexed, 15)

    # 2. B never saw it: B pulls A's two full chunks over NIXL and answers the same.
    hit = complete(b, prompt, 12)
    assert hit["choices"][0]["text"] == cold["choices"][0]["text"]
    assert cached(hit) == 512
    assert engine_metric(b, "p2p_or_lower_tier_chunks") == 2
    # A's chunks were pinned only while B pulled them (LMCache releases after the write).
    assert httpx.get(f"{a}/memory/stats").json()["engine"]["tiers"]["local_cpu"][
        "lmcache_pinned"
    ] == 0  # fmt: skip
    assert engine_metric(b, "pending_prefetches") == 0
    check_leases(stack, ctl, a, prompt, killed)

    # 3. Generated tokens are stored too: the next turn hits the previous answer.
    turn1 = tokens(500, seed=2)
    answer = complete(a, turn1, 40, return_token_ids=True)
    turn2 = turn1 + [int(t) for t in answer["choices"][0]["token_ids"]] + tokens(30, seed=3)
    assert cached(complete(a, turn2, 4)) == 512  # 500 prompt + 12 of the answer's tokens

    # 4. A is killed without deregistering: B's lookups of A's chunks never hang.
    only_a = tokens(300, seed=4)
    cold_a = complete(a, only_a, 6)
    wait_for(lambda: http.post("/lookup", json={"tokens": only_a}).json()["layout_info"], 15)
    stack.kill("p2p-a")
    t0 = time.monotonic()
    served = complete(b, only_a, 6)
    assert time.monotonic() - t0 < 30, "a dead peer must cost at most the lookup timeout"
    assert served["choices"][0]["text"] == cold_a["choices"][0]["text"]

    # The controller purges A after its heartbeat TTL: then lookups offer no peer at all.
    def a_purged() -> bool:
        layout = http.post("/lookup", json={"tokens": prompt}).json()["layout_info"]
        return not any(k.startswith("p2p-a") for k in layout)

    wait_for(a_purged, 20)
    fresh = tokens(280, seed=5)
    t0 = time.monotonic()
    assert cached(complete(b, fresh, 2)) == 0
    assert time.monotonic() - t0 < 20

    # 5. C is not ready, and /readyz and its log carry the controller's reason.
    ready = httpx.get(f"{c}/readyz", timeout=5)
    assert ready.status_code == 503 and ready.json()["status"] == "refused", ready.text
    assert "fingerprint" in ready.json()["reason"]

    # 6. SIGTERM on a P2P worker: it exits promptly (LMCache's close no longer hangs on the
    # NIXL channel's zmq context term) with 0, and deregisters from the controller.
    def b_registered() -> bool:
        body = {"instance_id": f"p2p-b~{FINGERPRINT}", "worker_ids": [0]}
        r = http.post("/query_worker_info", json=body)
        return r.status_code == 200 and bool(r.json().get("worker_infos"))

    assert b_registered()
    proc = stack.procs["p2p-b"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0, stack.log("p2p-b")[-3000:]
    assert "did not close within" not in stack.log("p2p-b")
    wait_for(lambda: not b_registered(), 1.5)  # DeRegister, not the 4 s heartbeat TTL
    assert "refused instance p2p-c~" in stack.log("p2p-c")
    assert (
        httpx.post(f"{c}/v1/completions", json={"prompt": [5], "max_tokens": 1}).status_code == 503
    )


GEOMETRY = {"num_layers": 4, "num_kv_heads": 2, "head_dim": 64, "block_size": 16}
KILLED_PULLER = """
import os, sys, time, json, pathlib
from kvpool.worker.engine.offload import LMCacheOffload
cfg, geometry, go = json.loads(sys.argv[1]), json.loads(sys.argv[2]), pathlib.Path(sys.argv[3])
off = LMCacheOffload(cfg, instance_id=cfg["lmcache_instance_id"], dtype="float32",
                     model_name="kvpool/reference-tiny", **geometry)
go.with_suffix(".ready").write_text("1")
while not go.exists():
    time.sleep(0.05)
off.start_lookup(json.loads(go.read_text()))
time.sleep(0.05)  # the pull is on its way: die in the middle of it
os._exit(9)
"""


def puller_config(stack: Any, ctl: dict[str, str], name: str) -> dict[str, Any]:
    cfg: dict[str, Any] = {**stack.p2p_config(name, ctl), **CHANNEL}
    cfg["lmcache_instance_id"] = f"{name}~{FINGERPRINT}"
    return cfg


def start_killed_puller(stack: Any, ctl: dict[str, str]) -> tuple[Any, Path]:
    """A bare LMCache puller process, started early (it loads while the workers do)."""
    go = stack.tmp / "killed-puller.go"
    cfg = puller_config(stack, ctl, "killed-puller")
    argv = [sys.executable, "-c", KILLED_PULLER, json.dumps(cfg), json.dumps(GEOMETRY), str(go)]
    env = worker_env(stack.tmp / "unused.yaml")  # the rendered env; the config is argv's
    del env["LMCACHE_CONFIG_FILE"]
    env["UCX_NET_DEVICES"] = "lo"  # what the worker derives from POD_IP
    proc = stack._spawn("killed-puller", argv, env)
    return proc, go


def check_leases(
    stack: Any, ctl: dict[str, str], a: str, prompt: list[int], killed: tuple[Any, Path]
) -> None:
    def a_pinned() -> int:
        stats = httpx.get(f"{a}/memory/stats", timeout=5).json()
        return int(stats["engine"]["tiers"]["local_cpu"]["lmcache_pinned"])

    cfg = puller_config(stack, ctl, "p2p-puller")
    puller = LMCacheOffload(
        cfg, instance_id=cfg["lmcache_instance_id"], dtype="float32",
        model_name="kvpool/reference-tiny", **GEOMETRY,
    )  # fmt: skip
    allocator = puller._storage.local_cpu_backend.memory_allocator.cpu_allocator
    kv = [torch.zeros(2, 64, 16, 2, 64) for _ in range(4)]
    try:
        # A completed pull: 512 verified tokens; nothing stays pinned or allocated.
        assert puller.retrieve(prompt, len(prompt), kv, torch.arange(len(prompt))) == 512
        assert puller.pending_prefetches() == 0 and allocator.num_active_allocations == 0
        wait_for(lambda: a_pinned() == 0, 5)
        # 1000 pulls aborted as soon as they start (at most 32 in flight).
        for _ in range(1000):
            puller.cancel_lookup(puller.start_lookup(prompt))
            while puller.pending_prefetches() > 32:
                time.sleep(0.001)
        wait_for(lambda: puller.pending_prefetches() == 0, 60)
        assert allocator.num_active_allocations == 0
        wait_for(lambda: a_pinned() == 0, 5)
        # A puller killed mid-pull: A's pins come back and A still serves pulls.
        proc, go = killed
        wait_for(lambda: go.with_suffix(".ready").exists() or proc.poll() is not None, 120)
        go.write_text(json.dumps(prompt))
        assert proc.wait(60) == 9, stack.log("killed-puller")[-3000:]
        wait_for(lambda: a_pinned() == 0, 15)
        assert puller.retrieve(prompt, len(prompt), kv, torch.arange(len(prompt))) == 512
        assert allocator.num_active_allocations == 0
    finally:
        puller.close(10)
