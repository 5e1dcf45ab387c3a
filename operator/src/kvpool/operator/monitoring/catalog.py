"""Every metric the dashboards and alerts read: its name, the component that exports it, what
it means.

Why a catalogue: a panel that reads a metric nobody exports draws nothing and says nothing;
``operator/tests/unit/test_monitoring.py`` checks that every metric a query or an alert names is
listed here, and that operator/README.md's table is exactly this one (``markdown_table``).
Histograms are listed by their base name (``_bucket``/``_sum``/``_count`` are theirs).
``needs`` tells the e2e suite which running domain must have series of it (as in ``panels``).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.operator.monitoring.alerts import ALERTS
from kvpool.operator.monitoring.panels import DASHBOARDS, Needs, metric_names


@dataclass(frozen=True)
class Metric:
    name: str
    component: str
    meaning: str
    needs: Needs = Needs.ANY  # LMCACHE: only the real LMCache engine with P2P and PD has it


_W, _C, _G, _P = "worker", "controller", "gateway", "Prometheus"
LM = Needs.LMCACHE

METRICS: tuple[Metric, ...] = (
    Metric(
        "up",
        _P,
        "1 while the target's last scrape succeeded (job kvpool-controller/-gateway/-worker)",
    ),
    Metric("kvpool_worker_prompt_tokens_total", _W, "prompt tokens of served requests"),
    Metric(
        "kvpool_worker_prefix_hit_tokens_total",
        _W,
        "prompt tokens whose KV came from a cache (any tier) instead of prefill",
    ),
    Metric(
        "kvpool_worker_ttft_seconds",
        _W,
        "histogram: time from handing a request to the engine to its first token, by endpoint",
    ),
    Metric(
        "kvpool_worker_memory_budget_bytes",
        _W,
        "the memory request the operator rendered for the worker's pod (env "
        "KVPOOL_WORKER_MEMORY_BUDGET_BYTES)",
    ),
    Metric(
        "process_resident_memory_bytes",
        _W,
        "the worker process's resident memory (in `kvpool-worker host`, the shared process's)",
    ),
    Metric(
        "kvpool_engine_cached_tokens_total",
        _W,
        "prompt tokens served from each tier (`tier`: device, local_cpu, local_disk, p2p, ...)",
    ),
    Metric("kvpool_engine_stored_bytes", _W, "KV bytes written to each tier, cumulative (`tier`)"),
    Metric(
        "kvpool_engine_evicted_chunks_total",
        _W,
        "KV chunks evicted from each tier (`tier`; simulated engine)",
    ),
    Metric(
        "kvpool_engine_tier_used_bytes",
        _W,
        "KV bytes held in each tier now (`tier`; simulated engine)",
    ),
    Metric("kvpool_engine_kv_cache_usage", _W, "share of the engine's device KV blocks in use"),
    Metric("kvpool_engine_requests_running", _W, "requests in the engine's batch"),
    Metric("kvpool_engine_requests_waiting", _W, "requests queued in the engine"),
    Metric(
        "kvpool_engine_lmcache_frozen",
        _W,
        "1 while LMCache is in a full-sync freeze (stores dropped)",
    ),
    Metric(
        "kvpool_engine_pd_buffer_used_bytes",
        _W,
        "PD decoder: bytes of its receive buffer in use",
        needs=LM,
    ),
    Metric(
        "kvpool_engine_pd_buffer_capacity_bytes",
        _W,
        "PD decoder: size of its receive buffer",
        needs=LM,
    ),
    Metric(
        "kvpool_engine_pd_buffer_chunks",
        _W,
        "PD decoder: transferred chunks waiting for a decode to claim them",
        needs=LM,
    ),
    Metric(
        "kvpool_engine_pd_sent_bytes",
        _W,
        "PD prefill: KV bytes pushed to decoders, cumulative",
        needs=LM,
    ),
    Metric(
        "kvpool_engine_pd_unclaimed_freed_total",
        _W,
        "PD decoder: chunks freed after the unclaimed TTL",
        needs=LM,
    ),
    Metric(
        "kvpool_engine_pd_released_total",
        _W,
        "PD decoder: chunks freed because the gateway released them",
        needs=LM,
    ),
    Metric(
        "kvpool_engine_p2p_or_lower_tier_chunks",
        _W,
        "chunks found at a P2P peer (or a lower tier) and prefetched, cumulative",
        needs=LM,
    ),
    Metric("kvpool_controller_instances", _C, "LMCache instances registered"),
    Metric("kvpool_controller_workers", _C, "LMCache workers (TP ranks) registered"),
    Metric(
        "kvpool_controller_chunk_locations",
        _C,
        "(chunk, worker) entries in the index, by `location` (tier)",
    ),
    Metric("kvpool_controller_messages_total", _C, "protocol messages received, by `type`"),
    Metric(
        "kvpool_controller_lookup_seconds",
        _C,
        "histogram: time to answer a lookup inside the controller, by `kind`",
    ),
    Metric(
        "kvpool_controller_loop_lag_seconds",
        _C,
        "histogram: how late the controller's event loop ran a 100 ms tick (what every lookup, "
        "heartbeat and delta waits)",
    ),
    Metric(
        "kvpool_controller_backlog_seconds_total",
        _C,
        "seconds the PULL socket (admit/evict) still held messages after a drain pass: its rate "
        "is the share of time the index trails the workers",
    ),
    Metric("kvpool_controller_deltas_published_total", _C, "index deltas streamed to gateways"),
    Metric(
        "kvpool_controller_refusals_total",
        _C,
        "registrations refused, by `reason` (fingerprint: another domain's seed, chunk size, "
        "model or hash)",
    ),
    Metric("kvpool_controller_purges_total", _C, "workers purged after missing the heartbeat TTL"),
    Metric(
        "kvpool_controller_persistence_errors_total", _C, "failed Redis reads/writes of the index"
    ),
    Metric(
        "kvpool_controller_full_syncs_total",
        _C,
        "full-sync sessions after a controller restart, by `outcome`",
        needs=LM,
    ),
    Metric("kvpool_gateway_requests_total", _G, "requests answered, by `endpoint` and `status`"),
    Metric(
        "kvpool_gateway_routing_decisions_total",
        _G,
        "routing decisions by `reason` and chosen `instance`",
    ),
    Metric(
        "kvpool_gateway_predicted_hit_tokens_total",
        _G,
        "prompt tokens the router expected the chosen `instance` to hold",
    ),
    Metric("kvpool_gateway_prompt_tokens_total", _G, "prompt tokens routed, by `instance`"),
    Metric(
        "kvpool_gateway_route_ttft_seconds",
        _G,
        "histogram: upstream time to the first byte, by the routing decision's `reason`",
    ),
    Metric(
        "kvpool_gateway_upstream_ttft_seconds",
        _G,
        "histogram: upstream time to the first byte, by routed `instance`",
    ),
    Metric("kvpool_gateway_instance_ready", _G, "1 while an `instance` answers /readyz"),
    Metric(
        "kvpool_gateway_breaker_open",
        _G,
        "1 while the gateway's circuit breaker for an `instance` is open or half-open",
    ),
    Metric(
        "kvpool_gateway_index_in_sync",
        _G,
        "1 while the gateway's replica of the controller's index is current",
    ),
    Metric("kvpool_gateway_index_deltas_total", _G, "index deltas applied to the replica"),
    Metric("kvpool_gateway_pd_requests_total", _G, "PD requests by `pair` and `outcome`", needs=LM),
)

_SUFFIXES = ("_bucket", "_sum", "_count")


def base_name(metric: str) -> str:
    for suffix in _SUFFIXES:
        if metric.endswith(suffix):
            return metric[: -len(suffix)]
    return metric


def used_metrics() -> set[str]:
    """Every metric a panel query or an alert names (histograms by base name)."""
    exprs = [q.expr for d in DASHBOARDS for p in d.panels for q in p.queries]
    exprs += [a.expr for a in ALERTS]
    return {base_name(m) for e in exprs for m in metric_names(e)}


def markdown_table() -> str:
    lines = ["| metric | component | meaning |", "|---|---|---|"]
    lines += [f"| `{m.name}` | {m.component} | {m.meaning} |" for m in METRICS]
    return "\n".join(lines) + "\n"
