"""End to end: two controller replicas under ``kvpool-operator up``; kill -9 the leader.

Why: leader election (controller ``ha.py``) is only worth something if the processes a user
runs survive the leader's death without the workers noticing. ``tests/sim-small.yaml`` with
``spec.controller.replicas: 2`` runs as real processes: two ``kvpool-controller`` replicas
electing on the Lease of ``up``'s API stand-in (the same client code a cluster's API server
answers), the controller Service as ``up``'s proxy selecting the pod labelled ``leader``, four
simulated workers and the gateway's two replicas (behind their Service's proxy too), all
reaching the controller through that Service. After a long prompt is indexed, the leader's
process group gets SIGKILL: the standby leads the same epoch in term 1 with every worker and
chunk it had, no worker registers again or full-syncs (the new leader counts no RegisterMsg and
no full sync), the gateway routes the prompt to the instance holding it again (``kv-hit``),
and the killed replica, restarted by ``up``, rejoins as the standby. The takeover time is
printed (no timed assertion: the box is shared).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from upstack import CHUNK, chat, messages, metric, poll, prefix_hits, registered, tokens

from kvpool.operator.local.up import UpProcess

DOMAIN = Path(__file__).resolve().parent / "sim-small.yaml"
CONTROLLER = "simsmall-controller"
READY_S = 180.0


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    root = tmp_path_factory.mktemp("ha")
    docs = [d for d in yaml.safe_load_all(DOMAIN.read_text()) if d]
    docs[0]["spec"]["controller"] = {"replicas": 2}
    domain = root / "sim-small-ha.yaml"
    domain.write_text(yaml.safe_dump_all(docs))
    proc = UpProcess([str(domain)], root / "up")
    try:
        proc.start(READY_S)
        yield proc
    finally:
        proc.stop()


def _election(url: str) -> dict[str, Any] | None:
    try:
        election: dict[str, Any] = httpx.get(f"{url}/readyz", timeout=2).json()["election"]
    except (httpx.HTTPError, ValueError, KeyError):
        return None
    return election


def test_the_standby_takes_over_when_the_leader_is_killed(up: UpProcess) -> None:
    state = up.state()
    replicas = state["replicas"][CONTROLLER]
    assert replicas == [f"{CONTROLLER}-0", f"{CONTROLLER}-1"]
    assert state["replicas"]["simsmall-gateway"] == ["simsmall-gateway-0", "simsmall-gateway-1"]
    endpoints = state["endpoints"]
    service, gateway = endpoints[CONTROLLER], endpoints["simsmall-gateway"]
    (leader,) = poll("one replica behind the Service", lambda: up.state()["selected"][CONTROLLER])
    (standby,) = set(replicas) - {leader}
    assert (_election(endpoints[leader]) or {}).get("role") == "leader"

    msgs = messages("the replicated harbor", 120)
    toks = tokens(endpoints["simsmall-sim-0"], msgs)
    full = len(toks) // CHUNK
    first = chat(gateway, msgs)
    served = first.headers["x-kvpool-instance"]
    hits = poll("the prefix indexed", lambda: prefix_hits(service, toks))
    (served_id,) = [i for i in hits if i.startswith(f"{served}~")]
    poll("indexed in full", lambda: prefix_hits(service, toks).get(served_id, 0) >= full)
    copy = poll(
        "the standby's copy holding the prefix",
        lambda: (e := _election(endpoints[standby]))
        and e["standby"]["warm"]
        and e["standby"]["chunk_locations"] >= full
        and e,
    )
    before = httpx.get(f"{service}/", timeout=5).json()
    workers = httpx.get(f"{service}/readyz", timeout=5).json()["workers"]

    pgid = int(up.state()["processes"][leader]["pgid"])
    killed = time.monotonic()
    os.killpg(pgid, signal.SIGKILL)
    new = poll(
        "the standby leading behind the Service",
        lambda: (e := _election(service))
        and e["role"] == "leader"
        and e["identity"] == copy["identity"]
        and e,
        60,
    )
    took = time.monotonic() - killed
    print(f"\ntakeover after SIGKILL of the leader: {took:.2f} s")
    after = httpx.get(f"{service}/", timeout=5).json()
    assert after["epoch"] == before["epoch"] and after["term"] == before["term"] + 1
    assert new["term"] == after["term"]
    assert httpx.get(f"{service}/readyz", timeout=5).json()["workers"] == workers
    assert prefix_hits(service, toks).get(served_id, 0) >= full  # the index, intact
    assert metric(service, "kvpool_controller_messages_total", '{type="RegisterMsg"}') == 0
    assert metric(service, "kvpool_controller_full_syncs_total", '{outcome="completed"}') == 0
    assert registered(service, served_id)
    again = poll(
        "the gateway routing on the index again",
        lambda: (r := chat(gateway, msgs)).headers.get("x-kvpool-route-reason") == "kv-hit" and r,
        60,
    )
    assert again.headers["x-kvpool-instance"] == served
    poll(
        "the killed replica back as the standby",
        lambda: (e := _election(up.state()["endpoints"][leader])) and e["role"] == "standby",
        READY_S,
    )
    assert up.state()["selected"][CONTROLLER] == [standby]
