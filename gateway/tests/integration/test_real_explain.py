"""``GET /v1/requests/{id}/explain`` on real parts, one miss reason after another: the real
``kvpool-controller`` and reference workers (``kvpool-worker serve --engine reference``, the
real LMCache 0.5.6 engine), the gateway in process on the controller's delta stream.

``w0`` is the domain's worker. ``wx`` is a worker of another domain (another seed: its instance
id carries its own fingerprint) that started while the controller was not up yet, with the
worker's wait for a controller turned off (``KVPOOL_WORKER_CONTROLLER_WAIT_S=0``, as a user may
set it): its start-up registration check got no answer, so it stays ready and serves, while the
controller refuses every registration of it once it runs (``GET /v1/stats`` lists it under
``refused``) and never indexes what it stores. (The gateway still has it in its instance
list, as a pod of the pool.)
Scenarios, in this order (the last restarts the controller):

- never stored: a prompt nobody sent before;
- prompt differs: the same prompt with one token changed, after the first is indexed, misses
  from that token's chunk on, and the report names the token and the first request;
- evicted: a prompt indexed, then evicted from w0's CPU tier (``POST /memory/evict``), misses
  because of that eviction (instance, tier, when);
- other fingerprint: a prompt the gateway sent to wx misses when it comes again, and the report
  names wx's refused registration and what wx holds of it by its own ``/memory/lookup``;
- dropped during a full-sync freeze: the controller restarts (full-sync recovery), w0's LMCache
  freezes while it resends its keys (held for ``full_sync_status_poll_interval_s``), a prompt
  routed to it then is not stored, and the same prompt afterwards misses for that reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import shutil
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from fakes import serving
from realstack import BIN, FACTS, SEED, Procs, base_env, free_port

from kvpool.gateway.app import build_app
from kvpool.gateway.config import GatewayEnv, parse_config
from kvpool.gateway.explain_view import render_text
from kvpool.gateway.state import GatewayState, build_state
from kvpool.protocol.domain import domain_fingerprint, instance_id

pytestmark = pytest.mark.timeout(900)

CHUNK = 256
FREEZE_S = 20  # w0's full_sync_status_poll_interval_s: its LMCache stays frozen that long
OTHER = replace(FACTS, hash_seed="7")  # wx's domain: another seed, another fingerprint
WX_ID = instance_id("wx", domain_fingerprint(OTHER))


def _worker_config(path: Path, instance: str, pull: int, reply: int) -> None:
    extra = {"full_sync_startup_delay_s": 0, "full_sync_status_poll_interval_s": FREEZE_S,
             "full_sync_max_poll_attempts": 3}  # fmt: skip
    path.write_text(
        f"chunk_size: {CHUNK}\nlocal_cpu: true\nmax_local_cpu_size: 0.5\n"
        f"lmcache_instance_id: {instance}\n"
        "enable_controller: true\n"
        f"controller_pull_url: 127.0.0.1:{pull}\ncontroller_reply_url: 127.0.0.1:{reply}\n"
        f"lmcache_worker_ports: [{free_port()}]\n"
        "lmcache_worker_heartbeat_time: 1\nlmcache_worker_heartbeat_delay_time: 1\n"
        f"extra_config: {json.dumps(extra)}\n"
    )


def _wait(what: str, check: Callable[[], bool], timeout_s: float = 120) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if check():
            return
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}")


@pytest.fixture
def domain(tmp_path: Path) -> Iterator[dict[str, Any]]:
    if shutil.which("kvpool-worker", path=str(BIN)) is None:
        pytest.skip("kvpool-worker is not installed")
    procs = Procs(tmp_path)
    http, pull, reply, beat, pub, snap = (free_port() for _ in range(6))
    try:
        controller_argv = [
            str(BIN / "kvpool-controller"), "--host", "127.0.0.1", "--port", str(http),
            "--monitor-ports", json.dumps({"pull": pull, "reply": reply, "heartbeat": beat}),
            "--pub-port", str(pub), "--snapshot-port", str(snap), "--chunk-size", str(CHUNK),
        ]  # fmt: skip
        controller = f"http://127.0.0.1:{http}"
        urls = {}
        for name, facts in (("wx", OTHER), ("w0", FACTS)):
            if name == "w0":  # wx is up, its registration check found no controller: start it
                _wait("wx's registration check", lambda: "could not confirm" in procs.log("wx"))
                procs.start("controller", controller_argv, base_env())
                procs.wait_ready("controller", controller)
            port = free_port()
            fingerprint = domain_fingerprint(facts)
            config = tmp_path / f"{name}.yaml"
            _worker_config(config, instance_id(name, fingerprint), pull, reply)
            env = {**base_env(), "LMCACHE_CONFIG_FILE": str(config)}
            env.update(PYTHONHASHSEED=facts.hash_seed, KVPOOL_DOMAIN_FINGERPRINT=fingerprint)
            if name == "wx":  # no wait for the controller: it starts before there is one
                env["KVPOOL_WORKER_CONTROLLER_WAIT_S"] = "0"
            procs.start(
                name,
                [str(BIN / "kvpool-worker"), "serve", "--engine", "reference", "--host",
                 "127.0.0.1", "--port", str(port), "--max-model-len", "2048",
                 "--num-kv-blocks", "256", "--block-size", "16", "--kv-dtype", "float32"],
                env,
            )  # fmt: skip
            urls[name] = f"http://127.0.0.1:{port}"
            procs.wait_ready(name, urls[name])

        def wx_refused() -> bool:
            with contextlib.suppress(httpx.HTTPError, ValueError):
                stats = httpx.get(f"{controller}/v1/stats", timeout=2).json()
                return WX_ID in (stats.get("refused") or {})
            return False

        _wait("the controller to refuse wx's registration", wx_refused)
        yield {
            "controller": controller,
            "pub": f"tcp://127.0.0.1:{pub}",
            "snapshot": f"tcp://127.0.0.1:{snap}",
            "urls": urls,
            "procs": procs,
            "controller_argv": controller_argv,
        }
    finally:
        procs.close()


def prompt(first: int, n: int = 3 * CHUNK + 40) -> list[int]:
    """``n`` token ids, distinct from another ``first``'s (the reference vocabulary is larger)."""
    return [100 + (first * 7 + i * 13) % 150 for i in range(n)]


