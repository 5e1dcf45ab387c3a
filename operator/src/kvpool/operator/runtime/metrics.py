"""Prometheus metrics and the health endpoints of the operator process.

Why: a person running the operator needs to see that it reconciles (counts and durations by
kind and result), that it fails (errors), and Kubernetes needs liveness/readiness probes. Both
servers are small aiohttp apps on the operator's own event loop (no extra threads).
"""

from __future__ import annotations

from collections.abc import Callable

import aiohttp.web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)


class Metrics:
    """The operator's metrics, in their own registry (tests create one per operator)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.reconciles = Counter(
            "kvpool_operator_reconciles",
            "Reconcile passes by kind and result (ok, invalid, error).",
            ["kind", "result"],
            registry=self.registry,
        )
        self.errors = Counter(
            "kvpool_operator_errors",
            "Handler errors by kind and handler.",
            ["kind", "handler"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "kvpool_operator_reconcile_duration_seconds",
            "Duration of reconcile passes.",
            ["kind"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )
        self.admissions = Counter(
            "kvpool_operator_admission_reviews",
            "Admission reviews by kind and verdict (allowed, refused).",
            ["kind", "verdict"],
            registry=self.registry,
        )

    def reconciled(self, kind: str, result: str, seconds: float) -> None:
        self.reconciles.labels(kind, result).inc()
        self.duration.labels(kind).observe(seconds)

    def count(self, kind: str, result: str) -> float:
        """How many passes of ``kind`` ended with ``result`` so far."""
        value = self.registry.get_sample_value(
            "kvpool_operator_reconciles_total", {"kind": kind, "result": result}
        )
        return value or 0.0

    def failed(self, kind: str, handler: str) -> None:
        self.errors.labels(kind, handler).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


async def serve(
    host: str,
    port: int,
    routes: dict[str, Callable[[], tuple[int, bytes, str]]],
) -> aiohttp.web.AppRunner:
    """Start a tiny HTTP server answering GET on each path with ``routes[path]()``."""
    app = aiohttp.web.Application()
    for path, fn in routes.items():

        async def handle(
            _request: aiohttp.web.Request, fn: Callable[..., tuple[int, bytes, str]] = fn
        ) -> aiohttp.web.Response:
            status, body, ctype = fn()
            return aiohttp.web.Response(status=status, body=body, headers={"Content-Type": ctype})

        app.router.add_get(path, handle)
    runner = aiohttp.web.AppRunner(app, access_log=None)
    await runner.setup()
    await aiohttp.web.TCPSite(runner, host, port).start()
    return runner


def metrics_route(metrics: Metrics) -> Callable[[], tuple[int, bytes, str]]:
    return lambda: (200, metrics.render(), CONTENT_TYPE_LATEST)
