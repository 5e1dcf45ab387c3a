"""PD bypass on real parts: the real ``kvpool-controller``, a prefill (sender) and a decode
(receiver) reference worker whose LMCache 0.5.6 PD backends move KV over NIXL (UCX), the
decoder configured as the operator renders it with ``spec.gateway.pd.bypassMinCachedRatio``
(a CPU tier, registered with the controller), the gateway in process on the controller's delta
stream with the pending entries off, so only the controller's index says what the decoder holds.

Turn 1 of a conversation goes through PD (the decoder holds none of it); the decoder keeps the
prompt and the answer, the index learns it, and turn 2 (turn 1, its answer and a new message)
goes straight to the decoder: no prefill, no transfer, named in the response's headers, the
explain record and the metrics. A second gateway with the bypass off sends the same turn 2
(completion and chat, whole and streamed) through prefill and transfer, and every answer
equals the bypassed one.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fakes import serving
from realstack import BIN, SEED, Procs, base_env, free_port, pd_gateway_config, start_pd_pair

from kvpool.gateway.app import build_app
from kvpool.gateway.config import GatewayEnv, parse_config
from kvpool.gateway.state import GatewayState, build_state

pytestmark = pytest.mark.timeout(900)

CHUNK = 256
RATIO = 0.5


@pytest.fixture
def domain(tmp_path: Path) -> Iterator[dict[str, Any]]:
    procs = Procs(tmp_path)
    http, pull, reply, beat, pub, snap = (free_port() for _ in range(6))
    try:
        procs.start(
            "controller",
            [str(BIN / "kvpool-controller"), "--host", "127.0.0.1", "--port", str(http),
             "--monitor-ports", json.dumps({"pull": pull, "reply": reply, "heartbeat": beat}),
             "--pub-port", str(pub), "--snapshot-port", str(snap), "--chunk-size", str(CHUNK)],
            base_env(),
        )  # fmt: skip
        controller = f"http://127.0.0.1:{http}"
        procs.wait_ready("controller", controller)
        keep = (  # what the operator renders on a decoder when the gateway's bypass is on
            "local_cpu: true", "max_local_cpu_size: 0.25", "enable_controller: true",
            f"controller_pull_url: 127.0.0.1:{pull}", f"controller_reply_url: 127.0.0.1:{reply}",
            f"lmcache_worker_ports: [{free_port()}]", "lmcache_worker_heartbeat_time: 1",
            "lmcache_worker_heartbeat_delay_time: 1",
        )  # fmt: skip
        pair = start_pd_pair(procs, tmp_path, decoder_lines=keep)
        pair.update(controller=controller, pub=f"tcp://127.0.0.1:{pub}",
                    snapshot=f"tcp://127.0.0.1:{snap}")  # fmt: skip
        yield pair
    finally:
        procs.close()


def _state(domain: dict[str, Any], ratio: float) -> GatewayState:
    raw = pd_gateway_config(domain)
    raw.update(controllerUrl=domain["controller"], controllerPubUrl=domain["pub"],
               controllerSnapshotUrl=domain["snapshot"], tokenizer="reference")  # fmt: skip
    raw["pdPairs"][0]["bypassMinCachedRatio"] = ratio
    state = build_state(
        parse_config(raw), GatewayEnv(PYTHONHASHSEED=SEED), pd_bind_host="127.0.0.1"
    )
    state.selector.pending.ttl_s = 0.0  # only the controller's index says what is held
    return state


def tokens(first: int, n: int) -> list[int]:
    return [100 + (first * 7 + i * 13) % 150 for i in range(n)]


async def _held(state: GatewayState, prompt: list[int], name: str) -> int:
    hits = await state.index.prefix_hits(state.hasher(prompt))
    return hits[name].hit_chunks if hits and name in hits else 0


async def _until_held(state: GatewayState, prompt: list[int], chunks: int) -> None:
    for _ in range(300):
        if await _held(state, prompt, "dec-0") >= chunks:
            return
        await asyncio.sleep(0.2)
    pytest.fail(f"the index never listed {chunks} chunks of the prompt under dec-0")


async def _text(c: httpx.AsyncClient, path: str, body: dict[str, Any]) -> tuple[str, str]:
    """The answer's text (a stream's deltas joined) and the instance header."""
    if not body.get("stream"):
        r = await c.post(path, json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice.get("text", (choice.get("message") or {}).get("content")), r.headers[
            "x-kvpool-instance"
        ]  # fmt: skip
    parts = []
    async with c.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        where = r.headers["x-kvpool-instance"]
        async for line in _lines(r.aiter_lines()):
            obj = json.loads(line)
            for ch in obj.get("choices", []):
                parts.append(ch.get("text") or (ch.get("delta") or {}).get("content") or "")
    return "".join(parts), where


async def _lines(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    async for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            yield line[len("data: ") :]


def _metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}}"):
            return float(line.split()[-1])
    return 0.0


async def test_turn_two_is_bypassed_to_the_decoder_and_answers_as_pd_does(
    domain: dict[str, Any],
) -> None:
    turn1 = tokens(1, 2 * CHUNK + 200)  # 712 tokens
    body1 = {"prompt": turn1, "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    # turn 1's answer, cold on the prefill instance (a sender without a transfer keeps nothing)
    async with httpx.AsyncClient(timeout=120) as direct:
        cold = await direct.post(
            f"{domain['urls']['prefill']}/v1/completions", json={**body1, "return_token_ids": True}
        )
    answer = [int(t) for t in cold.json()["choices"][0]["token_ids"]]
    turn2 = [*turn1, *answer, *tokens(2, 120)]  # 892: the decoder will hold 768 (0.86)
    chat1 = [{"role": "user", "content": "Tell me about rivers and stones. " * 75}]
    asked: dict[str, tuple[str, str]] = {}

    async def ask(c: httpx.AsyncClient, tag: str) -> None:
        comp = {"prompt": turn2, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        asked[f"{tag}-comp"] = await _text(c, "/v1/completions", comp)
        asked[f"{tag}-comp-stream"] = await _text(c, "/v1/completions", {**comp, "stream": True})
        chat = {"messages": [*chat1, {"role": "assistant", "content": chat_answer},
                             {"role": "user", "content": "And the keeper?"}],
                "max_tokens": 10, "temperature": 0}  # fmt: skip
        asked[f"{tag}-chat"] = await _text(c, "/v1/chat/completions", chat)
        asked[f"{tag}-chat-stream"] = await _text(
            c, "/v1/chat/completions", {**chat, "stream": True}
        )

    # Bypass on (0.5): turn 1 goes through PD, turn 2 straight to the decoder.
    state = _state(domain, RATIO)
    async with serving(build_app(state)) as url, httpx.AsyncClient(base_url=url, timeout=120) as c:
        r = await c.post("/v1/completions", json=body1)
        assert r.status_code == 200, r.text
        assert r.headers["x-kvpool-instance"] == "pre-0,dec-0"  # nothing of it on the decoder
        assert r.json()["choices"][0]["text"] == cold.json()["choices"][0]["text"]
        r = await c.post("/v1/chat/completions", json={"messages": chat1, "max_tokens": 8,
                                                       "temperature": 0})  # fmt: skip
        assert r.status_code == 200 and r.headers["x-kvpool-instance"] == "pre-0,dec-0", r.text
        chat_answer = r.json()["choices"][0]["message"]["content"]
        await _until_held(state, turn2, 3)  # 712 + 60 computed: 3 whole chunks kept

        r = await c.post(
            "/v1/completions",
            json={"prompt": turn2, "max_tokens": 12, "temperature": 0, "ignore_eos": True},
            headers={"x-request-id": "turn-2"},
        )
        assert r.status_code == 200, r.text
        assert r.headers["x-kvpool-instance"] == "dec-0"
        assert r.headers["x-kvpool-route-reason"] == "pd-bypass"
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * CHUNK
        explain = (await c.get("/v1/requests/turn-2/explain")).json()
        step = explain["routing"][0]
        assert (step["role"], step["instance"], step["reason"]) == ("bypass", "dec-0", "pd-bypass")
        assert step["predicted_hit_tokens"] == 3 * CHUNK
        assert f"bypassMinCachedRatio {RATIO:g}" in step["note"] and "skipped" in step["note"]
        assert "dec-0" in json.dumps(explain["index"])  # the controller's answer listed it
        await ask(c, "bypass")
        metrics = (await c.get("/metrics")).text
    on = dict(pair="pd", path="bypass", reason="decoder-cached")
    assert _metric(metrics, "kvpool_gateway_pd_paths_total", **on) == 5  # turn 2, then 4 asks
    below = dict(pair="pd", path="prefill", reason="below-ratio")
    assert _metric(metrics, "kvpool_gateway_pd_paths_total", **below) == 2  # the two turns 1
    assert all(where == "dec-0" for tag, (_, where) in asked.items()), asked

    # Bypass off: the same requests go through prefill and transfer, and answer the same.
    state = _state(domain, 0.0)
    async with serving(build_app(state)) as url, httpx.AsyncClient(base_url=url, timeout=120) as c:
        await ask(c, "pd")
        metrics = (await c.get("/metrics")).text
    off = dict(pair="pd", path="prefill", reason="bypass-off")
    assert _metric(metrics, "kvpool_gateway_pd_paths_total", **off) == 4
    for kind in ("comp", "comp-stream", "chat", "chat-stream"):
        bypassed, pd = asked[f"bypass-{kind}"], asked[f"pd-{kind}"]
        assert pd[1] == "pre-0,dec-0", (kind, pd)
        assert bypassed[0] == pd[0], (kind, bypassed, pd)
