"""Prometheus metrics of the gateway, in a registry of its own (one per app).

Why this module exists: the questions an operator asks of a router — how many requests, why
each went where it went, how many prompt tokens it expected to be cached, how slow each
instance answers (latency and time to first token), how often it retried and refused, which
instances it has cut off with their circuit breaker — each have one metric here, named
``kvpool_gateway_*``. The breakers' state is read at scrape time (``watch_breakers``), so the
request path does nothing for it. A request updates about seven labelled series; their
children are looked up once per label values and kept (``labels`` memoised): prometheus_client
converts and locks on every lookup, which was a tenth of the request path's CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GatewayMetrics:
    """Every metric the gateway exports."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "kvpool_gateway_requests", "Requests answered", ["endpoint", "status"], registry=r
        )
        self.decisions = Counter(
            "kvpool_gateway_routing_decisions",
            "Routing decisions by policy reason and chosen instance",
            ["reason", "instance"],
            registry=r,
        )
        self.predicted_hit_tokens = Counter(
            "kvpool_gateway_predicted_hit_tokens",
            "Prompt tokens the router expected the chosen instance to hold",
            ["instance"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvpool_gateway_prompt_tokens", "Prompt tokens routed", ["instance"], registry=r
        )
        self.upstream_latency = Histogram(
            "kvpool_gateway_upstream_latency_seconds",
            "Upstream request duration (to last byte)",
            ["instance"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "kvpool_gateway_upstream_ttft_seconds",
            "Upstream time to first byte of the answer",
            ["instance"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.route_ttft = Histogram(
            "kvpool_gateway_route_ttft_seconds",
            "Upstream time to first byte, by the reason of the routing decision (kv-hit, ...)",
            ["reason"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.retries = Counter(
            "kvpool_gateway_retries", "Requests re-sent to another attempt", ["reason"], registry=r
        )
        self.rejections = Counter(
            "kvpool_gateway_rejections", "Requests refused by the gateway", ["reason"], registry=r
        )
        self.upstream_errors = Counter(
            "kvpool_gateway_upstream_errors", "Upstream failures", ["instance", "kind"], registry=r
        )
        self.queued = Gauge("kvpool_gateway_queued", "Requests waiting for a slot", registry=r)
        self.index_in_sync = Gauge(
            "kvpool_gateway_index_in_sync", "1 while the index replica is current", registry=r
        )
        self.index_resyncs = Counter(
            "kvpool_gateway_index_resyncs", "Snapshots loaded", ["reason"], registry=r
        )
        self.index_deltas = Counter(
            "kvpool_gateway_index_deltas", "Index deltas applied", registry=r
        )
        self.instance_ready = Gauge(
            "kvpool_gateway_instance_ready",
            "1 while an instance answers /readyz",
            ["instance"],
            registry=r,
        )
        self.pd_transfers = Counter(
            "kvpool_gateway_pd_requests", "PD requests by outcome", ["pair", "outcome"], registry=r
        )
        self.pd_paths = Counter(
            "kvpool_gateway_pd_paths",
            "PD requests by path (bypass: straight to a decoder holding the prompt; prefill: "
            "prefill and transfer) and reason (decoder-cached, below-ratio, bypass-off)",
            ["pair", "path", "reason"],
            registry=r,
        )
        self.pd_releases = Counter(
            "kvpool_gateway_pd_releases",
            "Transfers the PD proxy asked a decoder to free (it will not decode them), by outcome",
            ["pair", "outcome"],
            registry=r,
        )
        self.pd_relays = Counter(
            "kvpool_gateway_pd_notifications_relayed",
            "PD transfer notifications that reached this replica for another one, by outcome "
            "(relayed, dropped)",
            ["outcome"],
            registry=r,
        )
        self.api_key_reloads = Counter(
            "kvpool_gateway_api_key_reloads",
            "Changes of the API key file, by outcome (loaded; invalid: the old keys kept)",
            ["outcome"],
            registry=r,
        )
        self.config_reloads = Counter(
            "kvpool_gateway_config_reloads",
            "New configurations (the mounted file changed, or an admin POST) by source and "
            "outcome: applied, unchanged, invalid or restart_required (both: not applied)",
            ["source", "outcome"],
            registry=r,
        )
        self.config_generation = Gauge(
            "kvpool_gateway_config_generation",
            "Configurations applied since start (1: the one read at start)",
            registry=r,
        )
        self.config_rejected = Gauge(
            "kvpool_gateway_config_rejected",
            "1 while the latest new configuration was not applied (invalid, or needs a restart): "
            "the gateway serves with the one before",
            registry=r,
        )
        for metric in list(vars(self).values()):
            if isinstance(metric, Counter | Gauge | Histogram) and metric._labelnames:
                _memoize_labels(metric)

    def watch_breakers(self, breakers: Callable[[], Iterable[tuple[str, bool]]]) -> None:
        """Export ``kvpool_gateway_breaker_open{instance}``: 1 while an instance's breaker is
        not closed, from ``breakers()`` (instance name, closed?) at each scrape."""
        self.registry.register(
            _ScrapeGauge(
                "kvpool_gateway_breaker_open",
                "1 while the circuit breaker of an instance is open or half-open",
                lambda: ((name, 0.0 if closed else 1.0) for name, closed in breakers()),
            )
        )

    def watch_inflight(self, inflight: Callable[[], Iterable[tuple[str, float]]]) -> None:
        """Export ``kvpool_gateway_inflight{instance}`` from the load tracker at each scrape
        (requests sent upstream and not yet ended), nothing on the request path."""
        self.registry.register(
            _ScrapeGauge("kvpool_gateway_inflight", "Requests in flight upstream", inflight)
        )

    def forget_instance(self, name: str) -> None:
        """An instance left the configuration: its readiness is no longer exported (its
        counters stay, ending where they were)."""
        _forget(self.instance_ready, (name,))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ScrapeGauge(Collector):
    """A per-instance gauge read from its source at scrape time."""

    def __init__(
        self, name: str, documentation: str, rows: Callable[[], Iterable[tuple[str, float]]]
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._rows = rows

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(self._name, self._documentation, labels=["instance"])
        for name, value in self._rows():
            family.add_metric([name], value)
        yield family


def _memoize_labels(metric: Counter | Gauge | Histogram) -> None:
    """``metric.labels(*values)`` answered from a dict after the first lookup of ``values``
    (a child is removed only through :func:`_forget`, which drops it from the dict too)."""
    plain = metric.labels
    children: dict[tuple[Any, ...], Any] = {}
    setattr(metric, "_kvpool_children", children)  # noqa: B010 -- read by _forget

    def labels(*values: Any, **named: Any) -> Any:
        if named:
            return plain(*values, **named)
        child = children.get(values)
        if child is None:
            child = children[values] = plain(*values)
        return child

    setattr(metric, "labels", labels)  # noqa: B010 -- an instance attribute over the method


def _forget(metric: Counter | Gauge | Histogram, values: tuple[str, ...]) -> None:
    """Remove one child of a memoised metric (from the registry and from the memo)."""
    getattr(metric, "_kvpool_children", {}).pop(values, None)
    with contextlib.suppress(KeyError):  # never exported
        metric.remove(*values)
