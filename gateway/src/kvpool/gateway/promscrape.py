"""Counters from a worker's Prometheus ``/metrics``, before and after a replay.

Why this module exists: a replay through a router sees only what the router tells it (the
``x-kvpool-instance`` header, if any); the workers' own counters say how the load and the hits
really split across instances, whichever router is in front. kvpool's workers (reference and
sim) export ``kvpool_worker_*_total``; vLLM exports ``vllm:*_total``; both are read here, each
summed over its label sets. Parsing is prometheus_client's own text parser.
"""

from __future__ import annotations

from collections.abc import Mapping

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

#: what a replay reports per worker → the counters that say it (kvpool's worker, vLLM)
WORKER_COUNTERS: Mapping[str, tuple[str, ...]] = {
    "requests": ("kvpool_worker_requests_total", "vllm:request_success_total"),
    "prompt_tokens": ("kvpool_worker_prompt_tokens_total", "vllm:prompt_tokens_total"),
    "generation_tokens": (
        "kvpool_worker_generation_tokens_total",
        "vllm:generation_tokens_total",
    ),
    "prefix_hit_tokens": ("kvpool_worker_prefix_hit_tokens_total", "vllm:prefix_cache_hits_total"),
}


class ScrapeError(RuntimeError):
    """A metrics URL that could not be read; the message names it."""


def sample_sums(text: str) -> dict[str, float]:
    """Each sample name of a Prometheus text exposition → its value summed over label sets."""
    sums: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                sums[sample.name] = sums.get(sample.name, 0.0) + float(sample.value)
    except ValueError as exc:
        raise ScrapeError(f"not a Prometheus text exposition ({exc})") from None
    return sums


def worker_counters(text: str) -> dict[str, float]:
    """:data:`WORKER_COUNTERS` read from one exposition (keys it has none of are left out)."""
    sums = sample_sums(text)
    out: dict[str, float] = {}
    for key, names in WORKER_COUNTERS.items():
        for name in names:
            if name in sums:
                out[key] = sums[name]
                break
    return out


def metrics_url(url: str) -> str:
    """``url`` itself when it has a path, else its ``/metrics``."""
    rest = url.split("://", 1)[-1]
    return url if "/" in rest.strip("/") else url.rstrip("/") + "/metrics"


async def scrape(
    http: aiohttp.ClientSession, url: str, timeout_s: float = 10.0
) -> dict[str, float]:
    """GET ``url`` and read its :data:`WORKER_COUNTERS`; ScrapeError names the URL on failure."""
    try:
        async with http.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                raise ScrapeError(f"{url}: HTTP {resp.status}")
            text = await resp.text()
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        raise ScrapeError(f"{url}: {exc or type(exc).__name__}") from None
    try:
        return worker_counters(text)
    except ScrapeError as exc:
        raise ScrapeError(f"{url}: {exc}") from None
