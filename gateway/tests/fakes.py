"""Fake upstream workers and a fake controller, served for real on 127.0.0.1 (uvicorn in the
test's event loop), for tests of the gateway's OWN logic: retries, breakers, admission,
streaming pass-through, disconnects, error shapes, the memory fan-out.

They are fakes on purpose and only there: what they answer is scripted per test (a 503, a
stream cut after two events, a slow first byte), which no real worker can be made to do on
demand. Everything that depends on a worker's real behaviour (its tokens, its KV, LMCache
hits) is tested against the real reference worker in tests/integration.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import uvicorn
import zmq
import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvpool.gateway.pd import ProxyNotif


def bound_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextlib.asynccontextmanager
async def serving(app: Any) -> AsyncIterator[str]:
    """Serve ``app`` on a free 127.0.0.1 port in this loop; yields its base URL."""
    sock = bound_socket()
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    for _ in range(200):
        if server.started:
            break
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(task, 5)
        sock.close()


@dataclass
class Script:
    """What one fake worker does; tests edit it while the server runs."""

    name: str
    ready: bool = True
    frozen: bool = False  # /readyz says LMCache is in a full-sync freeze
    fail_503: int = 0  # answer this many completion requests with 503 first
    cut_after_events: int | None = None  # stream this many events, then drop the connection
    events: int = 3
    event_delay_s: float = 0.0
    first_byte_delay_s: float = 0.0
    requests: list[dict[str, Any]] = field(default_factory=list)
    raw_bodies: list[bytes] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    memory_calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    cancelled: int = 0
    completed: int = 0


def _completion(name: str, text: str, finish: str | None) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "finish_reason": finish}
    return {"id": f"cmpl-{name}", "object": "text_completion", "model": "m", "choices": [choice]}


def _chunk(name: str, i: int, done: bool) -> bytes:
    obj = _completion(name, f"{name}:{i} ", "length" if done else None)
    return f"data: {json.dumps(obj)}\n\n".encode()


def fake_worker(script: Script) -> FastAPI:
    app = FastAPI()

    @app.get("/readyz")
    async def readyz() -> Response:
        body = (
            {"status": "ready", "frozen": script.frozen} if script.ready else {"status": "starting"}
        )
        return JSONResponse(body, 200 if script.ready else 503)

    @app.post("/tokenize")
    async def tokenize(body: dict[str, Any]) -> dict[str, Any]:
        text = body.get("prompt") or json.dumps(body.get("messages"))
        ids = list(text.encode())
        return {"tokens": ids, "count": len(ids)}

    async def complete(request: Request) -> Response:
        raw = await request.body()
        script.raw_bodies.append(raw)
        body = json.loads(raw)
        script.requests.append(body)
        script.headers.append(dict(request.headers))
        if script.fail_503 > 0:
            script.fail_503 -= 1
            return JSONResponse({"error": {"message": "draining"}}, status_code=503)
        await asyncio.sleep(script.first_byte_delay_s)
        if not body.get("stream"):
            script.completed += 1
            body = _completion(script.name, f"from {script.name}", "length")
            body["usage"] = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
            return JSONResponse(body)

        async def events() -> AsyncIterator[bytes]:
            try:
                for i in range(script.events):
                    if script.cut_after_events is not None and i >= script.cut_after_events:
                        raise RuntimeError("worker killed mid-stream")
                    yield _chunk(script.name, i, i == script.events - 1)
                    await asyncio.sleep(script.event_delay_s)
                yield b"data: [DONE]\n\n"
                script.completed += 1
            except asyncio.CancelledError:
                script.cancelled += 1
                raise

        return StreamingResponse(events(), media_type="text/event-stream")

    app.add_api_route("/v1/completions", complete, methods=["POST"])
    app.add_api_route("/v1/chat/completions", complete, methods=["POST"])

    @app.post("/memory/{action}")
    async def memory(action: str, body: dict[str, Any]) -> dict[str, Any]:
        script.memory_calls.append((action, body))
        return {"action": action, "worker": script.name}

    return app


def fake_pd_prefill(proxy_port: int) -> FastAPI:
    """A PD pair's prefill worker: answers one token (``P``, first token 7) and, when the
    request carries a disagg spec, notifies the gateway's ``proxy_port`` at once that the
    transfer landed (LMCache's ``ProxyNotif``, one rank)."""
    app = FastAPI()
    ctx = zmq.asyncio.Context.instance()

    @app.get("/readyz")
    async def readyz() -> dict[str, str]:
        return {"status": "ready"}

    @app.post("/v1/completions")
    async def prefill(body: dict[str, Any]) -> Response:
        choice = {"index": 0, "text": "P", "finish_reason": "length"}
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": 1, "total_tokens": 0}
        out: dict[str, Any] = {"choices": [choice], "usage": usage}
        params = body.get("kv_transfer_params")
        if params:
            sock = ctx.socket(zmq.PUSH)
            sock.connect(f"tcp://127.0.0.1:{proxy_port}")
            await sock.send(msgspec.msgpack.encode(ProxyNotif(params["disagg_spec"]["req_id"])))
            sock.close(linger=1000)
            out["kv_transfer_params"] = {"first_tok": 7}
        return JSONResponse(out)

    return app


@dataclass
class ControllerScript:
    """A fake controller: ``hits`` maps instance id → leading chunks it holds of any prompt."""

    hits: dict[str, int] = field(default_factory=dict)
    epoch: str = "e1"
    lookups: int = 0


def fake_controller(script: ControllerScript) -> FastAPI:
    app = FastAPI()

    @app.get("/")
    async def root() -> dict[str, Any]:
        return {"service": "kvpool-controller", "epoch": script.epoch}

    @app.post("/v1/prefix_lookup")
    async def lookup(body: dict[str, Any]) -> dict[str, Any]:
        script.lookups += 1
        n = len(body.get("hashes") or [])
        return {
            "chunks": n,
            "instances": {
                iid: {
                    "hit_chunks": min(c, n),
                    "per_location": {"LocalCPUBackend": min(c, n)},
                    "workers": [],
                }
                for iid, c in script.hits.items()
                if min(c, n) > 0
            },
        }

    return app
