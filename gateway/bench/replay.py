"""Replay the agent trace through one router and measure what the client sees.

Why this module exists: each arm of the routing benchmark (our gateway kv-affinity, our
round-robin, sglang-router cache_aware) is the same client doing the same thing: sessions
run concurrently (at most ``concurrency`` at once, in trace order), each session's turns one
after the other, every request a streamed chat completion. TTFT is the time from sending the
request to the first SSE event carrying content; hits come from the worker's own ``usage``
(``prompt_tokens_details.cached_tokens``: prompt tokens whose KV LMCache supplied). Between
arms ``clear_workers`` evicts every prompt of the trace from every worker and waits until
neither the workers' LMCache nor the controller's index holds any of it, so arms start equally
cold.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass
from typing import Any

import httpx
from agent_trace import Request, Trace


@dataclass
class Result:
    session: str
    turn: int
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    cached_tokens: int


async def _one(client: httpx.AsyncClient, url: str, req: Request, model: str) -> Result:
    t0 = time.perf_counter()
    ttft: float | None = None
    usage: dict[str, Any] = {}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=req.body(model)) as resp:
        if resp.status_code != 200:
            body = (await resp.aread()).decode(errors="replace")[:300]
            raise RuntimeError(f"{url}: {req.session} turn {req.turn}: {resp.status_code} {body}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if ttft is None and any(
                (c.get("delta") or {}).get("content") for c in event.get("choices", [])
            ):
                ttft = time.perf_counter() - t0
            usage = event.get("usage") or usage
    total = time.perf_counter() - t0
    if ttft is None or not usage:
        raise RuntimeError(f"{url}: {req.session} turn {req.turn}: no content or no usage")
    return Result(
        req.session,
        req.turn,
        ttft,
        total,
        int(usage["prompt_tokens"]),
        int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
    )


async def replay(
    url: str, trace: Trace, model: str, concurrency: int
) -> tuple[list[Result], float]:
    """Every request of ``trace`` through ``url``; returns the results and the wall time."""
    gate = asyncio.Semaphore(concurrency)
    results: list[Result] = []
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:

        async def session(reqs: tuple[Request, ...]) -> None:
            async with gate:
                for r in reqs:
                    results.append(await _one(client, url, r, model))

        t0 = time.perf_counter()
        await asyncio.gather(*(session(s.requests) for s in trace.sessions))
        wall = time.perf_counter() - t0
    return results, wall


def tokenize_all(worker_url: str, trace: Trace) -> list[list[int]]:
    """The exact prompt token ids of every request (the worker's own chat rendering)."""
    out = []
    with httpx.Client(timeout=60) as client:
        for r in trace.requests:
            resp = client.post(f"{worker_url}/tokenize", json={"messages": list(r.messages)})
            resp.raise_for_status()
            out.append(list(resp.json()["tokens"]))
    return out


COUNTERS = {
    "prompt_tokens": "kvpool_worker_prompt_tokens_total",
    "hit_tokens": "kvpool_worker_prefix_hit_tokens_total",
    "requests": "kvpool_worker_requests_total",
    # chunks a request got from a peer (P2P) or a lower tier: the bench pool has no lower tier
    "p2p_chunks": "kvpool_engine_p2p_or_lower_tier_chunks",
}


def worker_counters(worker_urls: list[str]) -> dict[str, dict[str, float]]:
    """Per worker: ``COUNTERS`` so far, each summed over its label sets (its /metrics)."""
    out: dict[str, dict[str, float]] = {}
    with httpx.Client(timeout=10) as client:
        for url in worker_urls:
            text = client.get(f"{url}/metrics").text
            out[url] = {
                key: sum(
                    float(v) for v in re.findall(rf"^{metric}(?:{{[^}}]*}})? (\S+)$", text, re.M)
                )
                for key, metric in COUNTERS.items()
            }
    return out


def _resident_tokens(client: httpx.Client, url: str, prompts: list[list[int]]) -> int:
    """Prompt tokens the worker could still serve from its LMCache (a lookup, nothing moves:
    the bench pool has only the local_cpu tier)."""
    total = 0
    for toks in prompts:
        out = client.post(f"{url}/memory/prefetch", json={"token_ids": toks})
        out.raise_for_status()
        total += int(out.json()["resident_tokens"])
    return total


def _index_hits(client: httpx.Client, controller: str, prompts: list[list[int]]) -> int:
    hits = 0
    for toks in prompts:
        out = client.post(f"{controller}/v1/prefix_lookup", json={"tokens": toks}).json()
        hits += sum(int(v["hit_chunks"]) for v in out.get("instances", {}).values())
    return hits


def clear_workers(
    worker_urls: list[str], controller: str, prompts: list[list[int]], timeout_s: float = 30
) -> float:
    """Evict every prompt from every worker (all tiers) and wait until no worker can serve any
    prompt's prefix and the controller's index answers no hit for any prompt; returns the
    seconds it took. (Chunks a worker stored for prompt + generated tokens may stay: the trace
    replays scripted replies, so no later request can reach them.)"""
    t0 = time.monotonic()
    with httpx.Client(timeout=60) as client:
        for url in worker_urls:
            for toks in prompts:
                client.post(f"{url}/memory/evict", json={"token_ids": toks}).raise_for_status()
        while True:
            left = sum(_resident_tokens(client, u, prompts) for u in worker_urls)
            indexed = _index_hits(client, controller, prompts)
            if left == 0 and indexed == 0:
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(
                    f"caches not clear after {timeout_s:.0f}s: the workers still hold "
                    f"{left} prompt tokens, the controller's index {indexed} chunk hits"
                )
            time.sleep(0.2)
