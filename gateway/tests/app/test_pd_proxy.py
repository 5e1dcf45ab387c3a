"""The PD proxy's own logic against a scripted prefill and decode worker (fakes: the test
needs to control when the transfer-done notification is sent, which a real transfer does
not allow): the prefill carries the disagg spec, the decode waits for every rank's
``ProxyNotif`` (sent with LMCache's wire encoding), the decode gets ``prompt + [first_tok]``
and ``max_tokens - 1``, the client gets the first token then the decoder's stream, in
completion or chat shape."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio
from fakes import bound_socket, serving
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvpool.gateway.app import build_app
from kvpool.gateway.config import GatewayEnv, parse_config
from kvpool.gateway.pd import ProxyNotif
from kvpool.gateway.state import build_state

pytestmark = pytest.mark.timeout(60)
NOTIF_DELAY_S = 0.4


def free_port() -> int:
    s = bound_socket()
    port = int(s.getsockname()[1])
    s.close()
    return port


def prefill_app(proxy_port: int, log: dict[str, Any]) -> FastAPI:
    app = FastAPI()
    ctx = zmq.asyncio.Context.instance()

    @app.get("/readyz")
    async def readyz() -> dict[str, str]:
        return {"status": "ready"}

    @app.post("/tokenize")
    async def tokenize(body: dict[str, Any]) -> dict[str, Any]:
        return {"tokens": [3, 1, 4], "count": 3}

    async def notify(req_id: str, ranks: int) -> None:
        await asyncio.sleep(NOTIF_DELAY_S)
        sock = ctx.socket(zmq.PUSH)
        sock.connect(f"tcp://127.0.0.1:{proxy_port}")
        for _ in range(ranks):
            await sock.send(msgspec.msgpack.encode(ProxyNotif(req_id=req_id)))
        log["notified_at"] = time.monotonic()
        await asyncio.sleep(0.05)
        sock.close(linger=1000)

    @app.post("/v1/completions")
    async def complete(body: dict[str, Any]) -> Response:
        log["prefill"] = body
        answer = {
            "id": "p",
            "object": "text_completion",
            "created": 1,
            "model": "m",
            "choices": [{"index": 0, "text": "P", "finish_reason": log.get("finish", "length")}],
            "usage": {
                "prompt_tokens": len(body["prompt"]),
                "completion_tokens": 1,
                "total_tokens": 0,
            },
        }
        if "kv_transfer_params" not in body:  # a plain completion: nothing is transferred
            return JSONResponse(answer)
        spec = body["kv_transfer_params"]["disagg_spec"]
        log["task"] = asyncio.create_task(notify(spec["req_id"], len(spec["receiver_init_port"])))
        return JSONResponse(
            {**answer, "kv_transfer_params": {"first_tok": 77, "req_id": spec["req_id"]}}
        )

    return app


def decode_app(log: dict[str, Any]) -> FastAPI:
    app = FastAPI()

    @app.post("/pd/release")
    async def release(body: dict[str, Any]) -> dict[str, Any]:
        log.setdefault("released", []).append(body)
        log["released_at"] = time.monotonic()
        return {"req_id": body["req_id"], "released_chunks": 1}

    @app.get("/readyz")
    async def readyz() -> dict[str, str]:
        return {"status": "ready"}

    @app.post("/tokenize")
    async def tokenize(body: dict[str, Any]) -> dict[str, Any]:
        return {"tokens": [3, 1, 4], "count": 3}

    @app.post("/v1/completions")
    async def complete(body: dict[str, Any]) -> Response:
        log["decode"] = body
        log["decoded_at"] = time.monotonic()
        chunk = {"id": "d", "object": "text_completion", "created": 1, "model": "m"}
        if not body.get("stream"):
            choice = {"index": 0, "text": "DD", "finish_reason": "length"}
            use = {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}
            return JSONResponse({**chunk, "choices": [choice], "usage": use})

        async def events() -> AsyncIterator[bytes]:
            for i, fr in ((0, None), (1, "length")):
                obj = {**chunk, "choices": [{"index": 0, "text": f"D{i}", "finish_reason": fr}]}
                yield f"data: {json.dumps(obj)}\n\n".encode()
            if (body.get("stream_options") or {}).get("include_usage"):
                use = {"prompt_tokens": len(body["prompt"]), "completion_tokens": 2,
                       "total_tokens": len(body["prompt"]) + 2}  # fmt: skip
                yield f"data: {json.dumps({**chunk, 'choices': [], 'usage': use})}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def unavailable_app() -> FastAPI:
    """A prefill instance that is up but answers every completion with 503 (draining)."""
    app = FastAPI()

    @app.get("/readyz")
    async def readyz() -> dict[str, str]:
        return {"status": "ready"}

    @app.post("/v1/completions")
    async def complete() -> Response:
        return JSONResponse({"error": {"message": "draining"}}, status_code=503)

    return app


@contextlib.asynccontextmanager
async def pd_gateway(
    log: dict[str, Any], limits: dict[str, Any] | None = None, *, unavailable_first: bool = False
) -> AsyncIterator[httpx.AsyncClient]:
    """The gateway in front of a scripted pair; ``unavailable_first``: pre-0 answers 503 and
    the working prefill is pre-1."""
    proxy_port = free_port()
    async with contextlib.AsyncExitStack() as stack:
        pre = await stack.enter_async_context(serving(prefill_app(proxy_port, log)))
        dec = await stack.enter_async_context(serving(decode_app(log)))
        prefills = [{"name": "pre-0", "url": pre}]
        if unavailable_first:
            down = await stack.enter_async_context(serving(unavailable_app()))
            prefills = [{"name": "pre-0", "url": down}, {"name": "pre-1", "url": pre}]
        raw = {
            "model": "m",
            "chunkSize": 4,
            "controllerUrl": "http://127.0.0.1:1",
            "pdPairs": [{
                "name": "pair", "mode": "push", "proxyPort": proxy_port, "prefill": prefills,
                "decode": [{"name": "dec-0", "url": dec, "host": "10.1.2.3",
                            "initPorts": [5001, 5002], "allocPorts": [6001, 6002]}],
            }],
            "limits": limits or {},
        }  # fmt: skip
        state = build_state(parse_config(raw), GatewayEnv(), pd_bind_host="127.0.0.1")
        url = await stack.enter_async_context(serving(build_app(state)))
        yield await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=20))


async def test_completion_prefills_waits_for_every_rank_then_decodes() -> None:
    log: dict[str, Any] = {}
    async with pd_gateway(log) as client:
        body = {"prompt": [5, 6, 7, 8, 9], "max_tokens": 3, "temperature": 0}
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.headers["x-kvpool-instance"] == "pre-0,dec-0"
        out = r.json()
        explained = (await client.get(f"/v1/requests/{r.headers['x-request-id']}/explain")).json()
    pre = log["prefill"]
    assert pre["prompt"] == [5, 6, 7, 8, 9] and pre["max_tokens"] == 1 and pre["stream"] is False
    assert pre["kv_transfer_params"]["ret_first_tok"] is True
    spec = pre["kv_transfer_params"]["disagg_spec"]
    assert spec["receiver_host"] == "10.1.2.3"
    assert (spec["receiver_init_port"], spec["receiver_alloc_port"]) == ([5001, 5002], [6001, 6002])
    dec = log["decode"]
    assert dec["prompt"] == [5, 6, 7, 8, 9, 77] and dec["max_tokens"] == 2
    assert "kv_transfer_params" not in dec and dec["temperature"] == 0
    assert log["decoded_at"] >= log["notified_at"]  # decode only after both ranks reported
    assert out["choices"][0]["text"] == "PDD"
    assert out["usage"]["completion_tokens"] == 3 and out["usage"]["prompt_tokens"] == 5
    decode, prefill = explained["routing"]  # both decisions; the prefill carries the decoder's
    assert (prefill["role"], prefill["instance"]) == ("prefill", "pre-0")
    assert (decode["role"], decode["instance"]) == ("decode", "dec-0")
    assert decode["reason"] == "pd-decode-least-load" and "by transfer" in decode["why"]


async def test_streamed_chat_through_pd_is_in_chat_shape() -> None:
    log: dict[str, Any] = {}
    async with pd_gateway(log) as client:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = [ln[6:] async for ln in r.aiter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(x) for x in lines[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "P"}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "PD0D1"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert log["decode"]["stream"] is True


@pytest.mark.parametrize("chat", [False, True])
async def test_streamed_usage_counts_the_prefills_token(chat: bool) -> None:
    log: dict[str, Any] = {}
    body: dict[str, Any] = {"max_tokens": 3, "stream": True,
                            "stream_options": {"include_usage": True}}  # fmt: skip
    if chat:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = [5, 6, 7, 8, 9]
    async with pd_gateway(log) as client:
        path = "/v1/chat/completions" if chat else "/v1/completions"
        async with client.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            lines = [ln[6:] async for ln in r.aiter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]" and log["decode"]["stream_options"] == {"include_usage": True}
    (usage,) = [json.loads(x)["usage"] for x in lines[:-1] if json.loads(x).get("usage")]
    prompt = len(log["prefill"]["prompt"])  # the decoder was sent one token more
    assert usage == {"prompt_tokens": prompt, "completion_tokens": 3, "total_tokens": prompt + 3}


async def test_max_tokens_one_is_answered_by_the_prefill_alone() -> None:
    log: dict[str, Any] = {}
    async with pd_gateway(log) as client:
        r = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "P"
        assert "kv_transfer_params" not in r.json()
    assert "decode" not in log
    assert "kv_transfer_params" not in log["prefill"]  # nothing to decode: nothing transferred


async def wait_for(log: dict[str, Any], key: str, timeout_s: float = 5.0) -> Any:
    end = time.monotonic() + timeout_s
    while key not in log and time.monotonic() < end:
        await asyncio.sleep(0.02)
    return log.get(key)


async def test_a_first_token_that_ends_the_answer_releases_the_landed_transfer() -> None:
    log: dict[str, Any] = {"finish": "stop"}
    async with pd_gateway(log) as client:
        r = await client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 5})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "P"
        released = await wait_for(log, "released")
        metrics = (await client.get("/metrics")).text
    assert "decode" not in log
    req_id = log["prefill"]["kv_transfer_params"]["disagg_spec"]["req_id"]
    assert released == [{"req_id": req_id, "prompt_token_ids": [5, 6, 7]}]
    assert log["released_at"] >= log["notified_at"]  # never while the sender may still write
    assert 'kvpool_gateway_pd_releases_total{outcome="released",pair="pair"} 1.0' in metrics
    assert 'kvpool_gateway_pd_requests_total{outcome="prefill_only",pair="pair"} 1.0' in metrics


async def test_a_client_gone_before_the_decode_is_not_decoded_and_its_transfer_released() -> None:
    log: dict[str, Any] = {}
    async with pd_gateway(log) as client:
        body = {"prompt": [5, 6, 7], "max_tokens": 5}
        with pytest.raises(httpx.ReadTimeout):  # leaves while the transfer is on its way
            await client.post("/v1/completions", json=body, timeout=NOTIF_DELAY_S / 2)
        released = await wait_for(log, "released")
        metrics = (await client.get("/metrics")).text
    assert released is not None and released[0]["prompt_token_ids"] == [5, 6, 7]
    assert "decode" not in log  # the decoder's time is not spent on nobody
    assert 'kvpool_gateway_pd_requests_total{outcome="client_gone",pair="pair"} 1.0' in metrics


async def test_a_transfer_landing_after_the_decode_started_is_released() -> None:
    log: dict[str, Any] = {}
    async with pd_gateway(log, {"pdTransferTimeoutSeconds": NOTIF_DELAY_S * 0.75}) as client:
        r = await client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "PDD"
        released = await wait_for(log, "released")
        metrics = (await client.get("/metrics")).text
    assert released is not None
    assert log["decoded_at"] < log["notified_at"] <= log["released_at"]  # decoded, recomputing
    assert 'kvpool_gateway_pd_requests_total{outcome="recomputed",pair="pair"} 1.0' in metrics
    assert 'kvpool_gateway_pd_releases_total{outcome="released",pair="pair"} 1.0' in metrics


async def test_a_prefill_instance_answering_503_is_retried_on_another_by_the_proxy() -> None:
    log: dict[str, Any] = {}
    async with pd_gateway(log, unavailable_first=True) as client:
        r = await client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert r.headers["x-kvpool-instance"] == "pre-1,dec-0"
        metrics = (await client.get("/metrics")).text
    assert r.json()["choices"][0]["text"] == "PDD" and "released" not in log
    assert 'kvpool_gateway_retries_total{reason="status_503"} 1.0' in metrics
    assert 'kvpool_gateway_upstream_errors_total{instance="pre-0",kind="status_503"} 1.0' in metrics
    assert (
        'kvpool_gateway_routing_decisions_total{instance="dec-0",reason="pd-decode-least-load"}'
        in metrics
    )
