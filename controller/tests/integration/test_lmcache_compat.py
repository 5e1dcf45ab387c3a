"""Stock LMCache worker code and LMCache's controller benchmark against our controller.

Real LMCache on both sides of the wire: ``LMCacheWorker`` registers, heartbeats and answers
control requests; ``LocalCPUBackend`` puts/removes emit admit/evict batches through LMCache's
``BatchedMessageSender``; the P2P lookup is LMCache's own request path. The only stand-in is
the engine object the worker holds (see ``lmcache_side.py``).
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

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
