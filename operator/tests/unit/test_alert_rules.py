"""Every alert of the chart, unit-tested by Prometheus' own ``promtool test rules``.

Each case feeds synthetic series (the labels the ServiceMonitors give: ``namespace``, ``pool``,
``job``, ``instance``) to the generated rules file as shipped (charts/kvpool/monitoring/
alerts.yaml), and states at which evaluation time nothing fires and when exactly which alert
fires, with its labels and rendered annotations. promtool comes with Debian's ``prometheus``
(tools/ensure-system-deps.sh installs it); each run is bounded to 60 s.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from op_builders import REPO

from kvpool.operator.monitoring.alerts import ALERTS, RULES_PATH, Alert

DOMAIN = 'namespace="ns", pool="p"'
L = {"namespace": "ns", "pool": "p"}
W = "kvpool-worker"


def _series(name: str, labels: str, values: str) -> dict[str, str]:
    return {"series": f"{name}{{{labels}}}", "values": values}


#: alert -> (input series, [(eval time, [expected alert labels])]); an empty list: quiet then.
CASES: dict[str, tuple[list[dict[str, str]], list[tuple[str, list[dict[str, str]]]]]] = {
    "KvpoolHitRatioCollapse": (
        [
            _series("kvpool_worker_prompt_tokens_total", f'{DOMAIN}, instance="w0"', "0+1000x150"),
            # 80 % of prompt tokens hit for 100 minutes, then 5 %
            _series(
                "kvpool_worker_prefix_hit_tokens_total",
                f'{DOMAIN}, instance="w0"',
                "0+800x100 80000+50x50",
            ),
            # another pool that stays at 50 %: never fires
            _series("kvpool_worker_prompt_tokens_total", 'namespace="ns", pool="q"', "0+100x150"),
            _series(
                "kvpool_worker_prefix_hit_tokens_total", 'namespace="ns", pool="q"', "0+50x150"
            ),
        ],
        [("90m", []), ("150m", [L])],
    ),
    "KvpoolFingerprintRefused": (
        [
            _series(
                "kvpool_controller_refusals_total", f'{DOMAIN}, reason="fingerprint"', "0x10 1x20"
            ),
        ],
        [("8m", []), ("12m", [L]), ("25m", [])],
    ),
    "KvpoolControllerDown": (
        [
            _series("up", f'job="kvpool-controller", {DOMAIN}, instance="c:9000"', "1x5 0x10"),
            _series("up", f'job="kvpool-gateway", {DOMAIN}, instance="g:8000"', "0x15"),
        ],
        [
            ("4m", []),
            ("10m", [{"job": "kvpool-controller", **L, "instance": "c:9000"}]),
        ],
    ),
    "KvpoolControllerLagging": (
        [
            # pool p: every tick on time for 20 minutes, then every one later than 250 ms
            *(
                _series(
                    "kvpool_controller_loop_lag_seconds_bucket",
                    f'{DOMAIN}, le="{le}"',
                    "0+600x20 12000x20",
                )
                for le in ("0.01", "0.1", "0.25")
            ),
            _series(
                "kvpool_controller_loop_lag_seconds_bucket", f'{DOMAIN}, le="+Inf"', "0+600x40"
            ),
            # pool q: a backlog 10 % of the time, then 90 %
            _series(
                "kvpool_controller_backlog_seconds_total",
                'namespace="ns", pool="q"',
                "0+6x20 120+54x20",
            ),
        ],
        [("15m", []), ("35m", [L, {"namespace": "ns", "pool": "q"}])],
    ),
    "KvpoolPDTransfersWaiting": (
        [
            # decoder d0: transfers come and go, then four stay unclaimed
            _series(
                "kvpool_engine_pd_buffer_chunks",
                f'job="{W}", {DOMAIN}, instance="d0"',
                "0 2 0 3 0x5 4x21",
            ),
            # decoder d1: its buffer 90 % full from minute 10
            _series(
                "kvpool_engine_pd_buffer_used_bytes",
                f'job="{W}", {DOMAIN}, instance="d1"',
                "0x10 900x20",
            ),
            _series(
                "kvpool_engine_pd_buffer_capacity_bytes",
                f'job="{W}", {DOMAIN}, instance="d1"',
                "1000x30",
            ),
        ],
        [
            ("8m", []),
            (
                "30m",
                [
                    {"job": W, **L, "instance": "d0"},
                    {"job": W, **L, "instance": "d1"},
                ],
            ),
        ],
    ),
    "KvpoolLMCacheFrozen": (
        [
            # a one-minute freeze (a full sync) at minute 6, then frozen from minute 10 on
            _series("kvpool_engine_lmcache_frozen", f'{DOMAIN}, instance="w0"', "0x5 1 0x3 1x10"),
        ],
        [("8m", []), ("15m", [{**L, "instance": "w0"}])],
    ),
    "KvpoolGateway5xx": (
        [
            _series(
                "kvpool_gateway_requests_total",
                f'{DOMAIN}, endpoint="chat", status="200"',
                "0+100x20",
            ),
            _series(
                "kvpool_gateway_requests_total",
                f'{DOMAIN}, endpoint="chat", status="502"',
                "0x5 0+10x15",
            ),
        ],
        [("4m", []), ("15m", [L])],
    ),
    "KvpoolGatewayBreakerOpen": (
        [
            _series(
                "kvpool_gateway_breaker_open", f'{DOMAIN}, instance="w1", pod="g-0"', "0x5 1x10"
            ),
            _series("kvpool_gateway_breaker_open", f'{DOMAIN}, instance="w0", pod="g-0"', "0x15"),
        ],
        [("4m", []), ("10m", [{**L, "instance": "w1"}])],
    ),
    "KvpoolWorkerMemoryOverBudget": (
        [
            _series(
                "process_resident_memory_bytes",
                f'job="{W}", {DOMAIN}, instance="w0"',
                "100x5 300x15",
            ),
            _series(
                "kvpool_worker_memory_budget_bytes", f'job="{W}", {DOMAIN}, instance="w0"', "200x20"
            ),
            # no budget rendered: never compared
            _series(
                "process_resident_memory_bytes", f'job="{W}", {DOMAIN}, instance="w1"', "900x20"
            ),
        ],
        [("4m", []), ("18m", [{"job": W, **L, "instance": "w0"}])],
    ),
}

_LABEL = re.compile(r"\{\{ \$labels\.(\w+) \}\}")


def _annotations(alert: Alert, labels: dict[str, str]) -> dict[str, str]:
    """The alert's annotations as Prometheus renders them for ``labels``."""

    def fill(text: str) -> str:
        return _LABEL.sub(lambda m: labels.get(m.group(1), ""), text)

    return {"summary": fill(alert.summary), "description": fill(alert.description)}


