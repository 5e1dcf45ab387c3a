"""``x-request-id`` on every completion answer, ``GET /v1/requests/{id}/explain``, its dry run
and ``kvpool-gateway explain``, in process against the scripted fake workers and controller of
test_gateway_app (fakes: the routing facts must be exact; the reasons on real workers are in
tests/integration/test_real_explain.py)."""

from __future__ import annotations

import asyncio
import json

import pytest
from apphost import CHUNK, PROMPT, gateway
from fakes import ControllerScript, Script

from kvpool.gateway.cli import main

pytestmark = pytest.mark.timeout(60)


async def test_every_answer_carries_its_request_id_and_the_worker_gets_it() -> None:
    a = Script("a")
    async with gateway([a], ControllerScript()) as (client, _):
        r = await client.post("/v1/completions", json=PROMPT)
        assert r.status_code == 200 and len(r.headers["x-request-id"]) == 32
        assert a.headers[-1]["x-request-id"] == r.headers["x-request-id"]
        r = await client.post("/v1/completions", json=PROMPT, headers={"x-request-id": "job-7.1"})
        assert r.headers["x-request-id"] == "job-7.1"
        bad = await client.post("/v1/completions", json=PROMPT, headers={"x-request-id": "a b"})
        assert bad.headers["x-request-id"] not in ("a b", "")
        refused = await client.post("/v1/completions", json={"prompt": 5})
        assert refused.status_code == 400 and refused.headers["x-request-id"]
        async with client.stream("POST", "/v1/completions", json={**PROMPT, "stream": True}) as s:
            assert s.headers["x-request-id"]


async def test_explain_tells_the_routing_and_why_the_last_chunk_missed() -> None:
    a, b = Script("a"), Script("b")
    ctl = ControllerScript(hits={"b~fp": 3})  # 3 of the prompt's 4 chunks, on b
    async with gateway([a, b], ctl) as (client, _):
        first = await client.post("/v1/completions", json=PROMPT)
        second = await client.post("/v1/completions", json=PROMPT)
        reports = []
        for r in (first, second):
            got = await client.get(f"/v1/requests/{r.headers['x-request-id']}/explain")
            assert got.status_code == 200, got.text
            reports.append(got.json())
    report, again = reports
    assert report["chunks"] == 4 and report["chunk_size"] == CHUNK
    (step,) = report["routing"]
    assert (step["role"], step["instance"], step["reason"]) == ("serve", "b", "kv-hit")
    assert step["predicted_hit_tokens"] == 3 * CHUNK
    by_name = {c["instance"]: c for c in step["candidates"]}
    assert by_name["b"]["per_location"] == {"LocalCPUBackend": 3}
    assert by_name["a"]["per_location"] == {"P2PBackend": 3}  # it can pull from its peer b
    assert by_name["b"]["score"] > by_name["a"]["score"]
    assert "held 3 leading chunks" in step["why"]
    assert report["index"]["mode"] == "http"
    assert report["index"]["groups"] == [
        {"instances": ["b"], "count": 1, "hit_chunks": 3, "per_location": {"LocalCPUBackend": 3}}
    ]
    assert report["held"] == [{"chunks": [0, 2], "holders": 1, "groups": [0]}]
    (missed,) = report["missed"]
    assert missed["chunks"] == [3, 3] and missed["reason"] == "never-stored"
    assert any("refused registrations are unknown" in n for n in report["notes"])
    # the same prompt again: b was credited the whole prompt as pending (routed moments ago),
    # and the chunk the index still lacks was sent there by the first request
    (step,) = again["routing"]
    assert step["predicted_hit_tokens"] == 4 * CHUNK
    assert step["candidates"][0]["per_location"].get("pending") or any(
        c["per_location"].get("pending") for c in step["candidates"]
    )
    (missed,) = again["missed"]
    assert missed["reason"] == "not-indexed"
    assert first.headers["x-request-id"] in missed["detail"]


async def test_an_unknown_id_is_a_404_and_a_dry_run_sends_nothing() -> None:
    a = Script("a")
    async with gateway([a], ControllerScript(hits={"a~fp": 1})) as (client, _):
        r = await client.get("/v1/requests/nope/explain")
        assert r.status_code == 404 and "limits.explainRequests" in r.json()["error"]["message"]
        chat = {"messages": [{"role": "user", "content": "abcdefghijklmnop"}]}
        r = await client.post("/v1/requests/explain", json=chat)
        assert r.status_code == 200, r.text
        report = r.json()
        assert report["dry_run"] and report["endpoint"] == "chat"
        assert report["routing"][0]["instance"] == "a"
        assert report["missed"] and report["missed"][0]["reason"] == "never-stored"
        bad = await client.post("/v1/requests/explain", json={"model": "m"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
    assert a.requests == []


async def test_explain_needs_the_api_key() -> None:
    a = Script("a")
    env = {"auth_token": "k1"}
    async with gateway([a], ControllerScript(), env=env) as (client, _):
        assert (await client.get("/v1/requests/x/explain")).status_code == 401
        r = await client.get("/v1/requests/x/explain", headers={"authorization": "Bearer k1"})
        assert r.status_code == 404


async def test_the_cli_prints_the_report(capsys: pytest.CaptureFixture[str]) -> None:
    a = Script("a")
    async with gateway([a], ControllerScript(hits={"a~fp": 2})) as (client, _):
        r = await client.post("/v1/completions", json=PROMPT)
        rid = r.headers["x-request-id"]
        url = str(client.base_url)
        rc = await asyncio.to_thread(main, ["explain", rid, "--url", url])
        text = capsys.readouterr().out
        assert rc == 0, text
        assert f"request {rid}" in text and "serve: a (kv-hit" in text
        assert "chunks 2-3: missed everywhere: never-stored" in text
        rc = await asyncio.to_thread(main, ["explain", rid, "--url", url, "--json"])
        assert rc == 0 and json.loads(capsys.readouterr().out)["request_id"] == rid
        rc = await asyncio.to_thread(main, ["explain", "nope", "--url", url])
        err = capsys.readouterr().err
        assert rc == 2 and "404" in err and "nope" in err
