"""The domains' monitoring, offline: the chart ships what kvpool.operator.monitoring defines,
Prometheus' own parsers accept the local scrape configuration and every dashboard query, and
every metric a query or an alert reads is catalogued (and listed in operator/README.md).

What a running Prometheus makes of it (series for every query, the relabelled targets) is
e2e/tests/test_monitoring.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml
from op_builders import EXAMPLES, REPO

from kvpool.operator.loader import load_text
from kvpool.operator.monitoring import alerts, catalog, grafana, panels, scrape
from kvpool.operator.quantity import parse_quantity
from kvpool.operator.render import render_domain
from kvpool.operator.render.member_objects import MEMORY_BUDGET_ENV

CHART = REPO / "charts" / "kvpool"
VALUES = yaml.safe_load((CHART / "ci" / "monitoring-values.yaml").read_text())


def _render(values: dict[str, Any]) -> list[dict[str, Any]]:
    manifests = helm.Chart.load(CHART).render(
        values, name="kvpool", namespace="kvpool-system", is_install=True
    )
    return [d for p, t in sorted(manifests.items()) if p.endswith(".yaml") for d in
            yaml.safe_load_all(t) if d]  # fmt: skip


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert shutil.which("promtool"), "promtool missing: run tools/ensure-system-deps.sh"
    return subprocess.run(
        ["promtool", *args], capture_output=True, text=True, timeout=60, check=False
    )


def _domain(example: Path) -> list[dict[str, Any]]:
    (domain,) = load_text(example.read_text(), str(example)).domains()
    return render_domain(domain.pool, domain.members)


# --------------------------------------------------------------------------- the chart
def test_chart_ships_one_service_monitor_per_job_as_defined() -> None:
    docs = _render(VALUES)
    monitors = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ServiceMonitor"}
    interval = VALUES["monitoring"]["serviceMonitors"]["interval"]
    for job in scrape.JOBS:
        sm = monitors[f"kvpool-operator-{job.component}s"]
        assert sm["metadata"]["labels"]["release"] == "prometheus"
        assert sm["spec"]["namespaceSelector"] == {"matchNames": ["llm", "batch"]}
        spec = {k: v for k, v in sm["spec"].items() if k != "namespaceSelector"}
        assert spec == scrape.service_monitor_spec(job, interval)
    everywhere = _render({"monitoring": {"serviceMonitors": {"enabled": True}}})
    for sm in (d for d in everywhere if d["kind"] == "ServiceMonitor"):
        assert sm["spec"]["namespaceSelector"] == {"any": True}
        assert sm["spec"]["endpoints"][0]["interval"] == "15s"


def test_chart_ships_the_alerts_and_the_dashboards() -> None:
    docs = _render(VALUES)
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    assert rule["spec"] == alerts.rule_groups()
    maps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    files = grafana.dashboard_files()
    assert len(maps) == len(files) == len(panels.DASHBOARDS)
    for path, text in files.items():
        name = Path(path).name
        cm = maps[f"kvpool-operator-{Path(path).stem}"]
        assert cm["metadata"]["namespace"] == "monitoring"
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "kvpool"}
        assert json.loads(cm["data"][name]) == json.loads(text)
    assert not [d for d in _render({}) if d["kind"] in ("ServiceMonitor", "PrometheusRule")]


# --------------------------------------------------------------------------- Prometheus' parsers
def test_local_scrape_config_is_valid_and_selects_like_the_service_monitors(
    tmp_path: Path,
) -> None:
    objects = _domain(REPO / "e2e" / "tests" / "sim-small.yaml")
    ports = {p: 30000 + i for i, p in enumerate(range(1, 70000))}  # any container port
    config = scrape.prometheus_config(objects, ports, "2s", [str(REPO / alerts.RULES_PATH)])
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    out = _promtool("check", "config", str(path))
    assert out.returncode == 0, out.stdout + out.stderr
    targets = scrape.discovered_targets(objects, ports)
    member = [t for t in targets if t["labels"][scrape.META + "service_name"] == "simsmall-sim"]
    assert len(member) == 4  # the member Service selects every instance ...
    assert all(scrape.service_label_present("kvpool.io/instance") not in t["labels"]
               for t in member)  # ... and lacks the label the worker job requires  # fmt: skip
    # the controller's two replicas (the default): its Service selects the leader by a label the
    # elected replica sets at run time; one target per Service port, reaching the leader
    name = scrape.META + "service_name"
    controller = [t for t in targets if t["labels"][name] == "simsmall-controller"]
    assert [t["labels"][scrape.META + "endpoint_port_name"] for t in controller].count("http") == 1


def test_every_dashboard_query_parses(tmp_path: Path) -> None:
    rules = [
        {"record": f"kvpool:check_{i}", "expr": panels.instantiate(q.expr)}
        for i, q in enumerate(q for d in panels.DASHBOARDS for p in d.panels for q in p.queries)
    ]
    path = tmp_path / "queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "q", "rules": rules}]}))
    out = _promtool("check", "rules", str(path))
    assert out.returncode == 0, out.stdout + out.stderr


def test_dashboards_are_unique_and_every_panel_queries_the_chosen_datasource() -> None:
    uids = [d.uid for d in panels.DASHBOARDS]
    assert len(set(uids)) == len(uids) == 5
    for text in grafana.dashboard_files().values():
        model = json.loads(text)
        assert [v["name"] for v in model["templating"]["list"]][:3] == [
            "datasource", "namespace", "pool"
        ]  # fmt: skip
        for panel in model["panels"]:
            assert panel["datasource"]["uid"] == "${datasource}"
            assert panel["targets"] and all(t["expr"] for t in panel["targets"])


# --------------------------------------------------------------------------- the catalogue
def test_every_metric_read_is_catalogued_and_every_catalogued_one_is_read() -> None:
    names = [m.name for m in catalog.METRICS]
    assert len(set(names)) == len(names)
    assert catalog.used_metrics() == set(names)


def test_the_readme_lists_the_catalogue() -> None:
    readme = (REPO / "operator" / "README.md").read_text(encoding="utf-8")
    assert catalog.markdown_table() in readme


@pytest.mark.parametrize("example", ["cpu-demo.yaml", "sim-fleet.yaml", "cuda-pd.yaml"])
def test_workers_are_told_their_pod_memory_request(example: str) -> None:
    for obj in _domain(EXAMPLES / example):
        if obj["kind"] != "StatefulSet":
            continue
        (container,) = obj["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        request = container.get("resources", {}).get("requests", {}).get("memory")
        if request is None:
            assert MEMORY_BUDGET_ENV not in env
        else:
            assert env[MEMORY_BUDGET_ENV] == str(parse_quantity(request))


def test_the_crds_and_the_runtime_import_without_the_dashboard_builder() -> None:
    """grafana-foundation-sdk is a generate-time dependency: with it unimportable, gen (its CRDs,
    used by the local cluster) and the runtime still import (import-linter keeps its direct
    importers to monitoring.grafana, this checks the lazy import in chartgen)."""
    code = (
        "import sys; sys.modules['grafana_foundation_sdk'] = None\n"
        "import kvpool.operator.gen, kvpool.operator.runtime.handlers, kvpool.operator.local.up\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
