"""Live reconfiguration in process (kvpool.gateway.live, api_admin): a new gateway.yaml from
the watched file or the admin endpoint changes routing while requests stream, keeps what it
must, and a bad document changes nothing and says why.

The workers are the scripted fakes of tests/fakes.py (a stream that takes its time on cue);
everything binds 127.0.0.1 and every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fakes import (
    ControllerScript,
    Script,
    bound_socket,
    fake_controller,
    fake_pd_prefill,
    fake_worker,
    serving,
)

from kvpool.gateway.app import build_app
from kvpool.gateway.config import GatewayEnv, parse_config
from kvpool.gateway.pd import PDCoordinator
from kvpool.gateway.state import GatewayState, build_state

pytestmark = pytest.mark.timeout(60)
ADMIN = "admin-secret"
PROMPT = {"prompt": "abcdefghijklmnop", "max_tokens": 3}


def group(*insts: tuple[str, str]) -> list[dict[str, Any]]:
    return [{"name": "g", "instances": [{"name": n, "url": u} for n, u in insts]}]


@contextlib.asynccontextmanager
async def gateway(
    scripts: list[Script], path: Path | None = None, **extra: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, GatewayState, dict[str, Any], dict[str, str]]]:
    """A gateway in front of fake workers; yields its client, state, the document it started
    with and every worker's URL (only the first worker is configured at start)."""
    async with contextlib.AsyncExitStack() as stack:
        urls = {s.name: await stack.enter_async_context(serving(fake_worker(s))) for s in scripts}
        ctl = await stack.enter_async_context(serving(fake_controller(ControllerScript())))
        first = scripts[0].name
        raw: dict[str, Any] = {
            "model": "m",
            "chunkSize": 4,
            "controllerUrl": ctl,
            "p2pGroups": group((first, urls[first])),
            "limits": {"healthIntervalSeconds": 0.2, "lookupTimeoutSeconds": 5},
            **extra,
        }
        if path is not None:
            path.write_text(yaml.safe_dump(raw))
        env = GatewayEnv(admin_token=ADMIN)
        state = build_state(parse_config(raw), env, pd_bind_host="127.0.0.1", config_path=path)
        state.reconfig.interval_s = 0.05
        url = await stack.enter_async_context(serving(build_app(state)))
        client = await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=20))
        yield client, state, raw, urls


async def poll(what: str, check: Any, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"not within {timeout_s}s: {what}")


def admin(token: str = ADMIN) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


