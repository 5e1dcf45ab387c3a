"""The worker's HTTP API against the REAL reference engine, in process (httpx ASGI transport).

The engine is the real one (paged KV, real prefill/decode of a random-weight Qwen3-style model
on CPU, continuous batching); only its sizes are reduced (2 layers, hidden 128) so a request
takes milliseconds. Greedy decoding is deterministic, so streamed and non-streamed answers,
stop strings and usage can be compared exactly.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio

from kvpool.worker.engine import ReferenceEngine
from kvpool.worker.engine_api import ReferenceEngineOptions
from kvpool.worker.server import WorkerRuntime, build_app
from kvpool.worker.tokenizer import load_tokenizer

pytestmark = pytest.mark.asyncio(loop_scope="module")

SMALL_MODEL = {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256}
MAX_MODEL_LEN = 512
MODEL = "kvpool/reference-tiny"
CHAT = {"messages": [{"role": "user", "content": "Tell me about the old river."}]}


def small_engine() -> ReferenceEngine:
    opts = ReferenceEngineOptions(max_model_len=MAX_MODEL_LEN, num_kv_blocks=256, max_num_seqs=4)
    return ReferenceEngine(opts, model_overrides=SMALL_MODEL)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def runtime() -> AsyncIterator[WorkerRuntime]:
    rt = WorkerRuntime(small_engine(), load_tokenizer(), session_capacity=8)
    await rt.start_engine()
    yield rt
    await rt.engine.shutdown(5.0)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def client(runtime: WorkerRuntime) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=build_app(runtime, start_engine=False))
    async with httpx.AsyncClient(transport=transport, base_url="http://worker", timeout=60) as c:
        yield c


def sse_events(body: str) -> list[Any]:
    out: list[Any] = []
    for block in body.split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            payload = block[len("data: ") :]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def assert_error(resp: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and "Traceback" not in err["message"]
    if param is not None:
        assert err["param"] == param, err
    return dict(err)


async def test_health_ready_models(client: httpx.AsyncClient) -> None:
    assert (await client.get("/healthz")).json() == {"status": "ok"}
    assert (await client.get("/readyz")).json()["status"] == "ready"
    models = (await client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN


async def test_completion_is_greedy_and_counts_usage(client: httpx.AsyncClient) -> None:
    req = {"model": MODEL, "prompt": "The old river keeps", "max_tokens": 12, "temperature": 0}
    first = (await client.post("/v1/completions", json=req)).json()
    second = (await client.post("/v1/completions", json=req)).json()
    assert first["object"] == "text_completion"
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    prompt_len = (await client.post("/tokenize", json={"prompt": req["prompt"]})).json()["count"]
    usage = first["usage"]
    assert usage["prompt_tokens"] == prompt_len
    assert 1 <= usage["completion_tokens"] <= 12
    assert usage["total_tokens"] == prompt_len + usage["completion_tokens"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}  # no LMCache here


async def test_token_id_prompt_equals_text_prompt(client: httpx.AsyncClient) -> None:
    ids = (await client.post("/tokenize", json={"prompt": "A quiet harbor"})).json()["tokens"]
    by_text = await client.post(
        "/v1/completions", json={"prompt": "A quiet harbor", "max_tokens": 6, "temperature": 0}
    )
    by_ids = await client.post(
        "/v1/completions", json={"prompt": ids, "max_tokens": 6, "temperature": 0}
    )
    assert by_text.json()["choices"][0]["text"] == by_ids.json()["choices"][0]["text"]


async def test_streamed_chat_equals_non_streamed(client: httpx.AsyncClient) -> None:
    body = {**CHAT, "max_tokens": 16, "temperature": 0}
    whole = (await client.post("/v1/chat/completions", json=body)).json()
    resp = await client.post(
        "/v1/chat/completions",
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    chunks, usage_chunk = events[:-2], events[-2]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    message = whole["choices"][0]["message"]
    assert message["role"] == "assistant"
    assert streamed == message["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == whole["usage"]


async def test_stop_string_cuts_the_output(client: httpx.AsyncClient) -> None:
    base = {"prompt": "Every sister went along the slow road", "max_tokens": 24, "temperature": 0}
    full = (await client.post("/v1/completions", json=base)).json()["choices"][0]["text"]
    assert len(full) > 8, full
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    cut = full[: full.index(stop)]
    for stream in (False, True):
        resp = await client.post("/v1/completions", json={**base, "stop": [stop], "stream": stream})
        if stream:
            chunks = [e for e in sse_events(resp.text) if e != "[DONE]"]
            text = "".join(c["choices"][0]["text"] for c in chunks)
            reason = chunks[-1]["choices"][0]["finish_reason"]
        else:
            text = resp.json()["choices"][0]["text"]
            reason = resp.json()["choices"][0]["finish_reason"]
        assert text == cut
        assert reason == "stop"


async def test_seeded_sampling_is_reproducible(client: httpx.AsyncClient) -> None:
    req = {"prompt": "The lamp", "max_tokens": 8, "temperature": 1.0, "seed": 7}
    a = (await client.post("/v1/completions", json=req)).json()["choices"][0]["text"]
    b = (await client.post("/v1/completions", json=req)).json()["choices"][0]["text"]
    assert a == b


async def test_concurrent_requests(client: httpx.AsyncClient) -> None:
    reqs = [
        {"prompt": f"Story number {i} begins", "max_tokens": 8, "temperature": 0} for i in range(4)
    ]
    alone = [(await client.post("/v1/completions", json=r)).json() for r in reqs]
    together = await asyncio.gather(*(client.post("/v1/completions", json=r) for r in reqs))
    for a, t in zip(alone, together, strict=True):
        assert t.json()["choices"][0]["text"] == a["choices"][0]["text"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "temperature": 2.5}, "temperature"),
        ({"prompt": "x", "temperature": -0.1}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "n": 2}, "n"),
        ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"prompt": "x", "model": "gpt-4"}, "model"),
        ({"prompt": "x", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
        ({"prompt": ["one", "two"]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({}, "prompt"),
    ],
)
async def test_bad_completion_requests(
    client: httpx.AsyncClient, body: dict[str, Any], param: str
) -> None:
    assert_error(await client.post("/v1/completions", json=body), 400, param)


async def test_prompt_longer_than_max_model_len(client: httpx.AsyncClient) -> None:
    long_prompt = " river" * (MAX_MODEL_LEN + 10)
    err = assert_error(
        await client.post("/v1/completions", json={"prompt": long_prompt}), 400, "prompt"
    )
    assert err["code"] == "context_length_exceeded"
    assert str(MAX_MODEL_LEN) in err["message"]
    chat = {"messages": [{"role": "user", "content": long_prompt}]}
    assert_error(await client.post("/v1/chat/completions", json=chat), 400, "messages")


async def test_token_outside_vocabulary_is_a_400(client: httpx.AsyncClient) -> None:
    err = assert_error(await client.post("/v1/completions", json={"prompt": [5, 99999]}), 400)
    assert "vocabulary" in err["message"]


async def test_malformed_json_and_non_objects(client: httpx.AsyncClient) -> None:
    headers = {"content-type": "application/json"}
    err = assert_error(
        await client.post("/v1/chat/completions", content=b'{"messages": [', headers=headers), 400
    )
    assert err["code"] == "invalid_json"
    err = assert_error(
        await client.post("/v1/completions", content=b"[1, 2]", headers=headers), 400
    )
    assert "JSON object" in err["message"]


async def test_bad_chat_requests(client: httpx.AsyncClient) -> None:
    assert_error(await client.post("/v1/chat/completions", json={"messages": []}), 400, "messages")
    bad_role = {"messages": [{"role": "wizard", "content": "hi"}]}
    assert_error(await client.post("/v1/chat/completions", json=bad_role), 400)
    image = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}
    assert_error(await client.post("/v1/chat/completions", json=image), 400, "messages")


async def test_unknown_fields_are_ignored_like_openai(client: httpx.AsyncClient) -> None:
    body = {**CHAT, "max_tokens": 2, "response_format": {"type": "text"}, "tools": None}
    assert (await client.post("/v1/chat/completions", json=body)).status_code == 200


async def test_unknown_route_is_openai_shaped(client: httpx.AsyncClient) -> None:
    assert_error(await client.get("/v1/engines"), 404)


async def test_pd_release_names_the_bad_field_and_is_refused_off_a_decoder(
    client: httpx.AsyncClient,
) -> None:
    assert_error(await client.post("/pd/release", json={"req_id": "r"}), 400, "prompt_token_ids")
    bad = {"prompt_token_ids": [1, -2]}
    assert_error(await client.post("/pd/release", json=bad), 400, "prompt_token_ids.1")
    err = assert_error(await client.post("/pd/release", json={"prompt_token_ids": [1, 2]}), 400)
    assert err["code"] == "pd_not_receiver" and "decode" in err["message"]


async def test_metrics_report_ttft_tokens_and_engine(client: httpx.AsyncClient) -> None:
    await client.post("/v1/completions", json={"prompt": "Metrics please", "max_tokens": 3})
    text = (await client.get("/metrics")).text
    for name in [
        'kvpool_worker_ttft_seconds_bucket{endpoint="completions",le="0.5"}',
        "kvpool_worker_generation_tokens_total",
        "kvpool_worker_generation_tokens_per_second",
        "kvpool_worker_prefix_hit_tokens_total",
        "kvpool_worker_ready 1.0",
        "kvpool_engine_generated_tokens_total",
        "kvpool_engine_kv_blocks_total 256.0",
    ]:
        assert name in text, name


async def test_sessions_feed_the_memory_api(
    client: httpx.AsyncClient, runtime: WorkerRuntime
) -> None:
    await client.post(
        "/v1/completions",
        json={"prompt": "Session prompt", "max_tokens": 1},
        headers={"X-Session-Id": "agent-7"},
    )
    await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1, "user": "u-1"})
    prompt = (await client.post("/tokenize", json={"prompt": "Session prompt"})).json()["tokens"]
    assert runtime.sessions.get("agent-7") == tuple(prompt)
    assert runtime.sessions.get("u-1") is not None
    # Without LMCache the engine has nothing to evict or pin, and says so with zeros.
    resp = await client.post("/memory/pin", json={"session_id": "agent-7"})
    assert resp.json() == {"prefix_tokens": len(prompt), "pinned_tokens": 0}
    resp = await client.post(
        "/memory/evict", json={"session_id": "agent-7", "tiers": ["local_cpu"]}
    )
    assert resp.json() == {"evicted_chunks": 0, "tiers": ["local_cpu"]}
    assert runtime.sessions.get("agent-7") is None  # evicted sessions are forgotten
    missing = assert_error(
        await client.post("/memory/prefetch", json={"session_id": "agent-7"}), 404, "session_id"
    )
    assert missing["code"] == "session_not_found"
    stats = (await client.get("/memory/stats")).json()
    assert stats["sessions"] >= 1 and "engine" in stats


@pytest.mark.parametrize(
    "body",
    [{}, {"text": "a", "token_ids": [1]}, {"token_ids": []}, {"chunk_hashes": [1], "text": "a"}],
)
async def test_memory_api_needs_exactly_one_selector(
    client: httpx.AsyncClient, body: dict[str, Any]
) -> None:
    assert_error(await client.post("/memory/evict", json=body), 400)


async def test_not_ready_until_the_engine_started() -> None:
    rt = WorkerRuntime(small_engine(), load_tokenizer())
    transport = httpx.ASGITransport(app=build_app(rt, start_engine=False))
    async with httpx.AsyncClient(transport=transport, base_url="http://w") as c:
        assert (await c.get("/readyz")).status_code == 503
        assert (await c.get("/healthz")).status_code == 200
        err = assert_error(await c.post("/v1/completions", json={"prompt": "x"}), 503)
        assert err["code"] == "starting"
        await rt.start_engine()
        assert (await c.get("/readyz")).status_code == 200
        assert (await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})).is_success
        rt.begin_drain()
        assert (await c.get("/readyz")).json() == {"status": "draining"}
        assert assert_error(await c.post("/tokenize", json={"prompt": "x"}), 503)["code"] == (
            "draining"
        )
    await rt.engine.shutdown(2.0)


class _StuckOffload:
    """A KV offload whose lookup blocks until ``release`` is set: the fault injected (an
    LMCache call that never returns, as its PD sender's did towards a dead decoder; a real
    one cannot be made to block on demand). Everything else does nothing."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def lookup(self, token_ids: Any) -> int:
        self.release.wait(60)
        return 0

    def retrieve(self, *args: Any, **kwargs: Any) -> int:
        return 0

    def store(self, *args: Any, **kwargs: Any) -> None:
        return None

    def evict(self, **kwargs: Any) -> int:
        return 0

    def prefetch(self, token_ids: Any) -> int:
        return 0

    def pin(self, token_ids: Any) -> int:
        return 0

    def unpin(self, token_ids: Any) -> int:
        return 0

    def memory_stats(self) -> dict[str, object]:
        return {}

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self, deadline_s: float) -> None:
        self.release.set()


