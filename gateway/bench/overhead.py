"""Overhead of a router in front of instant upstreams: added latency and maximum req/s.

Why this module exists: routing quality means nothing if the router itself is slow. With
upstreams that answer at once (``upstream.py``) everything a request spends beyond the direct
call is the router's. Latency: small non-streamed chat requests one after the other on one
keep-alive connection, in interleaved rounds (direct, ours, sglang-router, again) so the
shared box's noise hits every target alike; added = the router's percentile minus the direct
call's. The prompt is a few tokens, so tokenization is left out (it is measured apart, at
1K/8K/32K tokens). Throughput: a closed loop of ``concurrency`` connections for a bounded time
and count, per target, also interleaved.
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import urlsplit

import loadgen

BODY: dict[str, Any] = {
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 1,
    "temperature": 0,
}


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of a non-empty list."""
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[k]


def _port(url: str) -> int:
    port = urlsplit(url).port
    if port is None:
        raise ValueError(f"{url}: no port")
    return port


async def measure(
    targets: dict[str, str], model: str, *, rounds: int, per_round: int, round_s: float,
    concurrency: int, duration_s: float, max_requests: int,
) -> dict[str, dict[str, float]]:  # fmt: skip
    """Per target name: latency p50/p90/p99 (ms) and req/s (best of the throughput rounds)."""
    body = {**BODY, "model": model}
    raws = {
        name: loadgen.encode("/v1/chat/completions", body, _port(u)) for name, u in targets.items()
    }
    lat: dict[str, list[float]] = {n: [] for n in targets}
    for name, url in targets.items():  # warm-up: connections, caches, JIT-less paths
        await loadgen.latencies(_port(url), raws[name], 50, round_s)
    for _ in range(rounds):
        for name, url in targets.items():
            lat[name] += await loadgen.latencies(_port(url), raws[name], per_round, round_s)
    tput: dict[str, list[float]] = {n: [] for n in targets}
    errors: dict[str, int] = dict.fromkeys(targets, 0)
    for _ in range(max(1, rounds // 2)):
        for name, url in targets.items():
            t = await loadgen.throughput(
                _port(url), raws[name], concurrency, duration_s, max_requests
            )
            tput[name].append(t.per_s)
            errors[name] += t.errors
    out: dict[str, dict[str, float]] = {}
    for name in targets:
        ms = [v * 1e3 for v in lat[name]]
        out[name] = {
            "p50_ms": percentile(ms, 50),
            "p90_ms": percentile(ms, 90),
            "p99_ms": percentile(ms, 99),
            "requests": float(len(ms)),
            "req_per_s": max(tput[name]),
            "throughput_errors": float(errors[name]),
        }
    return out


def run(targets: dict[str, str], model: str, quick: bool) -> dict[str, dict[str, float]]:
    return asyncio.run(
        measure(
            targets,
            model,
            rounds=2 if quick else 6,
            per_round=150 if quick else 500,
            round_s=1.5 if quick else 10.0,  # a round stops at per_round requests or round_s
            concurrency=32,
            duration_s=1.5 if quick else 5.0,
            max_requests=50_000 if quick else 200_000,
        )
    )
