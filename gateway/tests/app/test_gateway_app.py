"""The gateway's own logic, in process, in front of scripted fake workers (tests/fakes.py):
routing by the controller's hits, SSE pass-through, retries, breakers, 429 under 2x
saturation, disconnects, error shapes, auth and rate limits, the memory fan-out, and the
controller-down fallback. Fakes only because each scenario needs a worker that fails on cue;
real workers are in tests/integration. Everything binds 127.0.0.1 and is bounded in time.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from apphost import CHUNK, PROMPT, gateway, metric
from fakes import ControllerScript, Script

from kvpool.gateway.config import GatewayEnv, parse_config
from kvpool.gateway.instances import probe_all
from kvpool.gateway.routing import P2P_LOCATION
from kvpool.gateway.state import build_state

pytestmark = pytest.mark.timeout(60)


async def test_routes_to_the_instance_the_controller_says_holds_the_prefix() -> None:
    a, b = Script("a"), Script("b")
    ctl = ControllerScript(hits={"b~fp": 3})
    async with gateway([a, b], ctl) as (client, _):
        r = await client.post("/v1/completions", json=PROMPT)
        assert r.status_code == 200, r.text
        assert r.headers["x-kvpool-instance"] == "b"
        assert r.headers["x-kvpool-route-reason"] == "kv-hit"
        assert r.headers["x-kvpool-predicted-hit-tokens"] == str(3 * CHUNK)
        assert r.json()["choices"][0]["text"] == "from b"
        assert len(b.requests) == 1 and not a.requests
        m = (await client.get("/metrics")).text
        assert (
            metric(m, 'kvpool_gateway_routing_decisions_total{instance="b",reason="kv-hit"}') == 1
        )
        assert metric(m, 'kvpool_gateway_predicted_hit_tokens_total{instance="b"}') == 12
        assert metric(m, 'kvpool_gateway_route_ttft_seconds_count{reason="kv-hit"}') == 1


async def test_an_unchanged_body_is_forwarded_as_the_client_sent_its_bytes() -> None:
    a = Script("a")
    async with gateway([a], ControllerScript()) as (client, _):
        raw = b'{ "max_tokens": 3,  "prompt": "abcdefghijklmnop", "x_extra": [1, 2.50] }'
        headers = {"content-type": "application/json"}
        r = await client.post("/v1/completions", content=raw, headers=headers)
        assert r.status_code == 200, r.text
        assert a.raw_bodies == [raw]  # not parsed and serialised again on the way


async def test_streams_sse_through_and_forwards_the_session() -> None:
    a = Script("a", events=3)
    async with gateway([a], ControllerScript()) as (client, _):
        body = {**PROMPT, "stream": True, "user": "alice"}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            lines = [ln async for ln in r.aiter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert [json.loads(x[6:])["choices"][0]["text"] for x in lines[:-1]] == [
            "a:0 ",
            "a:1 ",
            "a:2 ",
        ]
        assert a.headers[0]["x-session-id"] == "alice"


async def test_503s_are_retried_on_another_instance() -> None:
    a, b = Script("a", fail_503=5), Script("b", fail_503=5)
    async with gateway([a, b], ControllerScript(hits={"a~x": 4})) as (client, _):
        a.fail_503 = 1
        b.fail_503 = 0
        r = await client.post("/v1/completions", json=PROMPT)
        assert r.status_code == 200 and r.headers["x-kvpool-instance"] == "b"
        m = (await client.get("/metrics")).text
        assert metric(m, 'kvpool_gateway_retries_total{reason="status_503"}') == 1
        # every instance draining: 503 in OpenAI's shape, never a traceback
        a.fail_503, b.fail_503 = 10, 10
        r = await client.post("/v1/completions", json=PROMPT)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        err = r.json()["error"]
        assert err["code"] == "unavailable" and "draining" in err["message"]


async def test_connect_errors_retry_and_open_the_breaker() -> None:
    a = Script("a")
    slow_probes = {"limits": {"healthIntervalSeconds": 30, "retries": 2}}  # probes stay out
    async with gateway(
        [a], ControllerScript(hits={"dead~x": 4}), dead=["dead"], extra=slow_probes
    ) as (client, state):
        dead = state.instances.by_name["dead"]
        for i in range(10):  # new prompts: no pending entry of the previous one for "a"
            dead.ready = True  # as if its last probe had passed: the index sends us there
            r = await client.post("/v1/completions", json={"prompt": f"{i}bcdefghijklmnop"})
            assert r.status_code == 200 and r.headers["x-kvpool-instance"] == "a"
            if dead.breaker.state.value == "open":
                break
        m = (await client.get("/metrics")).text
        assert metric(m, 'kvpool_gateway_retries_total{reason="connect"}') == 3
        assert dead.breaker.state.value == "open"  # after 3 consecutive failures
        dead.ready = True
        await client.post("/v1/completions", json={"prompt": "zbcdefghijklmnop"})
        m = (await client.get("/metrics")).text  # the open breaker kept it out: no 4th try
        assert (
            metric(m, 'kvpool_gateway_upstream_errors_total{instance="dead",kind="connect"}') == 3
        )
        ready = (await client.get("/readyz")).json()
        assert ready["instances"]["dead"]["breaker"] == "open"


async def test_a_frozen_instance_is_avoided_while_another_can_take_the_request() -> None:
    """An instance whose LMCache is in a full-sync freeze (its /readyz says frozen) stores
    nothing it prefills: the index's holder is passed over for a thawed instance, and used
    again when every instance is frozen (answering beats refusing)."""
    a, b = Script("a", frozen=True), Script("b")
    async with gateway([a, b], ControllerScript(hits={"a~x": 4})) as (client, state):
        ready = (await client.get("/readyz")).json()
        assert ready["instances"]["a"]["frozen"] is True
        r = await client.post("/v1/completions", json=PROMPT)
        assert r.status_code == 200 and r.headers["x-kvpool-instance"] == "b"
        b.frozen = True
        await probe_all(state.http, state.instances, state.metrics, 2.0)
        r = await client.post("/v1/completions", json={"prompt": "another prompt entirely"})
        assert r.status_code == 200  # every instance frozen: still served
        a.frozen = b.frozen = False
        await probe_all(state.http, state.instances, state.metrics, 2.0)
        assert not state.instances.frozen
        r = await client.post("/v1/completions", json={"prompt": "a third prompt, fresh"})
        assert r.status_code == 200


async def test_an_upstream_that_never_answers_is_a_504() -> None:
    slow = Script("slow", first_byte_delay_s=5)
    extra = {"limits": {"upstreamTimeoutSeconds": 0.5, "retries": 0}}
    async with gateway([slow], ControllerScript(), extra=extra) as (client, _):
        r = await client.post("/v1/completions", json=PROMPT)
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"


async def test_instance_killed_mid_stream_ends_the_stream_with_an_error_event() -> None:
    a = Script("a", events=5, cut_after_events=2)
    async with gateway([a], ControllerScript()) as (client, _):
        async with client.stream("POST", "/v1/completions", json={**PROMPT, "stream": True}) as r:
            assert r.status_code == 200
            lines = [ln async for ln in r.aiter_lines() if ln.startswith("data: ")]
        payloads = [json.loads(x[6:]) for x in lines]
        assert [p["choices"][0]["text"] for p in payloads[:2]] == ["a:0 ", "a:1 "]
        assert payloads[-1]["error"]["code"] == "upstream_cut"
        assert "Traceback" not in "".join(lines)


async def test_client_disconnect_cancels_the_upstream_request() -> None:
    a = Script("a", events=200, event_delay_s=0.05)
    async with gateway([a], ControllerScript()) as (client, state):
        async with client.stream("POST", "/v1/completions", json={**PROMPT, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break
        for _ in range(100):
            if a.cancelled:
                break
            await asyncio.sleep(0.05)
        assert a.cancelled == 1 and a.completed == 0
        for _ in range(50):
            if state.admission.inflight == 0:
                break
            await asyncio.sleep(0.05)
        assert state.admission.inflight == 0 and state.load.load("a").inflight == 0


@pytest.mark.parametrize(
    ("content", "param", "code"),
    [
        (b"{not json", None, "invalid_json"),
        (b"[1, 2]", None, "invalid_json"),
        (json.dumps({"prompt": {"x": 1}}).encode(), "prompt", "invalid_value"),
        (json.dumps({"prompt": "x", "max_tokens": 0}).encode(), "max_tokens", "invalid_value"),
        (json.dumps({"prompt": "x", "stream": "sometimes"}).encode(), "stream", "invalid_value"),
        (json.dumps({"prompt": ["a", "b"]}).encode(), "prompt", "invalid_value"),
    ],
)
async def test_malformed_bodies_are_400s_naming_the_field(
    content: bytes, param: str | None, code: str
) -> None:
    async with gateway([Script("a")], ControllerScript()) as (client, _):
        r = await client.post("/v1/completions", content=content)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == code and err["param"] == param
        chat = await client.post("/v1/chat/completions", json={"messages": []})
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"


async def test_oversized_body_is_413_and_unknown_model_is_404() -> None:
    async with gateway(
        [Script("a")], ControllerScript(), extra={"limits": {"maxBodyBytes": 2048}}
    ) as (
        client,
        _,
    ):
        r = await client.post("/v1/completions", json={"prompt": "x" * 5000})
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
        r = await client.post("/v1/completions", json={"prompt": "x", "model": "other"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"


async def test_twice_the_capacity_gets_429_with_retry_after() -> None:
    a = Script("a", first_byte_delay_s=0.5)
    limits = {"limits": {"maxInflight": 2, "maxQueue": 2, "queueTimeoutSeconds": 5, "retries": 0}}
    async with gateway([a], ControllerScript(), extra=limits) as (client, _):
        results = await asyncio.gather(
            *(client.post("/v1/completions", json=PROMPT) for _ in range(8))
        )
        codes = sorted(r.status_code for r in results)
        assert codes.count(200) == 4 and codes.count(429) == 4  # 2 in flight + 2 queued
        refused = next(r for r in results if r.status_code == 429)
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "saturated"
        m = (await client.get("/metrics")).text
        assert metric(m, 'kvpool_gateway_requests_total{endpoint="completions",status="429"}') == 4
        assert metric(m, 'kvpool_gateway_requests_total{endpoint="completions",status="200"}') == 4
        assert metric(m, 'kvpool_gateway_rejections_total{reason="saturated"}') == 4


async def test_controller_down_serves_by_fallback_and_readyz_says_degraded() -> None:
    a, b = Script("a"), Script("b")
    async with gateway([a, b], None) as (client, _):
        ready = await client.get("/readyz")
        assert ready.status_code == 200 and ready.json()["status"] == "degraded"
        r = await client.post("/v1/completions", json=PROMPT)
        assert r.status_code == 200 and r.headers["x-kvpool-route-reason"] == "fallback-least-load"
        r = await client.post("/v1/completions", json=PROMPT, headers={"x-session-id": "s"})
        assert r.headers["x-kvpool-route-reason"] == "fallback-session"


async def test_no_ready_instance_is_503_and_readyz_unavailable() -> None:
    a = Script("a", ready=False)
    async with gateway([a], ControllerScript()) as (client, _):
        assert (await client.get("/readyz")).status_code == 503
        r = await client.post("/v1/completions", json={"prompt": [1, 2, 3]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_instance_available"
        assert r.headers["retry-after"] == "1"  # a client that retries waits a probe, not less


@pytest.mark.parametrize(
    ("tokenizer", "code"), [("reference", "upstream_unreachable"), (None, "tokenize_failed")]
)
async def test_every_instance_unreachable_is_502_with_retry_after(
    tokenizer: str | None, code: str
) -> None:
    extra: dict[str, Any] = {"limits": {"healthIntervalSeconds": 30, "retries": 1}}  # no probes
    if tokenizer:
        extra["tokenizer"] = tokenizer  # else the gateway tokenizes on an instance, and fails
    async with gateway([], dead=["d0", "d1"], extra=extra) as (client, state):
        for name in ("d0", "d1"):
            state.instances.by_name[name].ready = True  # as if their last probe had passed
        r = await client.post("/v1/completions", json={"prompt": "abcdefghijklmnop"})
    assert r.status_code == 502 and r.json()["error"]["code"] == code, r.text
    assert r.headers["retry-after"] == "1"


async def test_the_health_loop_waits_an_interval_after_the_start_probe() -> None:
    """The flake of the test above: the health loop probed again at once after the start's
    probe, so an instance set ready right after the start was marked not ready again (two
    failed probes in a row) whenever that probe landed before the request, and the request got
    503 (or a tokenizer with no ready instance) instead of the 502 it tests."""
    extra: dict[str, Any] = {"limits": {"healthIntervalSeconds": 30}}
    async with gateway([], dead=["d0"], extra=extra) as (_client, state):
        inst = state.instances.by_name["d0"]
        assert inst.probe_failures == 1  # the start's probe
        for _ in range(20):  # give a loop that probed at once every chance to
            await asyncio.sleep(0.01)
        assert inst.probe_failures == 1


async def test_api_keys_and_rate_limit() -> None:
    extra = {"limits": {"rateLimit": {"requestsPerSecond": 0.01, "burst": 2}}}
    env = {"auth_token": "k1,k2"}
    async with gateway([Script("a")], ControllerScript(), extra=extra, env=env) as (client, _):
        assert (await client.post("/v1/completions", json=PROMPT)).status_code == 401
        bad = await client.post(
            "/v1/completions", json=PROMPT, headers={"authorization": "Bearer nope"}
        )
        assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        assert (await client.post("/v1/chat/completions", json=chat)).status_code == 401
        assert (await client.get("/v1/models")).status_code == 401
        ok = {"authorization": "Bearer k2"}
        assert (await client.post("/v1/completions", json=PROMPT, headers=ok)).status_code == 200
        assert (await client.post("/v1/completions", json=PROMPT, headers=ok)).status_code == 200
        limited = await client.post("/v1/completions", json=PROMPT, headers=ok)
        assert limited.status_code == 429 and int(limited.headers["retry-after"]) >= 1
        # probes need no key
        assert (await client.get("/healthz")).status_code == 200


async def test_pinning_header_moves_a_request_on_purpose() -> None:
    a, b = Script("a"), Script("b")
    async with gateway([a, b], ControllerScript(hits={"a~x": 4})) as (client, state):
        r = await client.post("/v1/completions", json=PROMPT, headers={"x-kvpool-instance": "b"})
        assert (
            r.headers["x-kvpool-instance"] == "b" and r.headers["x-kvpool-route-reason"] == "pinned"
        )
        r = await client.post("/v1/completions", json=PROMPT, headers={"x-kvpool-instance": "zz"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "x-kvpool-instance"
        assert state.admission.inflight == 0  # refused before it took a slot


async def test_memory_api_fans_out_and_reports_per_instance() -> None:
    a, b = Script("a"), Script("b")
    async with gateway([a, b], ControllerScript(hits={"b~x": 2})) as (client, state):
        await client.post("/v1/completions", json=PROMPT, headers={"x-session-id": "s1"})
        hashes = state.hasher(list(b"abcdefghijklmnop"))
        pending = state.selector.pending
        assert pending.hits(hashes, state.selector.clock())  # credited where it was sent
        ev = await client.post(
            "/memory/evict", json={"session_id": "s1", "tiers": ["LocalCPUBackend"]}
        )
        assert ev.status_code == 200, ev.text
        assert pending.hits(hashes, state.selector.clock()) == {}  # no credit for evicted KV
        body = ev.json()
        assert set(body["instances"]) == {"a", "b"} and body["ok"]
        assert a.memory_calls[0] == (
            "evict",
            {"token_ids": list(b"abcdefghijklmnop"), "tiers": ["LocalCPUBackend"]},
        )
        # the session is forgotten after a pool-wide evict
        again = await client.post("/memory/evict", json={"session_id": "s1"})
        assert again.status_code == 404 and again.json()["error"]["code"] == "session_not_found"
        pf = await client.post("/memory/prefetch", json={"token_ids": [1, 2, 3, 4, 5, 6, 7, 8]})
        assert list(pf.json()["instances"]) == ["b"]  # the instance the router would pick
        pin = await client.post("/memory/pin", json={"text": "abcdefgh"})
        assert list(pin.json()["instances"]) == ["b"]  # the holder the index names
        bad = await client.post("/memory/pin", json={"chunk_hashes": [1]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "chunk_hashes"
        two = await client.post("/memory/evict", json={"token_ids": [1], "text": "x"})
        assert two.status_code == 400


async def test_a_new_prefix_s_followers_go_where_it_was_just_computed() -> None:
    """Before any admit reaches the controller, the pending entry of the request that just
    computed a new prefix keeps the requests that follow it on that instance. (A burst that
    arrives while it still prefills is spread instead: with the default weights the queue it
    would wait behind costs as much as computing the prefix elsewhere.)"""
    scripts = [Script(n, first_byte_delay_s=0.3) for n in ("a", "b", "c")]
    async with gateway(scripts, ControllerScript()) as (client, _):
        prompt = " ".join(f"a brand new shared system prompt, part {i}." for i in range(20))
        body = {"prompt": prompt, "max_tokens": 2}
        first = await client.post("/v1/completions", json=body)
        assert first.status_code == 200
        results = await asyncio.gather(
            *(client.post("/v1/completions", json=body) for _ in range(4))
        )
        assert {r.status_code for r in results} == {200}
        assert {r.headers["x-kvpool-instance"] for r in results} == {
            first.headers["x-kvpool-instance"]
        }
        assert {r.headers["x-kvpool-route-reason"] for r in results} == {"kv-hit"}


def test_a_p2p_peer_counts_its_group_s_chunks_at_the_p2p_tier() -> None:
    """In a P2PGroup a peer can pull what another member holds: the others get that prefix
    as a p2p-tier hit (worth less than holding it, more than nothing)."""
    from kvpool.gateway.routing import PrefixHit, weighted_hit_tokens
    from kvpool.gateway.selection import Prompt

    raw = {
        "model": "m",
        "chunkSize": CHUNK,
        "controllerUrl": "http://127.0.0.1:1",
        "p2pGroups": [{"name": "g", "instances": [
            {"name": "a", "url": "http://127.0.0.1:1"}, {"name": "b", "url": "http://127.0.0.1:2"}]}],
    }  # fmt: skip
    state = build_state(parse_config(raw), GatewayEnv())
    for inst in state.instances:
        inst.ready = True
    prompt = Prompt(16, (1, 2, 3, 4), None)
    hits = {"a": PrefixHit(4, {"LocalCPUBackend": 4})}
    cands = {
        c.name: c for c in state.selector.candidates(state.instances.peers(), prompt, hits, set())
    }
    assert cands["a"].hit == hits["a"]
    assert cands["b"].hit == PrefixHit(4, {P2P_LOCATION: 4})
    a_w, b_w = (weighted_hit_tokens(cands[n].hit, CHUNK, 16) for n in ("a", "b"))
    assert a_w > b_w > 0


async def test_a_hot_prefix_does_not_collapse_the_pool_onto_its_holder() -> None:
    scripts = [Script(n, first_byte_delay_s=0.5) for n in ("a", "b", "c")]
    extra = {"guards": {"imbalanceAbs": 4}}
    async with gateway(scripts, ControllerScript(hits={"a~x": 4}), extra=extra) as (client, _):
        results = await asyncio.gather(
            *(client.post("/v1/completions", json=PROMPT) for _ in range(18))
        )
        where = [r.headers["x-kvpool-instance"] for r in results]
        assert where.count("a") <= 8  # it leads by at most imbalanceAbs in flight
        assert where.count("b") + where.count("c") >= 10
        # the others got it as a hit too: the prefix was routed there moments ago (pending)
        assert {r.headers["x-kvpool-route-reason"] for r in results} <= {
            "kv-hit",
            "imbalance-guard",
        }
