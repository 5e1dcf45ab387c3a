"""The gateway as one of several replicas, in process against scripted fake workers (fakes:
each test needs a worker that streams slowly or notifies a chosen port on cue):

- the drain on SIGTERM (``drain.DrainingServer``, the signal handler called as the signal
  would): ``/readyz`` fails first, a new request gets 503 ``draining`` with ``Retry-After`` and
  ``Connection: close``, the stream in flight ends whole, then the server stops; a stream
  longer than ``drainTimeoutSeconds`` does not hold the process;
- API keys reloaded from their file after the kubelet's symlink swap, and a bad new file
  keeping the old keys (``apikeys``);
- a PD transfer notification that reaches the other replica is relayed to the one waiting
  (``pd.owner_of``).

Processes (a real SIGTERM to ``kvpool-gateway serve``) are in test_drain_process.py; two
replicas under ``kvpool-operator up`` in e2e/tests/test_gateway_replicas.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import uvicorn
import zmq
import zmq.asyncio
from fakes import ControllerScript, Script, bound_socket, fake_controller, fake_worker, serving
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from kvpool.gateway.apikeys import KeyFileError, parse_keys, read_keys
from kvpool.gateway.app import build_app
from kvpool.gateway.config import ConfigError, GatewayEnv, parse_config
from kvpool.gateway.drain import Drain, DrainingServer
from kvpool.gateway.pd import ProxyNotif, new_req_id, owner_of
from kvpool.gateway.state import GatewayState, build_state

pytestmark = pytest.mark.timeout(90)


def metric(text: str, name: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


def state_for(instances: list[dict[str, str]], ctl: str, **env: Any) -> GatewayState:
    raw = {
        "model": "m",
        "chunkSize": 4,
        "controllerUrl": ctl,
        "p2pGroups": [{"name": "g", "instances": instances}],
        "limits": {"healthIntervalSeconds": 0.2, "drainTimeoutSeconds": 30, "drainMinSeconds": 0},
    }
    return build_state(parse_config(raw), GatewayEnv(**env), pd_bind_host="127.0.0.1")


@contextlib.asynccontextmanager
async def draining_server(state: GatewayState) -> AsyncIterator[tuple[str, DrainingServer]]:
    """The gateway served by the CLI's server class; yields its URL and the server."""
    sock = bound_socket()
    config = uvicorn.Config(build_app(state), log_level="warning", timeout_graceful_shutdown=2)
    server = DrainingServer(config, state.drain)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    for _ in range(500):
        if server.started:
            break
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", server
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(task, 30)
        sock.close()


