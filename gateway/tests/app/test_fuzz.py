"""Junk HTTP into every route of the real gateway app (issue 18 part 6), with a fixed seed and a
bounded count: the gateway never answers with a 5xx it made itself, never with a stack trace,
names the field of every 400, leaks no admission slot, and answers good requests exactly as
before afterwards.

The gateway runs as ``kvpool-gateway serve`` runs it (uvicorn, httptools, the app of
``build_app``) in a thread of this process, with API keys on and a small ``maxBodyBytes``, in
front of healthy scripted fake workers: two P2P peers and a PD pair whose prefill notifies the
proxy port (fakes: what is tested is the gateway's handling of what clients send, and healthy
upstreams mean every 5xx would be the gateway's own). Hypothesis draws the requests (seeded,
``derandomize``): every route the app has (read from the app, so a route added later is
fuzzed too) and unknown ones, every method, valid bodies with one field replaced by any JSON
value (huge numbers, deep nesting, wrong types, unknown models), bytes that are not JSON or
not UTF-8, bodies over the limit, and junk in the headers the gateway reads (session, PD pair,
pinned instance, keys, content type), with bytes that are not UTF-8. Request lines and framing
that are not HTTP at all go over a raw socket (uvicorn's own 400s are allowed there).
``KVPOOL_FUZZ_EXAMPLES`` changes the count (default 300, about 20-60 s on this box).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn
from fakes import (
    ControllerScript,
    Script,
    bound_socket,
    fake_controller,
    fake_pd_prefill,
    fake_worker,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.gateway.app import build_app
from kvpool.gateway.config import GatewayEnv, parse_config
from kvpool.gateway.errors import ENDPOINTS
from kvpool.gateway.state import GatewayState, build_state

pytestmark = pytest.mark.timeout(600)
EXAMPLES = int(os.environ.get("KVPOOL_FUZZ_EXAMPLES", "300"))
KEY = "fuzz-key"
ADMIN = "fuzz-admin"
MAX_BODY = 16 * 1024
#: codes of 400s about the body as a whole (nothing narrower to name; the admin route's refusal
#: of a gateway.yaml names the key in its message)
WHOLE_BODY = {"invalid_json", "invalid"}


@dataclass
class Stack:
    url: str
    state: GatewayState
    scripts: list[Script]


class _Loop:
    """An event loop in a thread serving ASGI apps on 127.0.0.1."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.servers: list[tuple[uvicorn.Server, asyncio.Future[None]]] = []

    def serve(self, app: Any, sock: socket.socket | None = None) -> str:
        sock = sock or bound_socket()
        config = uvicorn.Config(
            app, log_level="error", lifespan="on", http="httptools", timeout_graceful_shutdown=1
        )
        server = uvicorn.Server(config)
        future = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), self.loop)
        self.servers.append((server, future))  # type: ignore[arg-type]
        while not server.started:
            if future.done():
                future.result()
            threading.Event().wait(0.01)
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    def close(self) -> None:
        for server, _ in reversed(self.servers):
            server.should_exit = True
        for _, future in reversed(self.servers):
            future.result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    loop = _Loop()
    try:
        scripts = [Script("a"), Script("b")]
        peers = [{"name": s.name, "url": loop.serve(fake_worker(s))} for s in scripts]
        ctl = loop.serve(fake_controller(ControllerScript(hits={"b~fp": 2})))
        proxy = bound_socket()
        ports = [int(proxy.getsockname()[1])]
        proxy.close()
        pre = loop.serve(fake_pd_prefill(ports[0]))
        dec = loop.serve(fake_worker(Script("dec-0")))
        raw = {
            "model": "m", "chunkSize": 4, "controllerUrl": ctl, "tokenizer": "reference",
            "p2pGroups": [{"name": "g", "instances": peers}],
            "pdPairs": [{"name": "pair", "mode": "push", "proxyPort": ports[0],
                         "prefill": [{"name": "pre-0", "url": pre}],
                         "decode": [{"name": "dec-0", "url": dec, "host": "127.0.0.1",
                                     "initPorts": [1], "allocPorts": [2]}]}],
            "limits": {"maxBodyBytes": MAX_BODY, "healthIntervalSeconds": 0.5,
                       "pdTransferTimeoutSeconds": 5, "sessions": 64},
        }  # fmt: skip
        state = build_state(
            parse_config(raw),
            GatewayEnv(auth_token=KEY, admin_token=ADMIN),
            pd_bind_host="127.0.0.1",
        )
        url = loop.serve(build_app(state))
        yield Stack(url, state, scripts)
    finally:
        loop.close()


