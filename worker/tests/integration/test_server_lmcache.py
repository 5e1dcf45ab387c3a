"""The worker's HTTP API with the real reference engine AND the real LMCache engine (local CPU
tier): a repeated prompt reports ``cached_tokens`` and gives the same greedy answer, the
memory API really evicts and pins, and /metrics shows bytes stored and loaded per tier.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import httpx
import pytest
import pytest_asyncio

from kvpool.worker.engine import ReferenceEngine
from kvpool.worker.engine.model import model_shape
from kvpool.worker.engine.offload import LMCacheOffload
from kvpool.worker.engine_api import ReferenceEngineOptions
from kvpool.worker.server import WorkerRuntime, build_app
from kvpool.worker.tokenizer import load_tokenizer

pytestmark = pytest.mark.asyncio(loop_scope="module")

SMALL_MODEL = {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256}
CHUNK = 256
# About 330 tokens: one whole LMCache chunk plus a tail.
PROMPT = " ".join(f"The {w} river keeps stone {i}." for i, w in enumerate(["old", "calm"] * 20))


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def client() -> AsyncIterator[httpx.AsyncClient]:
    opts = ReferenceEngineOptions(max_model_len=1024, num_kv_blocks=256, max_num_seqs=4)
    shape = model_shape(opts, **SMALL_MODEL)
    offload = LMCacheOffload(
        {"chunk_size": CHUNK, "local_cpu": True, "max_local_cpu_size": 0.25},
        instance_id=f"server-test-{uuid.uuid4().hex[:8]}",
        num_layers=shape.num_layers,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        block_size=opts.block_size,
        dtype=opts.dtype,
        model_name=opts.model_name,
    )
    rt = WorkerRuntime(
        ReferenceEngine(opts, offload, model_overrides=SMALL_MODEL), load_tokenizer()
    )
    await rt.start_engine()
    transport = httpx.ASGITransport(app=build_app(rt, start_engine=False))
    async with httpx.AsyncClient(transport=transport, base_url="http://w", timeout=120) as c:
        yield c
    await rt.engine.shutdown(10.0)


async def complete(client: httpx.AsyncClient, session: str) -> dict[str, object]:
    resp = await client.post(
        "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0},
        headers={"X-Session-Id": session},
    )
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def cached(body: dict[str, object]) -> int:
    usage = body["usage"]
    assert isinstance(usage, dict)
    return int(usage["prompt_tokens_details"]["cached_tokens"])


def text(body: dict[str, object]) -> str:
    choices = body["choices"]
    assert isinstance(choices, list)
    return str(choices[0]["text"])


async def test_repeated_prompt_hits_lmcache_and_answers_the_same(
    client: httpx.AsyncClient,
) -> None:
    miss = await complete(client, "s1")
    hit = await complete(client, "s1")
    assert cached(miss) == 0
    assert cached(hit) == CHUNK  # the whole chunk came from the local CPU tier
    assert text(hit) == text(miss)  # same greedy tokens with and without the KV hit
    metrics = (await client.get("/metrics")).text
    assert 'kvpool_engine_stored_bytes{tier="local_cpu"}' in metrics
    assert 'kvpool_engine_loaded_bytes{tier="local_cpu"}' in metrics
    hit_line = next(
        ln for ln in metrics.splitlines() if ln.startswith("kvpool_worker_prefix_hit_tokens_total")
    )
    assert float(hit_line.split()[-1]) >= CHUNK


async def test_memory_api_evicts_a_session_for_real(client: httpx.AsyncClient) -> None:
    await complete(client, "s2")  # stored (or already there)
    pinned = (await client.post("/memory/pin", json={"session_id": "s2"})).json()
    assert pinned["pinned_tokens"] == CHUNK
    unpinned = (await client.post("/memory/unpin", json={"session_id": "s2"})).json()
    assert unpinned["unpinned_tokens"] == CHUNK
    resident = (await client.post("/memory/prefetch", json={"text": PROMPT})).json()
    assert resident["resident_tokens"] == CHUNK
    held = (await client.post("/memory/lookup", json={"text": PROMPT})).json()
    assert held["cached_tokens"] == CHUNK and held["prefix_tokens"] >= CHUNK
    stats = (await client.get("/memory/stats")).json()
    assert stats["engine"]
    evicted = (await client.post("/memory/evict", json={"session_id": "s2"})).json()
    assert evicted["evicted_chunks"] >= 1
    held = (await client.post("/memory/lookup", json={"text": PROMPT})).json()
    assert held["cached_tokens"] == 0
    again = await complete(client, "s3")
    assert cached(again) == 0  # the KV really left the cache


async def test_evicting_from_an_unknown_tier_is_a_400(client: httpx.AsyncClient) -> None:
    resp = await client.post("/memory/evict", json={"text": PROMPT, "tiers": ["tape"]})
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["param"] == "tiers" and "unknown tier 'tape'" in err["message"]