async def _until(
    what: str, check: Callable[[], bool | Awaitable[bool]], timeout_s: float = 120
) -> None:
    for _ in range(int(timeout_s / 0.2)):
        got = check()
        if await got if inspect.isawaitable(got) else got:
            return
        await asyncio.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}")


async def _held(state: GatewayState, tokens: list[int], name: str) -> int:
    hits = await state.index.prefix_hits(state.hasher(tokens))
    return hits[name].hit_chunks if hits and name in hits else 0


async def test_each_miss_reason_on_real_workers(domain: dict[str, Any]) -> None:
    urls = domain["urls"]
    raw = {
        "model": "kvpool/reference-tiny",
        "chunkSize": CHUNK,
        "controllerUrl": domain["controller"],
        "controllerPubUrl": domain["pub"],
        "controllerSnapshotUrl": domain["snapshot"],
        "p2pGroups": [{"name": "g", "instances": [{"name": n, "url": u} for n, u in urls.items()]}],
        "limits": {"healthIntervalSeconds": 0.5},
        "tokenizer": "reference",
    }
    state = build_state(
        parse_config(raw), GatewayEnv(PYTHONHASHSEED=SEED), pd_bind_host="127.0.0.1"
    )
    state.selector.pending.ttl_s = 0.0  # only the controller's index says what is held
    async with serving(build_app(state)) as url, httpx.AsyncClient(base_url=url, timeout=120) as c:
        await _until("the index replica", lambda: state.index.in_sync)

        async def send(tokens: list[int], to: str = "w0") -> str:
            r = await c.post(
                "/v1/completions",
                json={"prompt": tokens, "max_tokens": 2},
                headers={"x-kvpool-instance": to},
            )
            assert r.status_code == 200, r.text
            assert r.headers["x-kvpool-instance"] == to
            return r.headers["x-request-id"]

        async def explain(rid: str) -> dict[str, Any]:
            r = await c.get(f"/v1/requests/{rid}/explain")
            assert r.status_code == 200, r.text
            report: dict[str, Any] = r.json()
            assert report["request_id"] == rid and render_text(report)
            return report

        # never stored
        p1 = prompt(1)
        r1 = await send(p1)
        report = await explain(r1)
        assert report["routing"][0]["instance"] == "w0" and report["chunks"] == 3
        assert [(m["chunks"], m["reason"]) for m in report["missed"]] == [([0, 2], "never-stored")]
        assert WX_ID in {r["instance_id"] for r in report["pool"]["refused"]}

        # the prompt differs at token 300 (chunk 1) from p1, which w0 holds
        await _until("p1 indexed", lambda: _held_n(state, p1, "w0", 3))
        p1b = list(p1)
        p1b[300] = 99
        report = await explain(await send(p1b))
        assert report["held"] == [{"chunks": [0, 0], "holders": 1, "groups": [0]}]
        assert report["index"]["groups"][0]["instances"] == ["w0"]
        (missed,) = report["missed"]
        assert (missed["chunks"], missed["reason"]) == ([1, 2], "prompt-differs")
        facts = missed["facts"]
        assert (facts["token"], facts["request_id"], facts["instance"]) == (300, r1, "w0")
        assert facts["ours"][300 - facts["window_start"]] == 99

        # evicted from w0's CPU tier
        p2 = prompt(2)
        await send(p2)
        await _until("p2 indexed", lambda: _held_n(state, p2, "w0", 3))
        evicted = await c.post("/memory/evict", json={"token_ids": p2, "instance": "w0"})
        assert evicted.status_code == 200, evicted.text
        assert evicted.json()["instances"]["w0"]["result"]["evicted_chunks"] >= 3
        await _until("p2's eviction indexed", lambda: _held_n(state, p2, "w0", 0))
        report = await explain(await send(p2))
        (missed,) = report["missed"]
        assert (missed["chunks"], missed["reason"]) == ([0, 2], "evicted")
        assert missed["facts"]["instance"].startswith("w0~")
        assert missed["facts"]["location"] == "LocalCPUBackend"
        assert "evicted from w0" in missed["detail"]

        # sent to wx (another domain, refused): it stores it, the index never has it
        p3 = prompt(3)
        r5 = await send(p3, "wx")
        report = await explain(await send(p3))
        (missed,) = report["missed"]
        assert (missed["chunks"], missed["reason"]) == ([0, 2], "other-fingerprint")
        assert missed["facts"]["instance_id"] == WX_ID
        assert "fingerprint" in missed["facts"]["reason"]
        assert f"sent to wx by request {r5}" in missed["detail"]
        assert report["pool"]["holds"]["wx"] == 3 * CHUNK  # its own lookup, its own hashes

        # the controller restarts: w0 resends its keys in a full sync, frozen meanwhile
        procs: Procs = domain["procs"]
        procs.procs["controller"].terminate()
        procs.procs["controller"].wait(timeout=20)
        procs.start("controller", domain["controller_argv"], base_env())
        procs.wait_ready("controller", domain["controller"])
        await _until(
            "w0 frozen for its full sync",
            lambda: any(i.name == "w0" for i in state.instances.frozen),
        )
        p4 = prompt(4)
        r6 = await send(p4)
        report = await explain(r6)
        assert report["routing"][0]["chosen_frozen"] is True
        await _until(
            "w0's freeze over and the index back",
            lambda: not state.instances.frozen and state.index.in_sync,
            FREEZE_S * 6,
        )
        report = await explain(await send(p4))
        (missed,) = report["missed"]
        assert (missed["chunks"], missed["reason"]) == ([0, 2], "dropped-frozen")
        assert missed["facts"]["request_id"] == r6
        assert missed["facts"]["skipped_frozen_tokens"] >= 3 * CHUNK
        assert "frozen for a full sync" in missed["detail"]


async def _held_n(state: GatewayState, tokens: list[int], name: str, n: int) -> bool:
    return await _held(state, tokens, name) == n