async def test_a_stuck_engine_step_makes_the_worker_unready_until_it_ends() -> None:
    offload = _StuckOffload()
    opts = ReferenceEngineOptions(max_model_len=MAX_MODEL_LEN, num_kv_blocks=256, max_num_seqs=4)
    engine = ReferenceEngine(opts, offload, model_overrides=SMALL_MODEL)  # type: ignore[arg-type]
    rt = WorkerRuntime(engine, load_tokenizer(), stall_timeout_s=0.3)
    transport = httpx.ASGITransport(app=build_app(rt, start_engine=False))
    async with httpx.AsyncClient(transport=transport, base_url="http://w", timeout=60) as c:
        await rt.start_engine()
        assert (await c.get("/readyz")).status_code == 200
        stuck = asyncio.create_task(
            c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        )
        for _ in range(600):  # bounded: the step is stuck until released
            ready = await c.get("/readyz")
            if ready.status_code == 503:
                break
            await asyncio.sleep(0.05)
        assert ready.json() == {"status": "stalled"}
        refused = await c.post("/v1/completions", json={"prompt": "y", "max_tokens": 1})
        assert assert_error(refused, 503)["code"] == "stalled"
        assert refused.headers["retry-after"] == "1"
        offload.release.set()
        assert (await stuck).status_code == 200
        assert (await c.get("/readyz")).status_code == 200
    await engine.shutdown(2.0)