# --------------------------------------------------------------------------- what is sent
GOOD: list[tuple[str, dict[str, Any], dict[str, str]]] = [
    ("/v1/completions", {"prompt": "hello there, general", "max_tokens": 2}, {}),
    ("/v1/completions", {"prompt": [1, 2, 3, 4, 5, 6, 7, 8], "max_tokens": 2}, {}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, {}),
    ("/v1/completions", {"prompt": "hello", "stream": True}, {"x-session-id": "s1"}),
    ("/v1/completions", {"prompt": [5, 6, 7, 8, 9], "max_tokens": 3}, {"x-kvpool-pd": "any"}),
    ("/memory/evict", {"text": "hello there"}, {}),
]
BASES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": "hello there, general kenobi", "max_tokens": 3}),
    ("/v1/completions", {"prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9], "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "x"}], "stream": True}),
    ("/memory/evict", {"session_id": "s1"}),
    ("/memory/evict", {"chunk_hashes": [1, 2]}),
    ("/memory/prefetch", {"token_ids": [1, 2, 3, 4, 5]}),
    ("/memory/pin", {"text": "hello there"}),
    ("/memory/unpin", {"messages": [{"role": "user", "content": "hi"}], "instance": "a"}),
]
FIELDS = [
    "prompt", "messages", "model", "max_tokens", "max_completion_tokens", "stream", "user",
    "stream_options", "temperature", "stop", "n", "add_generation_prompt", "session_id",
    "token_ids", "text", "chunk_hashes", "instance", "tiers", "kv_transfer_params",
]  # fmt: skip
HUGE = [2**31, 2**63, 2**64 + 1, 10**30, -(2**63) - 1, 1e308, -1, 0]
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from(HUGE),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
    st.sampled_from(["m", "other-model", "", "user", "any", "pair", "a", "\udcff"[:0] + "ü"]),
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def mutated_body(draw: st.DrawFn) -> tuple[str, bytes]:
    """A valid body with one field (or one message's field) replaced, dropped or added."""
    path, base = draw(st.sampled_from(BASES))
    body = json.loads(json.dumps(base))
    target = draw(st.sampled_from([*FIELDS, "messages.0.role", "messages.0.content", "new"]))
    value = draw(JSON)
    if target.startswith("messages.0."):
        field = target.rsplit(".", 1)[1]
        body["messages"] = [{"role": "user", "content": "hi", field: value}]
    elif draw(st.booleans()) and target in body:
        del body[target]
    else:
        body[target if target != "new" else draw(st.text(max_size=6))] = value
    return path, json.dumps(body).encode()


def _deep(n: int) -> bytes:
    return b'{"prompt": ' + b"[" * n + b"1" + b"]" * n + b"}"


