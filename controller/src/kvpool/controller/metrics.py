"""Prometheus metrics of one controller, on its own registry.

Why its own registry: tests run several controllers in one process, and the hot path (every
admit/evict batch) must not pay for label look-ups under a lock. Counters on the hot path are
plain dicts read at scrape time by a collector; histograms (lookups, loop lag) use
prometheus_client.

How far the controller trails: LMCache's messages carry no timestamp and ZMQ shows no queue
depth, so lag is measured from inside. ``loop_lag_seconds`` is how late a 100 ms tick of the
event loop runs (what every lookup, heartbeat and delta publication waits behind);
``backlog_seconds`` counts the time admit/evict messages were still waiting on the PULL socket
when a drain pass ended (its rate is the share of time the index trails the workers: near 1,
the controller cannot keep up). Label values known in advance (refusal reasons) are exported
at 0 from the start, so an alert on them has a series before the first refusal.
"""

from __future__ import annotations

import asyncio
import time
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
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
LAG_TICK_S = 0.1
#: Refusal reasons the controller has (service.py), exported before the first one happens.
#: fingerprint: another domain's seed, chunk size, model or hash; unknown_instance: an id the
#: operator did not render for the domain (the allowlist).
REFUSAL_REASONS = ("fingerprint", "unknown_instance")


class Metrics:
    """Counters the service bumps, and gauges it exposes through callbacks."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.messages: Counter[str] = Counter()  # by message type
        self.bad_input: Counter[str] = Counter()  # by kind
        self.refusals: Counter[str] = Counter(dict.fromkeys(REFUSAL_REASONS, 0))
        self.unauthorized: Counter[str] = Counter()  # 401s by route (auth.py)
        self.purges = 0
        self.full_syncs: Counter[str] = Counter()  # by outcome
        self.persistence_errors = 0
        self.persistence_dropped = 0
        self.deltas_published = 0
        self.backlog_seconds = 0.0
        self.gauges: dict[str, Callable[[], float]] = {}
        self.location_counts: Callable[[], dict[str, int]] = dict
        self.lookup_seconds = Histogram(
            f"{PREFIX}_lookup_seconds",
            "Time to answer a lookup inside the controller, by kind",
            ["kind"],
            buckets=LOOKUP_BUCKETS,
            registry=self.registry,
        )
        self.loop_lag = Histogram(
            f"{PREFIX}_loop_lag_seconds",
            f"How late the event loop ran a {LAG_TICK_S:g} s tick",
            buckets=LAG_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_Collector(self))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def watch_loop_lag(
        self, tick_s: float = LAG_TICK_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """Until cancelled: sleep ``tick_s``, observe how much later than that it woke."""
        while True:
            t0 = clock()
            await asyncio.sleep(tick_s)
            self.loop_lag.observe(max(0.0, clock() - t0 - tick_s))


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
            "refusals",
            "Registrations refused, by reason (fingerprint, unknown_instance)",
            "reason",
            m.refusals,
        )
        yield _labelled_counter(
            "unauthorized",
            "HTTP calls of mutating routes refused for a missing or wrong API token, by path",
            "path",
            m.unauthorized,
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
        yield CounterMetricFamily(
            f"{PREFIX}_backlog_seconds",
            "Seconds admit/evict messages were still waiting on the PULL socket after a drain",
            value=m.backlog_seconds,
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