async def test_sigterm_fails_readiness_refuses_new_requests_and_finishes_the_stream() -> None:
    slow = Script("a", events=6, event_delay_s=0.3)
    async with (
        serving(fake_worker(slow)) as worker,
        serving(fake_controller(ControllerScript())) as ctl,
    ):
        state = state_for([{"name": "a", "url": worker}], ctl)
        async with (
            draining_server(state) as (url, server),
            httpx.AsyncClient(base_url=url, timeout=30) as client,
        ):
            assert (await client.get("/readyz")).status_code == 200
            body = {"prompt": "abcdefgh", "max_tokens": 6, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as stream:
                assert stream.status_code == 200
                lines = stream.aiter_lines()
                first = await anext(lines)
                server.handle_exit(signal.SIGTERM, None)  # what the signal does
                ready = await client.get("/readyz")
                assert ready.status_code == 503 and ready.json()["status"] == "draining"
                async with httpx.AsyncClient(base_url=url, timeout=10) as other:
                    refused = await other.post("/v1/completions", json={"prompt": "x"})
                assert refused.status_code == 503, refused.text
                assert refused.json()["error"]["code"] == "draining"
                assert refused.headers["retry-after"] == "1"
                assert refused.headers["connection"] == "close"
                assert not server.should_exit  # one stream still in flight
                # read while the stream holds the server up: once it ends, the drain stops
                # uvicorn and a later request may find the connection closed
                m = (await client.get("/metrics")).text
                assert metric(m, 'kvpool_gateway_rejections_total{reason="draining"}') == 1
                assert metric(
                    m, 'kvpool_gateway_requests_total{endpoint="completions",status="503"}'
                )
                rest = [line async for line in lines]
            events = [x for x in [first, *rest] if x.startswith("data: ")]
            assert events[-1] == "data: [DONE]" and len(events) == 7  # all six, then DONE
            for _ in range(300):  # nothing in flight: the drain ends and uvicorn stops
                if server.should_exit:
                    break
                await asyncio.sleep(0.05)
            assert server.should_exit and state.drain.inflight == 0
    assert slow.completed == 1 and slow.cancelled == 0


async def test_a_stream_longer_than_the_drain_timeout_does_not_hold_the_process() -> None:
    endless = Script("a", events=10_000, event_delay_s=0.05)
    async with (
        serving(fake_worker(endless)) as worker,
        serving(fake_controller(ControllerScript())) as ctl,
    ):
        state = state_for([{"name": "a", "url": worker}], ctl)
        state.drain.timeout_s = 0.5
        async with (
            draining_server(state) as (url, server),
            httpx.AsyncClient(base_url=url, timeout=30) as client,
        ):
            body = {"prompt": "abcdefgh", "max_tokens": 10_000, "stream": True}
            lines: list[str] = []
            with contextlib.suppress(httpx.HTTPError):  # cut: the body ends unfinished
                async with client.stream("POST", "/v1/completions", json=body) as stream:
                    async for line in stream.aiter_lines():
                        if not lines:
                            server.handle_exit(signal.SIGTERM, None)
                        lines.append(line)
            assert server.should_exit  # the drain's bound, then uvicorn's grace: cut
            assert lines and "data: [DONE]" not in lines


def test_drain_ends_when_idle_after_the_minimum_or_at_the_timeout() -> None:
    now = [0.0]
    drain = Drain(timeout_s=10, min_s=2, clock=lambda: now[0])
    assert not drain.finished() and drain.begin() and not drain.begin()
    drain.inflight = 1
    now[0] = 5
    assert not drain.finished()  # a request in flight
    drain.inflight = 0
    assert drain.finished()
    drain = Drain(timeout_s=10, min_s=2, clock=lambda: now[0])
    drain.begin()
    now[0] += 1
    assert not drain.finished()  # idle, but load balancers may still send for a moment
    drain.inflight = 3
    now[0] += 10
    assert drain.finished()  # the bound


# --------------------------------------------------------------------------- API keys
def swap(secret_dir: Path, content: bytes, n: int) -> None:
    """Update a Secret volume as the kubelet's atomic writer does: the content in a new
    timestamped directory, then ``..data`` swapped to it (``keys`` links through it)."""
    new = secret_dir / f"..2026_{n}"
    new.mkdir()
    (new / "keys").write_bytes(content)
    tmp = secret_dir / "..data_tmp"
    tmp.symlink_to(new.name)
    os.replace(tmp, secret_dir / "..data")
    if not (secret_dir / "keys").is_symlink():
        (secret_dir / "keys").symlink_to("..data/keys")


def test_key_file_format() -> None:
    assert parse_keys(" k1, k2\nk3\n\n") == {"k1", "k2", "k3"}
    assert parse_keys("") == frozenset()


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"", "no API key"),
        (b" ,\n", "no API key"),
        (b"good,bad key", "printable ASCII"),
        (b"caf\xc3\xa9", "printable ASCII"),
        (b"\xff\xfe", "not UTF-8"),
    ],
)
def test_a_bad_key_file_is_refused_naming_it(tmp_path: Path, content: bytes, match: str) -> None:
    path = tmp_path / "keys"
    path.write_bytes(content)
    with pytest.raises(KeyFileError, match=match):
        read_keys(path)
    with pytest.raises(ConfigError, match=r"KVPOOL_GATEWAY_AUTH_TOKEN_FILE: .*keys"):
        GatewayEnv(auth_token_file=path).api_keys()
    with pytest.raises(ConfigError, match="cannot read"):
        GatewayEnv(auth_token_file=tmp_path / "absent").api_keys()
    with pytest.raises(ConfigError, match="both set"):
        GatewayEnv(auth_token_file=path, auth_token="k").api_keys()


async def test_api_keys_reload_when_the_secret_changes_and_a_bad_file_keeps_them(
    tmp_path: Path,
) -> None:
    secret = tmp_path / "auth"
    secret.mkdir()
    swap(secret, b"k1\n", 1)
    async with (
        serving(fake_worker(Script("a"))) as worker,
        serving(fake_controller(ControllerScript())) as ctl,
    ):
        state = state_for([{"name": "a", "url": worker}], ctl, auth_token_file=secret / "keys")
        state.key_poll_s = 0.05
        async with (
            serving(build_app(state)) as url,
            httpx.AsyncClient(base_url=url, timeout=10) as client,
        ):

            async def status(key: str) -> int:
                headers = {"authorization": f"Bearer {key}"}
                r = await client.post("/v1/completions", json={"prompt": "ab"}, headers=headers)
                return r.status_code

            async def until(key: str, code: int) -> None:
                for _ in range(400):
                    if await status(key) == code:
                        return
                    await asyncio.sleep(0.05)
                raise AssertionError(f"key {key} never answered {code}")

            assert await status("k1") == 200 and await status("k2") == 401
            swap(secret, b"k2, k3\n", 2)  # rotated: k1 out, k2 and k3 in
            await until("k2", 200)
            assert await status("k1") == 401 and await status("k3") == 200
            swap(secret, b"\n", 3)  # emptied by mistake: nobody locked out
            for _ in range(400):
                m = (await client.get("/metrics")).text
                if metric(m, 'kvpool_gateway_api_key_reloads_total{outcome="invalid"}') == 1:
                    break
                await asyncio.sleep(0.05)
            assert metric(m, 'kvpool_gateway_api_key_reloads_total{outcome="loaded"}') == 1
            assert await status("k2") == 200 and await status("k1") == 401
            swap(secret, b"k4", 4)  # fixed: the next valid content is used
            await until("k4", 200)
            assert await status("k2") == 401