RAW_BODIES = [
    b"",
    b"   ",
    b"null",
    b"[]",
    b'"prompt"',
    b"{",
    b'{"prompt": "abc"',
    b'{"prompt": NaN, "max_tokens": Infinity}',
    b'{"prompt": "abc", "max_tokens": 1e999999}',
    b'{"prompt": "abc", "max_tokens": 99999999999999999999999999999}',
    b'{"prompt": [99999999999999999999], "max_tokens": 2}',
    b'{"prompt": [-1, 2, 3, 4, 5]}',
    b'{"prompt": [4294967296, 1, 2, 3, 4]}',
    b'{"token_ids": [4294967296, 1, 2]}',
    b'{"token_ids": [-5]}',
    b'{"chunk_hashes": [99999999999999999999999999]}',
    b'{"prompt": "\xff\xfe\xfd"}',
    b'\xef\xbb\xbf{"prompt": "bom"}',
    b'{"prompt": "a", "prompt": [1]}',
    b'{"prompt": "\\ud800"}',
    b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
    b'{"session_id": "' + b"s" * 300 + b'"}',
    b'{"prompt": "x", "user": "' + b"u" * 300 + b'"}',
    _deep(50),
    _deep(5000),
    _deep(MAX_BODY // 2 - 20),
    b'{"prompt": "' + b"a" * (MAX_BODY + 10) + b'"}',
    b'{"messages": [' + b'{"role": "user", "content": "hi"},' * 2000 + b"1]}",
    b"model: [",
    b"a: &a [1, 1]\nb: &b [*a, *a, *a]\nc: [*b, *b, *b]\nmodel: *c",
    b"!!python/object/apply:os.system ['true']",
]
RAW = st.sampled_from(RAW_BODIES)
BODY = st.one_of(
    mutated_body().map(lambda pb: pb[1]),
    RAW,
    st.binary(max_size=64),
    st.binary(min_size=MAX_BODY + 1, max_size=MAX_BODY + 64),
)
HEADER_BYTES = st.binary(max_size=40).map(
    lambda b: bytes(c for c in b if c == 9 or 32 <= c < 127 or c >= 128).strip(b" \t")
)  # what an HTTP client can put in a header at all (h11 refuses the rest)
HEADERS = st.dictionaries(
    st.sampled_from(
        [
            "content-type", "x-session-id", "x-kvpool-pd", "x-kvpool-instance", "x-api-key",
            "authorization", "accept", "user-agent", "x-request-id", "transfer-encoding-x",
        ]
    ),
    st.one_of(
        HEADER_BYTES,
        st.sampled_from([b"any", b"pair", b"nope", b"a", b"b", b"pre-0", b"dec-0", b"",
                         b"application/json", b"text/plain", b"s" * 300, b"Bearer " + KEY.encode(),
                         b"Bearer " + ADMIN.encode(),
                         "\u00fcml\u00e4ut".encode(), b"\xff\xfe"]),
    ),
    max_size=4,
)  # fmt: skip
JUNK_PATHS = ["/v1/completions/", "/v1/nope", "/memory/forget", "//v1/models", "/%ff"]
METHODS = st.sampled_from(["GET", "POST", "POST", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"])


def app_paths(state: GatewayState) -> list[str]:
    """Every path the app answers: those of its OpenAPI document (so a route added later is
    fuzzed too) and the completion routes answered in front of the app's routing."""
    paths = set(build_app(state).openapi()["paths"]) | set(ENDPOINTS)
    return sorted(re.sub(r"\{[^}]*\}", "r1", p) for p in paths)


# --------------------------------------------------------------------------- what must hold
def check(resp: httpx.Response, what: str) -> None:
    """The answer to any request: no 5xx, no stack trace, a 4xx in OpenAI's shape naming the
    field (or the body as a whole) of a 400."""
    text = resp.text
    assert resp.status_code < 500, f"{what}: {resp.status_code} {text[:300]}"
    assert "Traceback" not in text and 'File "' not in text, f"{what}: {text[:300]}"
    if resp.status_code < 400 or resp.request.method == "HEAD":
        return
    err = resp.json()["error"]
    assert err["message"], what
    if resp.status_code == 400:
        assert err.get("param") or err.get("code") in WHOLE_BODY, f"{what}: {err}"


def answers(client: httpx.Client, auth: dict[str, str] | None = None) -> list[tuple[int, Any]]:
    out: list[tuple[int, Any]] = []
    for path, body, headers in GOOD:
        r = client.post(path, json=body, headers={**headers, **(auth or {})})
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            out.append((r.status_code, r.text))
        else:
            out.append((r.status_code, r.json()))
    return out


def test_junk_into_every_route_never_gets_a_5xx_or_a_trace(stack: Stack) -> None:
    auth = {"authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=stack.url, timeout=60, headers=auth) as client:
        before = answers(client)
        assert all(status == 200 for status, _ in before), before
        paths = app_paths(stack.state)
        assert {"/v1/completions", "/v1/models", "/memory/evict", "/readyz"} <= set(paths)

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(
            path=st.sampled_from(paths + JUNK_PATHS),
            method=METHODS,
            body=BODY,
            headers=HEADERS,
            keyed=st.integers(0, 9),
        )
        def fuzz(
            path: str, method: str, body: bytes, headers: dict[str, bytes], keyed: int
        ) -> None:
            sent: dict[str, Any] = {k: v for k, v in headers.items()}
            if keyed == 0:  # a missing or wrong key now and then
                sent["authorization"] = headers.get("authorization", b"")
            content = body if method not in ("GET", "OPTIONS") else None
            r = client.request(method, path, content=content, headers=sent)
            check(r, f"{method} {path} {headers!r} {body[:200]!r}")

        fuzz()
        state = stack.state
        assert state.admission.inflight == 0 and state.admission.waiting == 0
        assert state.drain.inflight <= 1  # at most the request asking (none here)
        assert client.get("/readyz").status_code == 200
        assert answers(client) == before


def test_every_junk_body_into_every_route(stack: Stack) -> None:
    """Each of the hand-made junk bodies (deep nesting, lone surrogates, huge numbers, YAML
    aliases and tags, over the size limit, ...) into every route, each with the key that route
    takes: deterministic, so none of them is left to the draw."""
    keys = {"client": f"Bearer {KEY}", "admin": f"Bearer {ADMIN}"}
    with httpx.Client(base_url=stack.url, timeout=60) as client:
        before = answers(client, {"authorization": keys["client"]})
        for path in app_paths(stack.state) + JUNK_PATHS:
            auth = keys["admin" if path.startswith("/admin") else "client"]
            for body in RAW_BODIES:
                r = client.post(path, content=body, headers={"authorization": auth})
                check(r, f"POST {path} {body[:120]!r}")
        assert stack.state.config.model == "m" and stack.state.reconfig.generation == 1
        assert stack.state.admission.inflight == 0
        assert answers(client, {"authorization": keys["client"]}) == before


RAW_REQUESTS = [
    b"GARBAGE\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n{\"pr",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999999999999\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
    b"Content-Length: 3\r\n\r\n0\r\n\r\n",
    b"POST /v1/\xff\xfe HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Session-Id: \xff\xfe\x80\r\n"
    b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 17\r\n\r\n"
    b'{"prompt": "abc"}',
    b"GET /readyz HTTP/1.1\r\nHost: x\r\n" + b"X-Junk: y\r\n" * 200 + b"\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 100_000 + b"\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
    + b"\r\nContent-Length: 100\r\n\r\n{}",  # the client stops sending: answered at close
]  # fmt: skip


def test_requests_that_are_not_http_get_no_5xx(stack: Stack) -> None:
    host, port = stack.url.removeprefix("http://").split(":")
    for raw in RAW_REQUESTS:
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(raw)
            sock.shutdown(socket.SHUT_WR)
            got = b""
            while chunk := sock.recv(65536):
                got += chunk
        status = got.split(b" ", 2)[1] if got.startswith(b"HTTP/") else b"(none)"
        assert not status.startswith(b"5"), (raw[:120], got[:300])
        assert b"Traceback" not in got, (raw[:120], got[:300])
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        assert client.get("/readyz").status_code == 200
    assert stack.state.admission.inflight == 0
