"""Stock LMCache worker code and LMCache's controller benchmark against our controller.

Real LMCache on both sides of the wire: ``LMCacheWorker`` registers, heartbeats and answers
control requests; ``LocalCPUBackend`` puts/removes emit admit/evict batches through LMCache's
``BatchedMessageSender``; the P2P lookup is LMCache's own request path. The only stand-in is
the engine object the worker holds (see ``lmcache_side.py``).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from conftest import ENV, free_port, wait_until
from lmcache_side import LMCacheSide


def test_register_heartbeat_admit_evict_p2p_and_control(controllers: Any) -> None:
    ctl = controllers("--fingerprint", "0123456789ab")
    a = LMCacheSide(
        "a~0123456789ab", ctl.ports, free_port(), worker_id=1, world_size=2, p2p_port=free_port()
    )
    b = LMCacheSide(
        "b~0123456789ab", ctl.ports, free_port(), worker_id=1, world_size=2, p2p_port=free_port()
    )
    try:

        def infos() -> list[dict[str, Any]]:
            return ctl.post("/query_worker_info", {"instance_id": "all"})["worker_infos"]

        wait_until(lambda: len(infos()) == 2, what="both workers registered")
        first = {i["instance_id"]: i["last_heartbeat_time"] for i in infos()}
        wait_until(
            lambda: all(i["last_heartbeat_time"] > first[i["instance_id"]] for i in infos()),
            what="heartbeats",
        )
        a.admit([101, 102, 103])
        b.admit([101, 102])
        wait_until(lambda: ctl.hits([101, 102, 103]) == {"a~0123456789ab": 3, "b~0123456789ab": 2})
        a.evict([102])
        wait_until(lambda: ctl.hits([101, 102, 103]) == {"a~0123456789ab": 1, "b~0123456789ab": 2})

        # P2P: b asks for a prompt; a holds only the first chunk now, on the same TP rank (1)
        layout = b.p2p_lookup([101, 102, 103])
        assert layout[0][0] == "a~0123456789ab" and layout[0][2] == 1
        assert layout[0][3] == a.worker.p2p_init_url

        # LMCache-shaped endpoints reach the worker's reply socket
        health = ctl.post("/health", {"instance_id": "a~0123456789ab"})
        assert health["error_codes"] == {"1": 0}
        cleared = ctl.post(
            "/clear", {"instance_id": "b~0123456789ab", "location": "LocalCPUBackend"}
        )
        assert cleared["num_tokens"] == 2 * 16
        wait_until(lambda: "b~0123456789ab" not in ctl.hits([101]), what="evictions after clear")
        done = ctl.post("/check_finish", {"event_id": cleared["event_id"]})
        assert done == {"status": "finished"}
        lookup = ctl.post("/lookup", {"tokens": list(range(10))})
        assert set(lookup) == {"event_id", "layout_info"}
        assert ctl.post("/query_instance", {"ip": infos()[0]["ip"]})["res"].endswith(
            "~0123456789ab"
        )
    finally:

        def gone(instance: str) -> Callable[[], bool]:
            return lambda: all(i["instance_id"] != instance for i in infos())

        a.close(gone("a~0123456789ab"))
        b.close(gone("b~0123456789ab"))
    wait_until(
        lambda: ctl.post("/query_worker_info", {"instance_id": "all"})["worker_infos"] == [],
        what="deregistration",
    )
    assert ctl.hits([101]) == {}


def test_fingerprint_mismatch_refuses_a_stock_worker(controllers: Any) -> None:
    ctl = controllers("--fingerprint", "0123456789ab")
    bad = LMCacheSide("x~ffffffffffff", ctl.ports, free_port())
    try:
        wait_until(lambda: ctl.metric("kvpool_controller_refusals_total") >= 1, what="refusal")
        bad.admit([1, 2])
        wait_until(
            lambda: ctl.metric('kvpool_controller_bad_input_total{kind="refused_instance"}') >= 1
        )
        assert ctl.hits([1, 2]) == {}
        assert ctl.post("/query_worker_info", {"instance_id": "all"})["worker_infos"] == []
        assert "expected '0123456789ab', got 'ffffffffffff'" in ctl.log.read_text()
    finally:
        bad.close()


def test_lmcache_controller_benchmark_runs_with_zero_errors(controllers: Any) -> None:
    ctl = controllers()
    out = subprocess.run(
        [sys.executable, "-m", "lmcache.tools.controller_benchmark",
         "--monitor-ports", f'{{"pull":{ctl.ports["pull"]},"reply":{ctl.ports["reply"]}}}',
         "--num-instances", "5", "--num-keys", "2000", "--batch-size", "50", "--duration", "2",
         "--operations", "admit:35,evict:29,heartbeat:1,p2p_lookup:35"],
        capture_output=True, text=True, timeout=60, env=ENV, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    errors = [int(n) for n in re.findall(r"Errors: (\d+)", out.stdout)]
    assert len(errors) == 4 and sum(errors) == 0, out.stdout
    total = int(re.search(r"Total Messages: (\d+)", out.stdout).group(1))  # type: ignore[union-attr]
    assert total > 1000
    assert ctl.metric('kvpool_controller_messages_total{type="BatchedP2PLookupMsg"}') > 0


def test_allowlist_and_token_against_stock_workers(controllers: Any, tmp_path: Path) -> None:
    """The controller of a rendered domain: only the ids in its --instances-file may register,
    and its mutating routes need the API token (from the env, as the operator's Secret gives
    it). A stock LMCache worker with another id is refused, counted (metrics and /v1/stats) and
    logged by id, and stays out: LMCache 0.5.6 never registers again after a refusal (its
    heartbeat socket comes with the registration's reply), which is why the operator allows a
    new id before it creates the pod. Allowed with the token (PUT /v1/instances, as the
    operator does), a worker started afterwards registers; /clear wants the token."""
    token = "t0k3n-" + "x" * 40
    allowed = tmp_path / "instances.json"
    allowed.write_text(json.dumps({"instance_ids": ["a~0123456789ab"]}))
    ctl = controllers(
        "--fingerprint", "0123456789ab", "--instances-file", str(allowed),
        env={"KVPOOL_CONTROLLER_API_TOKEN": token},
    )  # fmt: skip
    auth = {"Authorization": f"Bearer {token}"}

    def registered() -> list[str]:
        infos = ctl.post("/query_worker_info", {"instance_id": "all"})["worker_infos"]
        return [i["instance_id"] for i in infos]

    b = LMCacheSide("b~0123456789ab", ctl.ports, free_port())
    c: LMCacheSide | None = None
    try:
        refusals = 'kvpool_controller_refusals_total{reason="unknown_instance"}'
        wait_until(lambda: ctl.metric(refusals) >= 1, what="refusal of an unknown id")
        stats = httpx.get(f"{ctl.url}/v1/stats", timeout=5).json()
        assert stats["refusals"]["unknown_instance"] >= 1
        assert "not one the operator rendered" in stats["refused"]["b~0123456789ab"]
        assert "refusing instance b~0123456789ab" in ctl.log.read_text()
        assert registered() == []

        body = {"instance_ids": ["a~0123456789ab", "c~0123456789ab"]}
        refused = httpx.put(f"{ctl.url}/v1/instances", json=body, timeout=5)
        assert refused.status_code == 401 and "Authorization: Bearer" in refused.text
        r = httpx.put(f"{ctl.url}/v1/instances", json=body, headers=auth, timeout=5)
        assert r.json() == {**body, "source": "operator"}
        c = LMCacheSide("c~0123456789ab", ctl.ports, free_port())
        wait_until(lambda: registered() == ["c~0123456789ab"], what="registration of c")
        clear = {"instance_id": "c~0123456789ab", "location": "LocalCPUBackend"}
        assert httpx.post(f"{ctl.url}/clear", json=clear, timeout=10).status_code == 401
        done = httpx.post(f"{ctl.url}/clear", json=clear, headers=auth, timeout=10)
        assert done.status_code == 200, done.text
        assert registered() == ["c~0123456789ab"]  # b never came back
    finally:
        b.close()
        if c is not None:
            c.close()
    assert token not in ctl.log.read_text()
