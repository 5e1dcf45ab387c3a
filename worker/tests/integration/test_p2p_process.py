"""P2P between two ``kvpool-worker`` processes through LMCache 0.5.6's P2P backend over NIXL.

All real: kvpool-controller (LMCache wire protocol), two reference workers with the real LMCache
engine, NIXL over UCX on 127.0.0.1 (``transfer_channel: nixl``; never py_socket or
mock_memory, which move no data). Worker B serves a prompt that only worker A computed: B's
scheduler waits on LMCache's asynchronous lookup, LMCache pulls A's chunks, B's greedy answer
equals A's cold answer. Then: a conversation's next turn hits the previous answer, A's
prefetch leases are back to zero, A killed without deregistering never makes B hang, and a
worker of another cache domain that the controller refuses is not ready, with the reason.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
from transfer_stack import cached, complete, engine_metric, tokens  # loaded by conftest

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
    a = stack.worker("p2p-a", stack.p2p_config("p2p-a", ctl))
    b = stack.worker("p2p-b", stack.p2p_config("p2p-b", ctl))
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
    assert "refused instance p2p-c~" in stack.log("p2p-c")
    assert (
        httpx.post(f"{c}/v1/completions", json={"prompt": [5], "max_tokens": 1}).status_code == 503
    )
