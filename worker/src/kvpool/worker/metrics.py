"""Prometheus metrics of one worker: the runtime's own and the engine's, in one registry.

Why this module exists: the numbers kvpool exists to move (time to first token, prefix hit
tokens, bytes stored and loaded per tier) must be scrapeable from every worker. The runtime
measures what it sees at the HTTP boundary (TTFT histogram, tokens, requests, generation
rate); everything ``engine.metrics()`` reports is exported as it is at scrape time. Engine
keys of the form ``<name>.<tier>`` become one metric with a ``tier`` label, so
``stored_bytes_total.local_cpu`` is ``kvpool_engine_stored_bytes_total{tier="local_cpu"}``.
The process's own resident memory (``process_*``) sits next to the memory its pod requests
(``kvpool_worker_memory_budget_bytes``, when the operator rendered one), for the over-budget
alert; in ``kvpool-worker host`` every instance reports the one shared process.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0)
_UNSAFE = re.compile(r"[^a-zA-Z0-9_]")

disable_created_metrics()  # type: ignore[no-untyped-call]  # no *_created series


class RateWindow:
    """Events per second over the last ``window_s`` seconds (a sliding window)."""

    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self._clock = clock
        self._events: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

    def add(self, n: int = 1) -> None:
        with self._lock:
            self._events.append((self._clock(), n))

    def rate(self) -> float:
        now = self._clock()
        with self._lock:
            while self._events and self._events[0][0] < now - self.window_s:
                self._events.popleft()
            return sum(n for _, n in self._events) / self.window_s


def engine_families(values: Mapping[str, float], prefix: str = "kvpool_engine") -> list[Metric]:
    """Turn ``engine.metrics()`` into metric families (pure; unit-tested)."""
    grouped: dict[str, list[tuple[str | None, float]]] = {}
    for key in sorted(values):
        name, _, label = key.partition(".")
        metric = f"{prefix}_{_UNSAFE.sub('_', name)}"
        grouped.setdefault(metric, []).append((label or None, float(values[key])))
    out: list[Metric] = []
    for metric, samples in grouped.items():
        labelled = any(tier is not None for tier, _ in samples)
        labels = ["tier"] if labelled else []
        family: CounterMetricFamily | GaugeMetricFamily
        if metric.endswith("_total"):
            family = CounterMetricFamily(metric, f"engine counter {metric}", labels=labels)
        else:
            family = GaugeMetricFamily(metric, f"engine gauge {metric}", labels=labels)
        for tier, value in samples:
            family.add_metric([tier or "all"] if labelled else [], value)
        out.append(family)
    return out


class _EngineCollector(Collector):
    def __init__(self, source: Callable[[], Mapping[str, float]]) -> None:
        self._source = source

    def collect(self) -> Iterable[Metric]:
        try:
            values = self._source()
        except Exception:  # a scrape must not fail because the engine is mid-shutdown
            logger.exception("engine.metrics() failed during a scrape")
            return []
        return engine_families(values)


class RuntimeMetrics:
    """The worker's registry (one per app, so tests can build many apps)."""

    def __init__(
        self,
        engine_metrics: Callable[[], Mapping[str, float]],
        memory_budget_bytes: int | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)  # process_resident_memory_bytes, CPU, open fds
        if memory_budget_bytes is not None:
            budget = Gauge(
                "kvpool_worker_memory_budget_bytes",
                "The memory the worker's pod requests (rendered by the operator)",
                registry=r,
            )
            budget.set(memory_budget_bytes)
        self.ttft = Histogram(
            "kvpool_worker_ttft_seconds",
            "Time from handing the request to the engine to its first generated token",
            ["endpoint"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "kvpool_worker_requests",
            "Requests by endpoint and outcome",
            ["endpoint", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvpool_worker_prompt_tokens", "Prompt tokens of served requests", registry=r
        )
        self.generation_tokens = Counter(
            "kvpool_worker_generation_tokens", "Generated tokens", registry=r
        )
        self.prefix_hit_tokens = Counter(
            "kvpool_worker_prefix_hit_tokens",
            "Prompt tokens whose KV came from the cache (any tier) instead of prefill",
            registry=r,
        )
        self.tokens_per_s = Gauge(
            "kvpool_worker_generation_tokens_per_second",
            "Generated tokens per second over the last 10 s",
            registry=r,
        )
        self.inflight = Gauge(
            "kvpool_worker_inflight_requests", "Requests being served", registry=r
        )
        self.ready = Gauge("kvpool_worker_ready", "1 when the worker accepts requests", registry=r)
        self._rate = RateWindow()
        self.tokens_per_s.set_function(self._rate.rate)
        r.register(_EngineCollector(engine_metrics))

    def observe(
        self,
        endpoint: str,
        *,
        prompt_tokens: int,
        cached_tokens: int,
        finish_reason: str | None,
    ) -> None:
        self.requests.labels(endpoint, finish_reason or "unknown").inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.prefix_hit_tokens.inc(cached_tokens)

    def token(self) -> None:
        """One generated token (counted as it streams, so the rate is live)."""
        self.generation_tokens.inc()
        self._rate.add()

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))