# --------------------------------------------------------------------------- PD relay
def test_a_req_id_names_the_replica_waiting_for_it() -> None:
    rid = new_req_id("10.0.0.7:7500")
    assert owner_of(rid) == "10.0.0.7:7500" and len(rid.partition("@")[0]) == 32
    assert owner_of(new_req_id(None)) is None and "@" not in new_req_id(None)


def pair_apps(notify_port: int, log: dict[str, Any]) -> tuple[FastAPI, FastAPI]:
    """A prefill worker whose LMCache sender notifies ``notify_port`` (the replica the
    Service happened to connect it to), and a decode worker."""
    prefill, decode = FastAPI(), FastAPI()
    ctx = zmq.asyncio.Context.instance()

    async def notify(req_id: str) -> None:
        sock = ctx.socket(zmq.PUSH)
        sock.connect(f"tcp://127.0.0.1:{notify_port}")
        for _ in range(2):  # two TP ranks
            await sock.send(msgspec.msgpack.encode(ProxyNotif(req_id=req_id)))
        await asyncio.sleep(0.05)
        sock.close(linger=1000)

    @prefill.post("/v1/completions")
    async def prefilled(body: dict[str, Any]) -> Response:
        spec = body["kv_transfer_params"]["disagg_spec"]
        log["req_id"] = spec["req_id"]
        log["task"] = asyncio.create_task(notify(spec["req_id"]))
        choice = {"index": 0, "text": "P", "finish_reason": "length"}
        usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
        return JSONResponse(
            {"choices": [choice], "usage": usage, "kv_transfer_params": {"first_tok": 7}}
        )

    @decode.post("/v1/completions")
    async def decoded(body: dict[str, Any]) -> Response:
        choice = {"index": 0, "text": "D", "finish_reason": "length"}
        usage = {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}
        return JSONResponse({"choices": [choice], "usage": usage})

    for app in (prefill, decode):
        app.add_api_route("/readyz", lambda: {"status": "ready"}, methods=["GET"])
    return prefill, decode


async def test_a_notification_reaching_the_other_replica_is_relayed_to_the_waiting_one() -> None:
    socks = [bound_socket(), bound_socket()]
    ports = [int(s.getsockname()[1]) for s in socks]
    for s in socks:
        s.close()
    log: dict[str, Any] = {}
    prefill, decode = pair_apps(ports[1], log)  # the sender is connected to replica B
    async with contextlib.AsyncExitStack() as stack:
        pre = await stack.enter_async_context(serving(prefill))
        dec = await stack.enter_async_context(serving(decode))
        clients = []
        for port in ports:
            raw = {
                "model": "m", "chunkSize": 4, "controllerUrl": "http://127.0.0.1:1",
                "pdPairs": [{"name": "pair", "mode": "push", "proxyPort": port,
                             "prefill": [{"name": "pre-0", "url": pre}],
                             "decode": [{"name": "dec-0", "url": dec, "host": "127.0.0.1",
                                         "initPorts": [1, 2], "allocPorts": [3, 4]}]}],
                "limits": {"pdTransferTimeoutSeconds": 60},
            }  # fmt: skip
            env = GatewayEnv(pod_ip="127.0.0.1")
            state = build_state(parse_config(raw), env, pd_bind_host="127.0.0.1")
            url = await stack.enter_async_context(serving(build_app(state)))
            clients.append(
                await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=60))
            )
        a, b = clients
        r = await a.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "PD", r.text
        assert owner_of(log["req_id"]) == f"127.0.0.1:{ports[0]}"
        ma, mb = (await a.get("/metrics")).text, (await b.get("/metrics")).text
        assert (
            metric(ma, 'kvpool_gateway_pd_requests_total{outcome="transferred",pair="pair"}') == 1
        )
        assert (
            metric(ma, 'kvpool_gateway_pd_requests_total{outcome="transfer_timeout",pair="pair"}')
            == 0
        )
        relayed = 'kvpool_gateway_pd_notifications_relayed_total{outcome="relayed"}'
        assert metric(mb, relayed) == 2 and metric(ma, relayed) == 0
        await log["task"]
