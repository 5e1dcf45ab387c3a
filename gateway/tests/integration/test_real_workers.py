"""The gateway in front of real parts: ``kvpool-controller`` and two reference workers
(``kvpool-worker serve --engine reference`` with the real LMCache 0.5.6 engine registered
with the controller), all processes on 127.0.0.1. The gateway runs in process on the index
replica fed by the controller's delta stream.

A streamed chat goes through the gateway to a worker; the next turn of the conversation (the
first turn's prompt plus the answer plus a new question) is routed, by the index, to the
worker that holds the first turn's KV, and that worker reports LMCache-cached prompt tokens.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fakes import serving
from realstack import BIN, FACTS, SEED, Procs, base_env, free_port

from kvpool.gateway.app import build_app
from kvpool.gateway.config import GatewayEnv, parse_config
from kvpool.gateway.prompts import LocalEncoder, RemoteEncoder
from kvpool.gateway.state import build_state
from kvpool.protocol.domain import domain_fingerprint, instance_id

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def domain(tmp_path: Path) -> Iterator[dict[str, Any]]:
    if shutil.which("kvpool-worker", path=str(BIN)) is None:
        pytest.skip("kvpool-worker is not installed")
    procs = Procs(tmp_path)
    http, pull, reply, pub, snap = (free_port() for _ in range(5))
    try:
        controller_argv = [
            str(BIN / "kvpool-controller"), "--host", "127.0.0.1", "--port", str(http),
            "--monitor-ports", json.dumps({"pull": pull, "reply": reply}),
            "--pub-port", str(pub), "--snapshot-port", str(snap), "--chunk-size", "256",
        ]  # fmt: skip
        procs.start("controller", controller_argv, base_env())
        controller = f"http://127.0.0.1:{http}"
        procs.wait_ready("controller", controller)
        workers: list[dict[str, str]] = []
        for i in range(2):
            name = f"w{i}"
            port = free_port()
            config = tmp_path / f"{name}.yaml"
            config.write_text(
                "chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: 0.5\n"
                f"lmcache_instance_id: {instance_id(name, domain_fingerprint(FACTS))}\n"
                "enable_controller: true\n"
                f"controller_pull_url: 127.0.0.1:{pull}\ncontroller_reply_url: 127.0.0.1:{reply}\n"
                f"lmcache_worker_ports: [{free_port()}]\n"
            )
            procs.start(
                name,
                [str(BIN / "kvpool-worker"), "serve", "--engine", "reference", "--host",
                 "127.0.0.1", "--port", str(port), "--max-model-len", "2048",
                 "--num-kv-blocks", "256", "--block-size", "16", "--kv-dtype", "float32"],
                {**base_env(), "LMCACHE_CONFIG_FILE": str(config)},
            )  # fmt: skip
            workers.append({"name": name, "url": f"http://127.0.0.1:{port}"})
        for w in workers:
            procs.wait_ready(w["name"], w["url"])
        yield {
            "controller": controller,
            "pub": f"tcp://127.0.0.1:{pub}",
            "snapshot": f"tcp://127.0.0.1:{snap}",
            "workers": workers,
            "procs": procs,
            "controller_argv": controller_argv,
        }
    finally:
        procs.close()


def turn(messages: list[dict[str, str]], stream: bool) -> dict[str, Any]:
    return {
        "model": "kvpool/reference-tiny",
        "messages": messages,
        "max_tokens": 8,
        "temperature": 0,
        "stream": stream,
        "stream_options": {"include_usage": True},
    }


async def test_streamed_chat_then_next_turn_hits_its_kv_through_routing(
    domain: dict[str, Any],
) -> None:
    raw = {
        "model": "kvpool/reference-tiny",
        "chunkSize": 256,
        "controllerUrl": domain["controller"],
        "controllerPubUrl": domain["pub"],
        "controllerSnapshotUrl": domain["snapshot"],
        "p2pGroups": [{"name": "g", "instances": domain["workers"]}],
        "limits": {"healthIntervalSeconds": 0.5},
        "tokenizer": "reference",  # the gateway tokenizes locally, as rendered for cpu pools
    }
    state = build_state(
        parse_config(raw), GatewayEnv(PYTHONHASHSEED=SEED), pd_bind_host="127.0.0.1"
    )
    system = "You are the keeper of the old river. " * 40  # ~400 tokens: more than a chunk
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Who keeps it?"}]
    async with serving(build_app(state)) as url, httpx.AsyncClient(base_url=url, timeout=120) as c:
        for _ in range(100):
            if state.index.in_sync:
                break
            await asyncio.sleep(0.1)
        assert state.index.in_sync, state.index.describe()
        # the gateway's token ids are the engine's, for chat and for text
        assert isinstance(state.encoder, LocalEncoder)
        remote = RemoteEncoder(state.instances, state.upstream)
        assert await state.encoder.chat(msgs, True) == await remote.chat(msgs, True)
        text = "Über den Fluß, 32 stones — and <|im_end|> too."
        assert await state.encoder.completion(text) == await remote.completion(text)
        # turn 1, streamed: SSE passes through, the first event comes before the end
        async with c.stream("POST", "/v1/chat/completions", json=turn(msgs, True)) as r:
            assert r.status_code == 200, await r.aread()
            first_instance = r.headers["x-kvpool-instance"]
            events = [ln[6:] async for ln in r.aiter_lines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        answer = "".join(
            ch["choices"][0]["delta"].get("content", "") for ch in chunks if ch.get("choices")
        )
        assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # the controller's admit events reach the gateway's replica
        tokens = await state.encoder.chat(msgs, True)
        hashes = state.hasher(tokens)
        for _ in range(200):
            hits = await state.index.prefix_hits(hashes)
            if hits and first_instance in hits:
                break
            await asyncio.sleep(0.1)
        assert hits is not None and hits[first_instance].hit_chunks == len(hashes) >= 1
        # turn 2: the conversation so far plus a new question, sent with no session
        msgs2 = [
            *msgs,
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "Why?"},
        ]
        state.selector.pending.ttl_s = 0.0  # only the controller's index may explain the pick
        r2 = await c.post("/v1/chat/completions", json=turn(msgs2, False))
        assert r2.status_code == 200, r2.text
        assert r2.headers["x-kvpool-instance"] == first_instance
        assert r2.headers["x-kvpool-route-reason"] == "kv-hit"
        assert int(r2.headers["x-kvpool-predicted-hit-tokens"]) == 256 * len(hashes)
        cached = r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 256 * len(hashes)
        metrics = (await c.get("/metrics")).text
        decided = (
            f'kvpool_gateway_routing_decisions_total{{instance="{first_instance}",reason="kv-hit"}}'
        )
        assert decided in metrics

        # the controller dies: /readyz says degraded, requests are still served (fallback)
        procs: Procs = domain["procs"]
        procs.procs["controller"].terminate()
        procs.procs["controller"].wait(timeout=20)
        old_epoch = state.index.replica.epoch
        for _ in range(100):
            if not state.index.usable:
                break
            await asyncio.sleep(0.1)
        ready = await c.get("/readyz")
        assert ready.status_code == 200 and ready.json()["status"] == "degraded"
        r3 = await c.post("/v1/chat/completions", json=turn(msgs2, False))
        assert (
            r3.status_code == 200 and r3.headers["x-kvpool-route-reason"] == "fallback-least-load"
        )

        # it comes back (same ports, a new epoch): the replica resyncs from a snapshot
        procs.start("controller", domain["controller_argv"], base_env())
        procs.wait_ready("controller", domain["controller"])
        for _ in range(100):
            if state.index.in_sync and state.index.replica.epoch != old_epoch:
                break
            await asyncio.sleep(0.1)
        assert state.index.in_sync and state.index.replica.epoch != old_epoch
        assert (await c.get("/readyz")).json()["status"] == "ready"

        # an instance killed mid-stream: the client's stream ends with an error event, and
        # the next request goes to the surviving instance
        long = {"prompt": "An endless tale of the river", "max_tokens": 400, "ignore_eos": True,
                "temperature": 0, "stream": True}  # fmt: skip
        pin = {"x-kvpool-instance": first_instance}
        async with c.stream("POST", "/v1/completions", json=long, headers=pin) as r:
            assert r.status_code == 200
            lines = r.aiter_lines()
            first = await anext(ln async for ln in lines if ln.startswith("data: "))
            assert json.loads(first[6:])["choices"]
            procs.procs[first_instance].kill()
            rest = [ln[6:] async for ln in lines if ln.startswith("data: ")]
        assert json.loads(rest[-1])["error"]["code"] == "upstream_cut"
        other = next(w["name"] for w in domain["workers"] if w["name"] != first_instance)
        r4 = await c.post("/v1/chat/completions", json=turn(msgs2, False))
        assert r4.status_code == 200 and r4.headers["x-kvpool-instance"] == other