async def test_a_stream_in_flight_ends_on_its_instance_as_new_requests_use_the_new_config() -> None:
    a, b = Script("a", events=8, event_delay_s=0.1), Script("b", events=2)
    async with gateway([a, b]) as (client, state, raw, urls):
        body = {**PROMPT, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.headers["x-kvpool-instance"] == "a"
            lines = r.aiter_lines()
            first = await anext(lines)
            assert first.startswith("data: ")
            assert state.load.load("a").inflight == 1
            # a goes, b comes, other weights: applied while a's stream is half way
            new = {**raw, "p2pGroups": group(("b", urls["b"])),
                   "routing": {"weights": {"load": 2.0}}}  # fmt: skip
            done = await client.post("/admin/config", content=yaml.safe_dump(new), headers=admin())
            assert done.status_code == 200, done.text
            assert done.json()["status"] == "applied" and done.json()["generation"] == 2
            assert "instances added: b" in done.json()["changes"]
            assert "instances removed: a" in done.json()["changes"]
            assert state.selector.router.policy.load_weight == 2.0  # type: ignore[attr-defined]
            # a new request goes to b, already probed ready at the swap
            other = await client.post("/v1/completions", json=PROMPT)
            assert other.status_code == 200 and other.headers["x-kvpool-instance"] == "b"
            rest = [ln async for ln in lines if ln.startswith("data: ")]
        texts = [json.loads(x[6:])["choices"][0]["text"] for x in [first, *rest[:-1]]]
        assert texts == [f"a:{i} " for i in range(8)] and rest[-1] == "data: [DONE]"
        assert a.completed == 1 and a.cancelled == 0
        assert state.load.load("a").inflight == 0  # its ticket ended on the old instance
        ready = (await client.get("/readyz")).json()
        assert set(ready["instances"]) == {"b"} and ready["config"]["generation"] == 2
        m = (await client.get("/metrics")).text
        assert 'kvpool_gateway_instance_ready{instance="a"}' not in m
        assert 'kvpool_gateway_instance_ready{instance="b"} 1.0' in m
        assert 'kvpool_gateway_config_reloads_total{outcome="applied",source="admin"} 1.0' in m


async def test_an_instance_that_stays_keeps_its_object_and_load() -> None:
    a, b = Script("a", events=3, event_delay_s=0.2), Script("b")
    async with gateway([a, b]) as (client, state, raw, urls):
        kept = state.instances.by_name["a"]
        body = {**PROMPT, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            new = {**raw, "p2pGroups": group(("a", urls["a"]), ("b", urls["b"]))}
            assert (await state.reconfig.apply(parse_config(new), "admin")).status == "applied"
            assert state.instances.by_name["a"] is kept and not kept.retired
            assert state.load.load("a").inflight == 1  # the stream's ticket, counted still
            assert state.instances.by_name["b"].ready
            _ = [ln async for ln in r.aiter_lines()]
        assert state.load.load("a").inflight == 0


async def test_the_watched_file_applies_and_a_bad_one_is_kept_out_naming_the_key(
    tmp_path: Path,
) -> None:
    path = tmp_path / "gateway.yaml"
    async with gateway([Script("a")], path) as (client, state, raw, _):
        path.write_text(yaml.safe_dump({**raw, "routing": {"policy": "least-load"}}))
        await poll("the file applied", lambda: state.config.routing.policy == "least-load")
        assert state.reconfig.describe()["source"] == "file"
        # invalid: a typo'd key; nothing changes and the error names it
        path.write_text(yaml.safe_dump({**raw, "routing": {"polcy": "round-robin"}}))
        await poll("the refusal recorded", lambda: state.reconfig.error is not None)
        assert state.config.routing.policy == "least-load"
        ready = (await client.get("/readyz")).json()
        rejected = ready["config"]["rejected"]
        assert rejected["status"] == "invalid" and rejected["source"] == "file"
        assert "routing.polcy" in rejected["message"]
        m = (await client.get("/metrics")).text
        assert "kvpool_gateway_config_rejected 1.0" in m
        assert 'kvpool_gateway_config_reloads_total{outcome="invalid",source="file"} 1.0' in m
        # a change only a restart applies: refused the same way, naming the key and values
        path.write_text(yaml.safe_dump({**raw, "chunkSize": 8}))
        await poll(
            "needs a restart",
            lambda: (state.reconfig.error or {}).get("status") == "restart_required",
        )
        assert "chunkSize: 4 -> 8" in state.reconfig.error["message"]  # type: ignore[index]
        assert state.config.chunk_size == 4
        # fixed: applied, the refusal cleared
        path.write_text(yaml.safe_dump({**raw, "routing": {"policy": "round-robin"}}))
        await poll("applied again", lambda: state.config.routing.policy == "round-robin")
        assert state.reconfig.error is None and state.reconfig.generation == 3
        assert "kvpool_gateway_config_rejected 0.0" in (await client.get("/metrics")).text


async def test_the_admin_routes_need_their_own_token_and_check_before_applying() -> None:
    async with gateway([Script("a")]) as (client, state, raw, _):
        state.api_keys = frozenset({"client-key"})
        body = yaml.safe_dump({**raw, "routing": {"policy": "session"}})
        r = await client.post("/admin/config", content=body, headers=admin("client-key"))
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_token"
        r = await client.post("/admin/config?dryRun=true", content=body, headers=admin())
        assert r.status_code == 200 and r.json()["status"] == "checked"
        assert r.json()["changes"] == ["routing.policy: 'kv-aware' -> 'session'"]
        assert state.config.routing.policy == "kv-aware"
        r = await client.post("/admin/config", content=b"model: [", headers=admin())
        assert r.status_code == 400 and "not valid YAML" in r.json()["message"]
        bad = json.dumps({**raw, "routing": {"weights": {"load": -1}}})
        r = await client.post("/admin/config", content=bad, headers=admin())
        assert r.status_code == 400 and "routing.weights.load" in r.json()["message"]
        r = await client.post(
            "/admin/config", content=json.dumps({**raw, "chunkSize": 8}), headers=admin()
        )
        assert r.status_code == 409 and r.json()["status"] == "restart_required"
        got = (await client.get("/admin/config", headers=admin())).json()
        assert got["config"]["routing"]["policy"] == "kv-aware"
        assert got["reload"]["rejected"]["status"] == "restart_required"
        r = await client.post("/admin/config", content=body, headers=admin())
        assert r.status_code == 200 and state.config.routing.policy == "session"
        assert (await client.get("/admin/config", headers=admin())).json()["reload"][
            "rejected"
        ] is None


async def test_a_pd_pair_added_live_serves_and_removed_is_refused_by_name() -> None:
    sock = bound_socket()
    port = int(sock.getsockname()[1])
    sock.close()
    async with (
        serving(fake_pd_prefill(port)) as pre,
        serving(fake_worker(Script("dec"))) as dec,
        gateway([Script("a")]) as (client, state, raw, _),
    ):
        state.pd.transfer_timeout_s = 0.2  # the removed pair's port closes this soon after
        pair = {
            "name": "pair", "mode": "push", "proxyPort": port,
            "prefill": [{"name": "pre", "url": pre}],
            "decode": [{"name": "dec", "url": dec, "host": "127.0.0.1",
                        "initPorts": [1], "allocPorts": [2]}],
        }  # fmt: skip
        pd = {"x-kvpool-pd": "pair"}
        r = await client.post("/v1/completions", json=PROMPT, headers=pd)
        assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_pd_pair"
        with_pair = yaml.safe_dump({**raw, "pdPairs": [pair]})
        done = await client.post("/admin/config", content=with_pair, headers=admin())
        assert done.status_code == 200 and "PD pairs added: pair" in done.json()["changes"]
        assert state.pd.bound == {str(port): port}
        r = await client.post("/v1/completions", json=PROMPT, headers=pd)
        assert r.status_code == 200, r.text
        assert r.headers["x-kvpool-instance"] == "pre,dec"  # prefill, transfer, decode
        assert r.json()["choices"][0]["text"] == "Pfrom dec"
        plain = await client.post("/v1/completions", json=PROMPT)
        assert plain.headers["x-kvpool-instance"] == "a"  # peers still serve the rest
        done = await client.post("/admin/config", content=yaml.safe_dump(raw), headers=admin())
        assert "PD pairs removed: pair" in done.json()["changes"]
        r = await client.post("/v1/completions", json=PROMPT, headers=pd)
        assert r.status_code == 400 and "ready: none" in r.json()["error"]["message"]
        await poll("the pair's port closed after the transfer timeout", lambda: not state.pd.bound)


async def test_a_token_with_characters_outside_ascii_is_refused_not_an_error() -> None:
    async with gateway([Script("a")]) as (client, _, raw, _):
        bad = {"authorization": "Bearer d\u00e9j\u00e0".encode()}  # UTF-8 bytes in a header
        r = await client.post("/admin/config", content=yaml.safe_dump(raw), headers=bad)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_token"


async def test_the_admin_routes_are_off_without_a_token() -> None:
    async with gateway([Script("a")]) as (client, state, raw, _):
        state.env = GatewayEnv()
        r = await client.post("/admin/config", content=yaml.safe_dump(raw), headers=admin())
        assert r.status_code == 403 and "KVPOOL_GATEWAY_ADMIN_TOKEN" in r.json()["error"]["message"]


async def test_a_pd_pair_s_port_is_bound_before_use_and_closed_after_the_transfer_timeout() -> None:
    state = build_state(parse_config({"model": "m", "chunkSize": 4, "controllerUrl": "http://x"}))
    pd: PDCoordinator = state.pd
    pd.transfer_timeout_s = 0.05
    sock = bound_socket()
    port = sock.getsockname()[1]
    sock.close()
    pair = parse_config({
        "model": "m", "chunkSize": 4, "controllerUrl": "http://x",
        "pdPairs": [{"name": "pd", "mode": "push", "proxyPort": port,
                     "prefill": [{"name": "p", "url": "http://p:1"}],
                     "decode": [{"name": "d", "url": "http://d:1", "host": "d",
                                 "initPorts": [1], "allocPorts": [2]}]}],
    }).pd_pairs  # fmt: skip
    try:
        pd.bind_ports(pair)
        pd.use_pairs(pair)
        assert pd.bound == {str(port): port} and set(pd.targets) == {"d"}
        other = PDCoordinator(pair, state.instances, "127.0.0.1", state.metrics, 1.0)
        with pytest.raises(OSError, match=f"cannot bind the PD proxy port 127.0.0.1:{port}"):
            other.bind_ports(pair)
        await other.stop()
        pd.use_pairs([])
        assert not pd.pairs and pd.bound  # still open while transfers may land
        await poll("the port closed", lambda: not pd.bound, 5.0)
        again = PDCoordinator(pair, state.instances, "127.0.0.1", state.metrics, 1.0)
        again.bind_ports(pair)  # free again
        await again.stop()
    finally:
        await pd.stop()
        await state.http.aclose()