def _test_file(alert: Alert) -> dict[str, Any]:
    series, evals = CASES[alert.name]
    checks = []
    for at, fired in evals:
        exp = [
            {
                "exp_labels": {**labels, "severity": alert.severity},
                "exp_annotations": _annotations(alert, labels),
            }
            for labels in fired
        ]
        checks.append({"eval_time": at, "alertname": alert.name, "exp_alerts": exp})
    return {
        "rule_files": [str(REPO / RULES_PATH)],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": checks}],
    }


def test_every_alert_has_a_case() -> None:
    assert set(CASES) == {a.name for a in ALERTS}


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert shutil.which("promtool"), "promtool missing: run tools/ensure-system-deps.sh (make test)"
    return subprocess.run(
        ["promtool", *args], capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.parametrize("alert", ALERTS, ids=[a.name for a in ALERTS])
def test_alert_fires_when_and_only_when_it_should(alert: Alert, tmp_path: Path) -> None:
    path = tmp_path / f"{alert.name}.test.yaml"
    path.write_text(yaml.safe_dump(_test_file(alert), sort_keys=False), encoding="utf-8")
    out = _promtool("test", "rules", str(path))
    assert out.returncode == 0, out.stdout + out.stderr


def test_promtool_accepts_the_rules_file() -> None:
    out = _promtool("check", "rules", str(REPO / RULES_PATH))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in out.stdout
