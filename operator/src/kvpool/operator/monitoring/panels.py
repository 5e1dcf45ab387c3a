"""The Grafana dashboards of a cache domain, as pure data: dashboards, panels, queries.

Why data apart from the builder: the e2e suite runs every panel's query against a real
Prometheus scraping a running domain, and the README's metric table must list every metric a
panel reads; both read these definitions, while ``kvpool.operator.monitoring.grafana`` turns
them into dashboard JSON with grafana-foundation-sdk at generate time.

Every query selects ``namespace`` and ``pool`` through the dashboard's variables and rates
over ``$__rate_interval``; ``instantiate`` fills both in the way Grafana would, for a check.
``needs`` says which running domain produces a panel's series: ``ANY`` (a domain of simulated
workers is enough: the e2e suite's fast check) or ``LMCACHE`` (the real LMCache engine with
P2P and PD: the cpu-demo domain).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

RATE = "$__rate_interval"
DOMAIN = 'namespace=~"$namespace", pool=~"$pool"'
INSTANCE = f'{DOMAIN}, instance=~"$instance"'


class Needs(Enum):
    ANY = "any"
    LMCACHE = "lmcache"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    queries: tuple[Query, ...]
    unit: str = "short"
    kind: str = "timeseries"  # or "stat"
    needs: Needs = Needs.ANY


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    panels: tuple[Panel, ...]
    per_instance: bool = False  # an ``instance`` variable (the worker instances of the pools)

    @property
    def filename(self) -> str:
        return f"{self.uid}.json"


def rate(metric: str, sel: str = DOMAIN) -> str:
    return f"rate({metric}{{{sel}}}[{RATE}])"


def sum_rate(metric: str, by: str, sel: str = DOMAIN) -> str:
    return f"sum by ({by}) ({rate(metric, sel)})"


def quantile(q: float, metric: str, by: str, sel: str = DOMAIN) -> str:
    return f"histogram_quantile({q}, sum by ({by}, le) ({rate(metric + '_bucket', sel)}))"


def ratio(num: str, den: str, by: str, sel: str = DOMAIN) -> str:
    return f"{sum_rate(num, by, sel)}\n/ {sum_rate(den, by, sel)}"


HIT = "kvpool_worker_prefix_hit_tokens_total"
PROMPT = "kvpool_worker_prompt_tokens_total"

POOL_OVERVIEW = Dashboard(
    "kvpool-pool-overview",
    "kvpool / Pool overview",
    "Is each cache domain healthy and paying off: hits, tiers, traffic, TTFT, instances.",
    (
        Panel(
            "KV hit ratio",
            "Share of prompt tokens whose KV came from a cache (any tier) instead of prefill.",
            (Query(ratio(HIT, PROMPT, "pool"), "{{pool}}"),),
            unit="percentunit",
            kind="stat",
        ),
        Panel(
            "Hit ratio by tier",
            "Share of prompt tokens served from each tier (device prefix cache, DDR, disk, P2P).",
            (
                Query(
                    f"{sum_rate('kvpool_engine_cached_tokens_total', 'pool, tier')}\n"
                    f"/ ignoring (tier) group_left {sum_rate(PROMPT, 'pool')}",
                    "{{pool}} {{tier}}",
                ),
            ),
            unit="percentunit",
        ),
        Panel(
            "Requests by status",
            "Requests the gateway answered per second, by HTTP status.",
            (
                Query(
                    sum_rate("kvpool_gateway_requests_total", "pool, status"), "{{pool}} {{status}}"
                ),
            ),
            unit="reqps",
        ),
        Panel(
            "Time to first token (workers)",
            "From handing a request to the engine to its first token, over every worker.",
            (
                Query(quantile(0.5, "kvpool_worker_ttft_seconds", "pool"), "{{pool}} p50"),
                Query(quantile(0.95, "kvpool_worker_ttft_seconds", "pool"), "{{pool}} p95"),
            ),
            unit="s",
        ),
        Panel(
            "KV chunks indexed by tier",
            "(chunk, worker) entries in the controller's index, per tier.",
            (
                Query(
                    f"sum by (pool, location) (kvpool_controller_chunk_locations{{{DOMAIN}}})",
                    "{{pool}} {{location}}",
                ),
            ),
        ),
        Panel(
            "Instances registered and ready",
            "LMCache instances registered with the controller, and instances the gateway "
            "finds ready.",
            (
                Query(
                    f"sum by (pool) (kvpool_controller_instances{{{DOMAIN}}})",
                    "{{pool}} registered",
                ),
                Query(
                    f"sum by (pool) (kvpool_gateway_instance_ready{{{DOMAIN}}})",
                    "{{pool}} ready",
                ),
            ),
        ),
        Panel(
            "Bytes stored by tier",
            "KV bytes the workers wrote to each tier per second.",
            (Query(sum_rate("kvpool_engine_stored_bytes", "pool, tier"), "{{pool}} {{tier}}"),),
            unit="Bps",
        ),
        Panel(
            "Evictions by tier",
            "KV chunks evicted from each tier per second (capacity, or the /memory/evict API).",
            (
                Query(
                    sum_rate("kvpool_engine_evicted_chunks_total", "pool, tier"),
                    "{{pool}} {{tier}}",
                ),
            ),
        ),
    ),
)

INSTANCE_CACHE = Dashboard(
    "kvpool-instance-cache",
    "kvpool / Per-instance cache",
    "One worker instance at a time: what its cache holds and serves, and what it costs.",
    (
        Panel(
            "Hit ratio",
            "Share of each instance's prompt tokens served from a cache.",
            (Query(ratio(HIT, PROMPT, "instance", INSTANCE), "{{instance}}"),),
            unit="percentunit",
        ),
        Panel(
            "Tier usage",
            "Bytes of KV each instance holds per tier.",
            (
                Query(
                    f"sum by (instance, tier) (kvpool_engine_tier_used_bytes{{{INSTANCE}}})",
                    "{{instance}} {{tier}}",
                ),
            ),
            unit="bytes",
        ),
        Panel(
            "Device KV cache usage",
            "Share of the engine's device KV blocks in use.",
            (Query(f"kvpool_engine_kv_cache_usage{{{INSTANCE}}}", "{{instance}}"),),
            unit="percentunit",
        ),
        Panel(
            "Requests running and waiting",
            "The engine's batch and its queue.",
            (
                Query(f"kvpool_engine_requests_running{{{INSTANCE}}}", "{{instance}} running"),
                Query(f"kvpool_engine_requests_waiting{{{INSTANCE}}}", "{{instance}} waiting"),
            ),
        ),
        Panel(
            "Time to first token (p95)",
            "Per instance, measured by the worker.",
            (
                Query(
                    quantile(0.95, "kvpool_worker_ttft_seconds", "instance", INSTANCE),
                    "{{instance}}",
                ),
            ),
            unit="s",
        ),
        Panel(
            "LMCache frozen",
            "1 while LMCache is in a full-sync freeze (every store dropped).",
            (Query(f"kvpool_engine_lmcache_frozen{{{INSTANCE}}}", "{{instance}}"),),
        ),
        Panel(
            "Memory: resident vs budget",
            "The worker process's resident memory and the memory its pod requests (the "
            "budget the operator rendered).",
            (
                Query(
                    f'process_resident_memory_bytes{{job="kvpool-worker", {INSTANCE}}}',
                    "{{instance}} resident",
                ),
                Query(
                    f"kvpool_worker_memory_budget_bytes{{{INSTANCE}}}",
                    "{{instance}} budget",
                ),
            ),
            unit="bytes",
        ),
        Panel(
            "LMCache stores by tier",
            "KV bytes LMCache wrote per tier per second.",
            (
                Query(
                    sum_rate("kvpool_engine_stored_bytes", "instance, tier", INSTANCE),
                    "{{instance}} {{tier}}",
                ),
            ),
            unit="Bps",
        ),
    ),
    per_instance=True,
)

GATEWAY_ROUTING = Dashboard(
    "kvpool-gateway-routing",
    "kvpool / Gateway routing",
    "Why the gateway sent each request where it did, and what that bought.",
    (
        Panel(
            "Routing decisions by reason",
            "kv-hit: the instance holding the longest prefix; kv-miss-*: no useful hit; "
            "session/pinned/pd-*: sticky, explicit and PD routes.",
            (Query(sum_rate("kvpool_gateway_routing_decisions_total", "reason"), "{{reason}}"),),
            unit="reqps",
        ),
        Panel(
            "Predicted hit tokens by instance",
            "Prompt tokens the router expected the chosen instance to hold, per second.",
            (
                Query(
                    sum_rate("kvpool_gateway_predicted_hit_tokens_total", "instance"),
                    "{{instance}}",
                ),
            ),
        ),
        Panel(
            "Predicted hit share",
            "Predicted hit tokens over routed prompt tokens, per instance.",
            (
                Query(
                    ratio(
                        "kvpool_gateway_predicted_hit_tokens_total",
                        "kvpool_gateway_prompt_tokens_total",
                        "instance",
                    ),
                    "{{instance}}",
                ),
            ),
            unit="percentunit",
        ),
        Panel(
            "Time to first byte by route (p95)",
            "Upstream time to the first byte, by the reason of the routing decision: what a "
            "kv-hit buys against a miss.",
            (
                Query(
                    quantile(0.95, "kvpool_gateway_route_ttft_seconds", "reason"),
                    "{{reason}}",
                ),
            ),
            unit="s",
        ),
        Panel(
            "Time to first byte by instance (p95)",
            "Upstream time to the first byte, by the instance the request was routed to.",
            (
                Query(
                    quantile(0.95, "kvpool_gateway_upstream_ttft_seconds", "instance"),
                    "{{instance}}",
                ),
            ),
            unit="s",
        ),
        Panel(
            "Requests by endpoint and status",
            "Per second.",
            (
                Query(
                    sum_rate("kvpool_gateway_requests_total", "endpoint, status"),
                    "{{endpoint}} {{status}}",
                ),
            ),
            unit="reqps",
        ),
        Panel(
            "Instances ready and breakers open",
            "Ready: answers /readyz. Breaker open: cut off after repeated failures.",
            (
                Query(
                    f"sum by (instance) (kvpool_gateway_instance_ready{{{DOMAIN}}})",
                    "{{instance}} ready",
                ),
                Query(
                    f"sum by (instance) (kvpool_gateway_breaker_open{{{DOMAIN}}})",
                    "{{instance}} open",
                ),
            ),
        ),
        Panel(
            "Index replica",
            "1 while the gateway's replica of the controller's index is current; deltas "
            "applied per second.",
            (
                Query(f"min by (pool) (kvpool_gateway_index_in_sync{{{DOMAIN}}})", "in sync"),
                Query(sum_rate("kvpool_gateway_index_deltas_total", "pool"), "deltas/s"),
            ),
        ),
    ),
)

CONTROLLER = Dashboard(
    "kvpool-controller",
    "kvpool / Controller",
    "The KV controller: is it up, how busy, how far behind, what it indexes.",
    (
        Panel(
            "Up",
            "1 while Prometheus scrapes the controller.",
            (Query(f'up{{job="kvpool-controller", {DOMAIN}}}', "{{pool}}"),),
            kind="stat",
        ),
        Panel(
            "Messages by type",
            "LMCache protocol messages received per second.",
            (Query(sum_rate("kvpool_controller_messages_total", "type"), "{{type}}"),),
        ),
        Panel(
            "Lookup latency (p99)",
            "Time to answer a lookup inside the controller, by kind.",
            (Query(quantile(0.99, "kvpool_controller_lookup_seconds", "kind"), "{{kind}}"),),
            unit="s",
        ),
        Panel(
            "Lag",
            "How late its event loop runs (p99), and the share of time admit/evict messages "
            "waited on its PULL socket.",
            (
                Query(quantile(0.99, "kvpool_controller_loop_lag_seconds", "pool"), "loop lag p99"),
                Query(
                    sum_rate("kvpool_controller_backlog_seconds_total", "pool"),
                    "backlog share",
                ),
            ),
        ),
        Panel(
            "Registered",
            "Workers (TP ranks) and instances registered.",
            (
                Query(f"sum by (pool) (kvpool_controller_workers{{{DOMAIN}}})", "workers"),
                Query(f"sum by (pool) (kvpool_controller_instances{{{DOMAIN}}})", "instances"),
            ),
        ),
        Panel(
            "Index deltas published",
            "Changes to the index streamed to the gateways, per second.",
            (Query(sum_rate("kvpool_controller_deltas_published_total", "pool"), "{{pool}}"),),
        ),
        Panel(
            "Refused registrations by reason",
            "Workers refused per second (fingerprint: another domain's seed, chunk size, model "
            "or hash).",
            (Query(sum_rate("kvpool_controller_refusals_total", "reason"), "{{reason}}"),),
        ),
        Panel(
            "Purges and persistence errors",
            "Workers purged after missing the heartbeat TTL; failed Redis writes.",
            (
                Query(sum_rate("kvpool_controller_purges_total", "pool"), "purges"),
                Query(sum_rate("kvpool_controller_persistence_errors_total", "pool"), "errors"),
            ),
        ),
        Panel(
            "Full syncs by outcome",
            "Workers re-sending what they hold after a controller restart.",
            (Query(sum_rate("kvpool_controller_full_syncs_total", "outcome"), "{{outcome}}"),),
            needs=Needs.LMCACHE,
        ),
    ),
)

PD_P2P = Dashboard(
    "kvpool-pd-p2p",
    "kvpool / PD and P2P",
    "KV moving between instances: prefill to decode transfers, and P2P pulls.",
    (
        Panel(
            "PD requests by outcome",
            "Requests the gateway's PD proxy handled, per pair and outcome.",
            (
                Query(
                    sum_rate("kvpool_gateway_pd_requests_total", "pair, outcome"),
                    "{{pair}} {{outcome}}",
                ),
            ),
            needs=Needs.LMCACHE,
        ),
        Panel(
            "PD bytes sent",
            "KV bytes prefill instances pushed to their decoders, per second.",
            (Query(sum_rate("kvpool_engine_pd_sent_bytes", "instance"), "{{instance}}"),),
            unit="Bps",
            needs=Needs.LMCACHE,
        ),
        Panel(
            "PD buffer usage",
            "Share of each decoder's PD receive buffer in use.",
            (
                Query(
                    f"kvpool_engine_pd_buffer_used_bytes{{{DOMAIN}}}\n"
                    f"/ kvpool_engine_pd_buffer_capacity_bytes{{{DOMAIN}}}",
                    "{{instance}}",
                ),
            ),
            unit="percentunit",
            needs=Needs.LMCACHE,
        ),
        Panel(
            "PD transfers waiting",
            "Chunks in each decoder's buffer not yet claimed by a decode.",
            (Query(f"kvpool_engine_pd_buffer_chunks{{{DOMAIN}}}", "{{instance}}"),),
            needs=Needs.LMCACHE,
        ),
        Panel(
            "PD transfers freed unclaimed",
            "Chunks a decoder freed after the unclaimed TTL, or when the gateway released them.",
            (
                Query(
                    sum_rate("kvpool_engine_pd_unclaimed_freed_total", "instance"),
                    "{{instance}} TTL",
                ),
                Query(
                    sum_rate("kvpool_engine_pd_released_total", "instance"), "{{instance}} released"
                ),
            ),
            needs=Needs.LMCACHE,
        ),
        Panel(
            "P2P prefetches",
            "Chunks an instance found at a peer (or a lower tier) and prefetched, per second.",
            (
                Query(
                    sum_rate("kvpool_engine_p2p_or_lower_tier_chunks", "instance"),
                    "{{instance}}",
                ),
            ),
            needs=Needs.LMCACHE,
        ),
    ),
)

DASHBOARDS: tuple[Dashboard, ...] = (
    POOL_OVERVIEW,
    INSTANCE_CACHE,
    GATEWAY_ROUTING,
    CONTROLLER,
    PD_P2P,
)


def instantiate(expr: str, window: str = "1m") -> str:
    """``expr`` as Grafana would send it with every variable on All and ``window`` for
    ``$__rate_interval``."""
    out = expr.replace(RATE, window)
    return re.sub(r"\$(namespace|pool|instance)\b", ".+", out)


_NAME = re.compile(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?=\{|\[)")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool"}


def metric_names(expr: str) -> set[str]:
    """The metric names a query selects (names followed by a selector or a range)."""
    return {m for m in _NAME.findall(expr) if m not in _KEYWORDS}
