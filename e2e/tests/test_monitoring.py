"""End to end: a real Prometheus scrapes a running simulated domain the way the chart's
ServiceMonitors would, and every dashboard query and alert metric has series.

Why: the ServiceMonitors, the alerts and the dashboards are definitions; only a real Prometheus
(Debian's 2.42, started by ``kvpool-operator up --monitoring`` on 127.0.0.1) scraping the real
controller, gateway and workers shows that their selectors pick the right targets, that the
relabelling names each worker by its instance, and that every query a panel or an alert makes
finds the metrics it names. ``tests/sim-small.yaml`` (4 simulated instances, ``--sim-host``) is
enough for everything but what only the real LMCache engine has (PD, P2P pulls, full syncs):
``test_local_stack.py`` checks those on the cpu-demo domain.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from promcheck import firing, query, rule_health, wait_for_series
from upstack import chat, messages, poll

from kvpool.operator.local.stack import pid_alive
from kvpool.operator.local.up import UpProcess
from kvpool.operator.monitoring.alerts import ALERTS
from kvpool.operator.monitoring.panels import Needs

DOMAIN = Path(__file__).resolve().parent / "sim-small.yaml"
INSTANCES = [f"simsmall-sim-{i}" for i in range(4)]
READY_S = 180.0


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    proc = UpProcess([str(DOMAIN)], tmp_path_factory.mktemp("up"), sim_host=True, monitoring=True)
    try:
        proc.start(READY_S)
        yield proc
    finally:
        proc.stop()


def test_prometheus_scrapes_the_targets_the_service_monitors_select(up: UpProcess) -> None:
    prometheus = up.state()["endpoints"]["prometheus"]
    assert prometheus.startswith("http://127.0.0.1:")

    def scraped() -> dict[str, Any] | None:  # discovery and the first scrapes take a moment
        data: dict[str, Any] = httpx.get(f"{prometheus}/api/v1/targets", timeout=10).json()["data"]
        up = [t for t in data["activeTargets"] if t["health"] == "up"]
        return data if len(up) == 2 + len(INSTANCES) else None

    targets = poll("every target scraped", scraped, 60.0)
    active = [t["labels"] for t in targets["activeTargets"]]
    by_job: dict[str, list[dict[str, str]]] = {}
    for labels in active:
        assert labels["namespace"] == "default" and labels["pool"] == "simsmall", labels
        by_job.setdefault(labels["job"], []).append(labels)
    assert sorted(by_job) == ["kvpool-controller", "kvpool-gateway", "kvpool-worker"]
    assert [t["service"] for t in by_job["kvpool-controller"]] == ["simsmall-controller"]
    assert [t["service"] for t in by_job["kvpool-gateway"]] == ["simsmall-gateway"]
    workers = sorted(by_job["kvpool-worker"], key=lambda t: t["instance"])
    assert [t["instance"] for t in workers] == INSTANCES  # once each, by kvpool instance name
    assert {t["member"] for t in workers} == {"simsmall-sim"}
    assert [t["pod"] for t in workers] == [f"{i}-0" for i in INSTANCES]
    # the member Service selects every instance too; the worker job drops it
    dropped = {d["discoveredLabels"].get("__meta_kubernetes_service_name")
               for d in targets["droppedTargets"]}  # fmt: skip
    assert "simsmall-sim" in dropped


def test_every_dashboard_query_and_alert_metric_has_series(up: UpProcess) -> None:
    state = up.state()
    prometheus, gateway = state["endpoints"]["prometheus"], state["endpoints"]["simsmall-gateway"]
    msgs = messages("the observed harbor", 120)
    first = chat(gateway, msgs)
    again = chat(gateway, msgs)
    assert again.headers["x-kvpool-route-reason"] == "kv-hit", again.headers
    assert again.cached > 0 and first.text
    # evictions: the memory API drops the prompt's chunks from every tier that holds them
    evicted = httpx.post(f"{gateway}/memory/evict", json={"messages": msgs}, timeout=30)
    assert evicted.status_code == 200, evicted.text
    assert chat(gateway, messages("the second harbor", 60)).text  # the index holds KV again
    wait_for_series(prometheus, Needs.ANY)
    hits = query(prometheus, 'sum(kvpool_worker_prefix_hit_tokens_total{pool="simsmall"})')
    assert float(hits[0]["value"][1]) >= again.cached


def test_the_alerts_evaluate_and_none_fires_on_a_healthy_domain(up: UpProcess) -> None:
    prometheus = up.state()["endpoints"]["prometheus"]
    health = rule_health(prometheus)
    assert set(health) == {a.name for a in ALERTS}
    assert set(health.values()) == {"ok"}, health
    assert firing(prometheus) == []


def test_down_stops_prometheus_too(up: UpProcess) -> None:
    pgid = int(up.state()["processes"]["prometheus"]["pgid"])
    assert up.stop() == 0, up.output.read_text()[-3000:]
    assert not pid_alive(pgid)
