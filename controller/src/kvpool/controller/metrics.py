"""Prometheus metrics of one controller, on its own registry.

Why its own registry: tests run several controllers in one process, and the hot path (every
admit/evict batch) must not pay for label look-ups under a lock. Counters on the hot path are
plain dicts read at scrape time by a collector; histograms (lookups only) use prometheus_client.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

PREFIX = "kvpool_controller"
LOOKUP_BUCKETS = (
    0.000025,
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.1,
)


class Metrics:
    """Counters the service bumps, and gauges it exposes through callbacks."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.messages: Counter[str] = Counter()  # by message type
        self.bad_input: Counter[str] = Counter()  # by kind
        self.refusals: Counter[str] = Counter()  # by reason
        self.purges = 0
        self.full_syncs: Counter[str] = Counter()  # by outcome
        self.persistence_errors = 0
        self.persistence_dropped = 0
        self.deltas_published = 0
        self.gauges: dict[str, Callable[[], float]] = {}
        self.location_counts: Callable[[], dict[str, int]] = dict
        self.lookup_seconds = Histogram(
            f"{PREFIX}_lookup_seconds",
            "Time to answer a lookup inside the controller, by kind",
            ["kind"],
            buckets=LOOKUP_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_Collector(self))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Collector:
    def __init__(self, metrics: Metrics) -> None:
        self._m = metrics

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        m = self._m
        yield _labelled_counter(
            "messages", "Protocol messages received, by type", "type", m.messages
        )
        yield _labelled_counter(
            "bad_input",
            "Frames or events rejected (malformed, unknown, stale...)",
            "kind",
            m.bad_input,
        )
        yield _labelled_counter(
            "refusals", "Registrations refused, by reason (e.g. fingerprint)", "reason", m.refusals
        )
        yield _labelled_counter(
            "full_syncs", "Full-sync sessions, by outcome", "outcome", m.full_syncs
        )
        yield CounterMetricFamily(
            f"{PREFIX}_purges", "Workers purged after missing the heartbeat TTL", value=m.purges
        )
        yield CounterMetricFamily(
            f"{PREFIX}_persistence_errors", "Failed Redis writes/reads", value=m.persistence_errors
        )
        yield CounterMetricFamily(
            f"{PREFIX}_persistence_dropped",
            "Index changes dropped from the full write-behind queue (a full rewrite follows)",
            value=m.persistence_dropped,
        )
        yield CounterMetricFamily(
            f"{PREFIX}_deltas_published", "Index deltas published", value=m.deltas_published
        )
        for name, fn in sorted(m.gauges.items()):
            yield GaugeMetricFamily(f"{PREFIX}_{name}", name.replace("_", " "), value=fn())
        chunks = GaugeMetricFamily(
            f"{PREFIX}_chunk_locations",
            "Indexed (chunk, worker) entries per tier",
            labels=["location"],
        )
        for location, count in sorted(m.location_counts().items()):
            chunks.add_metric([location], count)
        yield chunks


def _labelled_counter(name: str, doc: str, label: str, values: Counter[str]) -> Metric:
    family = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=[label])
    for key, value in sorted(values.items()):
        family.add_metric([key], value)
    return family
