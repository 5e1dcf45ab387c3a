"""Replay the agent trace through one router and measure what the client sees.

Why this module exists: each arm of the routing benchmark (our gateway kv-affinity, our
round-robin, sglang-router cache_aware) is the same client doing the same thing: sessions
run concurrently (at most ``concurrency`` at once, in trace order), each session's turns one
after the other, every request a streamed chat completion. The client is the product's
(``kvpool-gateway replay``'s :mod:`kvpool.gateway.loadgen`): TTFT is the time from sending the
request to the first SSE event carrying content; hits come from the worker's own ``usage``
(``prompt_tokens_details.cached_tokens``: prompt tokens whose KV LMCache supplied). Between
arms ``clear_workers`` evicts every prompt of the trace from every worker and waits until
neither the workers' LMCache nor the controller's index holds any of it, so arms start equally
cold.
"""

from __future__ import annotations

import time

import httpx

from kvpool.gateway.loadgen import Endpoint, Outcome, Replay
from kvpool.gateway.promscrape import sample_sums
from kvpool.gateway.replay_plan import Loaded, make_jobs
from kvpool.gateway.traces.agent import Trace


async def replay(
    url: str, trace: Trace, model: str, concurrency: int
) -> tuple[list[Outcome], float]:
    """Every request of ``trace`` through ``url``, ``concurrency`` sessions at once; returns
    the outcomes (each with usage: a failure raises) and the wall time."""
    jobs = make_jobs(Loaded(url, "agent", trace.requests), None, model)
    endpoint = Endpoint(url, timeout_s=300, concurrency=concurrency, max_sessions=concurrency)
    run = await Replay(endpoint, jobs).run()
    for o in run.outcomes:
        if not o.ok or o.prompt_tokens is None:
            why = f"{o.error}: {o.detail[:300]}" if not o.ok else "no usage"
            raise RuntimeError(f"{url}: request {o.index} (session {o.session}): {why}")
    return run.outcomes, run.duration_s


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
            sums = sample_sums(client.get(f"{url}/metrics").text)
            out[url] = {key: sums.get(metric, 0.0) for key, metric in COUNTERS.items()}
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
