"""The alerts of a cache domain, as Prometheus alerting rules (the chart's PrometheusRule).

Why these: each one is a way a KV pool fails quietly — requests keep being answered while the
cache stops paying off, so nothing else pages. The hit ratio collapses (a rollout changed what
is hashed, a tier died, the router lost its index); a worker of another domain fingerprint is
refused (someone deployed with the wrong seed or chunk size: its KV would have been 0 % hits);
the controller is down or falls behind (routing goes blind); PD transfers wait in a decoder's
buffer (nobody claims them, every later push stalls); LMCache stays frozen after a full sync
(every store dropped); the gateway answers 5xx or cuts an instance off with its breaker; a
worker outgrows the memory the operator budgeted for it (the node's other pods are next).

Every expression groups by ``namespace`` and ``pool`` (target labels of the ServiceMonitors,
``kvpool.operator.monitoring.scrape``), so one rule serves every domain. The rules file is
written to ``charts/kvpool/monitoring/alerts.yaml`` (``python -m kvpool.operator.gen``); the
chart wraps it in a PrometheusRule, ``kvpool-operator up --monitoring`` loads it, and
``operator/tests/unit/test_alert_rules.py`` runs ``promtool test rules`` on it. Annotations use
only ``$labels`` (no ``$value``), so a test states them exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

RULES_PATH = "charts/kvpool/monitoring/alerts.yaml"
GROUP = "kvpool.rules"
BY = "namespace, pool"


@dataclass(frozen=True)
class Alert:
    """One alerting rule."""

    name: str
    expr: str
    for_: str
    severity: str  # "critical" pages, "warning" tickets
    summary: str
    description: str

    def rule(self) -> dict[str, Any]:
        return {
            "alert": self.name,
            "expr": self.expr,
            "for": self.for_,
            "labels": {"severity": self.severity},
            "annotations": {"summary": self.summary, "description": self.description},
        }


def _ratio(num: str, den: str, window: str, offset: str = "") -> str:
    off = f" offset {offset}" if offset else ""
    return (
        f"sum by ({BY}) (rate({num}[{window}]{off}))\n"
        f"  / sum by ({BY}) (rate({den}[{window}]{off}))"
    )


_HIT = "kvpool_worker_prefix_hit_tokens_total"
_PROMPT = "kvpool_worker_prompt_tokens_total"
HIT_RATIO_NOW = _ratio(_HIT, _PROMPT, "10m")
HIT_RATIO_HOUR_AGO = _ratio(_HIT, _PROMPT, "10m", "1h")

ALERTS: tuple[Alert, ...] = (
    Alert(
        "KvpoolHitRatioCollapse",
        f"(\n  {HIT_RATIO_NOW}\n)\n< 0.5 * (\n  {HIT_RATIO_HOUR_AGO}\n)\n"
        f"and on ({BY}) (\n  {HIT_RATIO_HOUR_AGO}\n) > 0.2",
        "10m",
        "warning",
        "KV hit ratio of pool {{ $labels.namespace }}/{{ $labels.pool }} fell by more than half",
        "The share of prompt tokens served from the KV cache over the last 10 minutes is less "
        "than half of what it was an hour before. Look for a rollout that changed the domain "
        "fingerprint, a tier that went down, or a gateway routing without its index.",
    ),
    Alert(
        "KvpoolFingerprintRefused",
        f"sum by ({BY}) (increase(kvpool_controller_refusals_total"
        '{reason="fingerprint"}[10m])) > 0',
        "0m",
        "warning",
        "Pool {{ $labels.namespace }}/{{ $labels.pool }}'s controller refused a worker of "
        "another domain fingerprint",
        "A worker registered with a different seed, chunk size, model or hash algorithm; the "
        "controller refused it (its KV would never hit). Check the worker's "
        "KVPOOL_DOMAIN_FINGERPRINT and PYTHONHASHSEED against the pool's status.",
    ),
    Alert(
        "KvpoolControllerDown",
        'up{job="kvpool-controller"} == 0',
        "2m",
        "critical",
        "Controller of pool {{ $labels.namespace }}/{{ $labels.pool }} does not answer",
        "Prometheus cannot scrape the KV controller for 2 minutes: workers cannot register or "
        "report KV, and the gateway routes on a stale index or by load only.",
    ),
    Alert(
        "KvpoolControllerLagging",
        f"histogram_quantile(0.99, sum by ({BY}, le) "
        "(rate(kvpool_controller_loop_lag_seconds_bucket[5m]))) > 0.1\n"
        f"or sum by ({BY}) (rate(kvpool_controller_backlog_seconds_total[5m])) > 0.5",
        "5m",
        "warning",
        "Controller of pool {{ $labels.namespace }}/{{ $labels.pool }} is falling behind",
        "Its event loop runs more than 100 ms late (p99), or admit/evict messages were waiting "
        "on its PULL socket more than half of the time: the index the gateway routes on "
        "trails what the workers hold.",
    ),
    Alert(
        "KvpoolPDTransfersWaiting",
        "min_over_time(kvpool_engine_pd_buffer_chunks[10m]) > 0\n"
        "or kvpool_engine_pd_buffer_used_bytes / kvpool_engine_pd_buffer_capacity_bytes > 0.8",
        "5m",
        "warning",
        "PD transfers wait in decoder {{ $labels.instance }} of pool "
        "{{ $labels.namespace }}/{{ $labels.pool }}",
        "The decoder's PD buffer has held unclaimed transfers for 10 minutes, or is more than "
        "80 % full: prefills are pushed but no decode claims them, and new pushes will stall.",
    ),
    Alert(
        "KvpoolLMCacheFrozen",
        "min_over_time(kvpool_engine_lmcache_frozen[1m]) == 1",
        "1m",
        "warning",
        "LMCache of {{ $labels.instance }} (pool {{ $labels.namespace }}/{{ $labels.pool }}) "
        "is frozen",
        "A full sync with the controller normally freezes LMCache for about a second; it has "
        "been frozen for over two minutes, dropping every store.",
    ),
    Alert(
        "KvpoolGateway5xx",
        f'sum by ({BY}) (rate(kvpool_gateway_requests_total{{status=~"5.."}}[5m]))\n'
        f"  / sum by ({BY}) (rate(kvpool_gateway_requests_total[5m])) > 0.05",
        "5m",
        "critical",
        "Gateway of pool {{ $labels.namespace }}/{{ $labels.pool }} answers over 5 % of "
        "requests with 5xx",
        "More than 5 % of requests failed in the gateway or upstream for 5 minutes.",
    ),
    Alert(
        "KvpoolGatewayBreakerOpen",
        f"max by ({BY}, instance) (kvpool_gateway_breaker_open) > 0",
        "2m",
        "warning",
        "The gateway's breaker for {{ $labels.instance }} (pool "
        "{{ $labels.namespace }}/{{ $labels.pool }}) is open",
        "Requests to this instance failed repeatedly; the gateway has cut it off for 2 minutes "
        "and routes its KV prefixes elsewhere (misses).",
    ),
    Alert(
        "KvpoolWorkerMemoryOverBudget",
        'process_resident_memory_bytes{job="kvpool-worker"} > kvpool_worker_memory_budget_bytes',
        "10m",
        "warning",
        "Worker {{ $labels.instance }} (pool {{ $labels.namespace }}/{{ $labels.pool }}) uses "
        "more memory than its budget",
        "Its resident memory exceeds the memory request the operator rendered for its pod "
        "(LMCache's pinned buffers plus the engine's request) for 10 minutes: the node may run "
        "out of memory for its other pods.",
    ),
)


def rule_groups() -> dict[str, Any]:
    """The rules file (``groups:``), as Prometheus and the PrometheusRule's spec take it."""
    return {"groups": [{"name": GROUP, "rules": [a.rule() for a in ALERTS]}]}


def rules_yaml(header: str) -> str:
    return header + yaml.safe_dump(rule_groups(), sort_keys=False, width=100)
