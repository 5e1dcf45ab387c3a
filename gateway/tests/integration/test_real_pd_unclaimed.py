"""Transfers nobody claims, with a real prefill/decode pair (LMCache 0.5.6's PD backend over
NIXL/UCX on CPU) behind the gateway: each way one goes unclaimed fills the decoder's buffer
(its allocator's pages in use, ``kvpool_engine_pd_buffer_used_bytes``), and each is freed:
by the gateway's release, or by the decoder's unclaimed-transfer TTL.

- a prefill-only answer: the prefill request the proxy sent for ``max_tokens: 1`` (with a
  transfer) leaves it in the buffer; the gateway now transfers nothing for it, and releases
  the transfer of a first token that ends the answer;
- the client gone between prefill and decode: the gateway sends no decode and releases;
- the gateway killed between them (frozen with SIGSTOP once the prefill is in flight, so that
  it cannot send the decode, then SIGKILLed): the decoder's TTL frees it, and a new gateway
  serves the pair;
- 1000 unclaimed transfers in a row leave the buffer empty after the TTL; a PD request after
  them answers at its usual speed (a ratio to one before them) with greedy output equal to a
  run without PD.

Workers and gateway bind 127.0.0.1; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import statistics
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fakes import serving
from prometheus_client.parser import text_string_to_metric_families
from realstack import BIN, SEED, Procs, base_env, free_port, pd_gateway_config, start_pd_pair

from kvpool.gateway.app import build_app
from kvpool.gateway.config import GatewayEnv, parse_config
from kvpool.gateway.state import build_state
from kvpool.protocol.pd import UNCLAIMED_TTL_KEY

pytestmark = pytest.mark.timeout(900)
TTL_S = 8.0
BUFFER = 256 * 2**20
CHUNK = 256
LONG = 1900  # prompt tokens: a prefill of ~0.5 s on an idle 2-core box
UNCLAIMED_RUN = 1000


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 8000) for _ in range(n)]


def pages(n: int) -> int:
    return -(-n // CHUNK)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A prefill (sender) and a decode (receiver) worker, configured as the operator renders a
    cpu PDPair, the decoder with a short unclaimed-transfer TTL."""
    tmp = tmp_path_factory.mktemp("pd-unclaimed")
    procs = Procs(tmp)
    try:
        started = start_pd_pair(
            procs, tmp, buffer_bytes=BUFFER, decoder_extra=f"{{{UNCLAIMED_TTL_KEY}: {TTL_S}}}",
            kv_blocks=512,
        )  # fmt: skip
        yield {**started, "procs": procs, "tmp": tmp}
    finally:
        procs.close()


@contextlib.asynccontextmanager
async def gateway(pair: dict[str, Any]) -> AsyncIterator[httpx.AsyncClient]:
    """The gateway in this process (its PULL socket on the pair's proxy port)."""
    state = build_state(
        parse_config(pd_gateway_config(pair)),
        GatewayEnv(PYTHONHASHSEED=SEED),
        pd_bind_host="127.0.0.1",
    )
    async with serving(build_app(state)) as url, httpx.AsyncClient(base_url=url, timeout=120) as c:
        yield c


def metrics(url: str) -> dict[str, float]:
    """Every sample of ``url``'s /metrics, summed over labels."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def buffer(pair: dict[str, Any]) -> dict[str, float]:
    m = metrics(pair["urls"]["decode"])
    return {k.removeprefix("kvpool_engine_"): v for k, v in m.items() if "_pd_" in k}


def wait_until(what: str, check: Callable[[], bool], timeout_s: float) -> float:
    """Seconds until ``check()``; fails naming ``what`` after ``timeout_s``."""
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout_s:
            pytest.fail(f"{what} not within {timeout_s:g}s")
        time.sleep(0.05)
    return time.monotonic() - t0


def wait_empty(pair: dict[str, Any], timeout_s: float = TTL_S + 10) -> float:
    return wait_until(
        "the decoder's PD buffer empty",
        lambda: buffer(pair)["pd_buffer_used_bytes"] == 0,
        timeout_s,
    )


def spec(pair: dict[str, Any], req_id: str) -> dict[str, Any]:
    ports = {"receiver_init_port": [pair["init"]], "receiver_alloc_port": [pair["alloc"]]}
    return {"req_id": req_id, "receiver_host": "127.0.0.1", **ports}


def prefill_with_transfer(pair: dict[str, Any], prompt: list[int]) -> dict[str, Any]:
    """What the proxy used to send for ``max_tokens: 1``: a prefill with a transfer that no
    decode follows (the gateway's own code does not do this any more)."""
    transfer = {"ret_first_tok": True, "disagg_spec": spec(pair, uuid.uuid4().hex)}
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "kv_transfer_params": transfer}
    r = httpx.post(f"{pair['urls']['prefill']}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


def release(pair: dict[str, Any], prompt: list[int]) -> dict[str, Any]:
    body = {"req_id": uuid.uuid4().hex, "prompt_token_ids": prompt}
    r = httpx.post(f"{pair['urls']['decode']}/pd/release", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return dict(r.json())


@pytest.fixture(scope="module")
def page(pair: dict[str, Any]) -> float:
    """Bytes of one buffer page (LMCache allocates one per chunk, partial or not), measured
    with one unclaimed transfer that a release then frees."""
    wait_empty(pair)
    prompt = tokens(100, seed=1)
    prefill_with_transfer(pair, prompt)
    wait_until("the transfer in the buffer", lambda: buffer(pair)["pd_buffer_used_bytes"] > 0, 30)
    size = buffer(pair)["pd_buffer_used_bytes"]
    assert release(pair, prompt)["released_chunks"] == 1
    assert buffer(pair)["pd_buffer_used_bytes"] == 0
    return size


def grows_to(pair: dict[str, Any], expected: float) -> float:
    """The decoder's buffer usage once it reached ``expected`` bytes (bounded wait)."""
    seen: list[float] = []

    def reached() -> bool:
        seen.append(buffer(pair)["pd_buffer_used_bytes"])
        return seen[-1] >= expected

    wait_until(f"{expected:.0f} bytes in use in the decoder's buffer", reached, 60)
    return seen[-1]


def report(**values: object) -> None:
    print("PD-UNCLAIMED " + " ".join(f"{k}={v}" for k, v in values.items()))


async def test_prefill_only_answers_leave_no_transfer_in_the_decoder(
    pair: dict[str, Any], page: float
) -> None:
    wait_empty(pair)
    b0 = buffer(pair)
    # The proxy's old prefill-only request: the KV goes to the decoder and nobody claims it.
    # (Sent together, so that all four are in the buffer before the first one's TTL.)
    old = [tokens(600, seed=10 + i) for i in range(4)]  # 3 pages each
    await asyncio.gather(*(asyncio.to_thread(prefill_with_transfer, pair, p) for p in old))
    filled = grows_to(pair, 12 * page)
    assert filled == 12 * page
    sent0 = metrics(pair["urls"]["prefill"]).get("kvpool_engine_pd_sent_requests", 0.0)
    async with gateway(pair) as client:
        for i in range(4):  # max_tokens 1 through the gateway: nothing is transferred
            body = {"prompt": tokens(600, seed=20 + i), "max_tokens": 1, "temperature": 0}
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
        assert metrics(pair["urls"]["prefill"]).get("kvpool_engine_pd_sent_requests", 0) == sent0
        # A first token that ends the answer (it is a stop token): transferred, then released.
        prompt = tokens(600, seed=30)
        first = httpx.post(
            f"{pair['urls']['decode']}/v1/completions",
            json={"prompt": prompt, "max_tokens": 1, "temperature": 0, "return_token_ids": True},
            timeout=120,
        ).json()["choices"][0]["token_ids"][0]
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "stop_token_ids": [first]}
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop"
        await asyncio.to_thread(  # the loop stays free: the release runs in this process
            wait_until,
            "the gateway's release",
            lambda: buffer(pair)["pd_released_total"] >= b0["pd_released_total"] + 3,
            30,
        )
        gw = (await client.get("/metrics")).text
    assert 'kvpool_gateway_pd_releases_total{outcome="released",pair="pd"} 1.0' in gw
    assert 'kvpool_gateway_pd_requests_total{outcome="prefill_only",pair="pd"} 5.0' in gw
    # The old requests' transfers: the decoder's TTL frees them.
    freed_in = wait_empty(pair)
    b1 = buffer(pair)
    assert b1["pd_unclaimed_freed_total"] - b0["pd_unclaimed_freed_total"] == 12
    assert b1["pd_unclaimed_freed_bytes_total"] - b0["pd_unclaimed_freed_bytes_total"] == filled
    assert b1["pd_released_bytes_total"] - b0["pd_released_bytes_total"] == 3 * page
    report(case="prefill_only", buffer_used_before_ttl=filled, freed_after_s=round(freed_in, 1))


async def test_a_client_gone_between_prefill_and_decode_gets_no_decode_and_frees_it(
    pair: dict[str, Any], page: float
) -> None:
    wait_empty(pair)
    b0 = buffer(pair)
    served0 = metrics(pair["urls"]["decode"]).get("kvpool_worker_requests_total", 0.0)
    prefill = pair["urls"]["prefill"]
    async with gateway(pair) as client:
        body = {"prompt": tokens(LONG, seed=40), "max_tokens": 8, "temperature": 0}
        request = asyncio.create_task(client.post("/v1/completions", json=body))
        await asyncio.to_thread(
            wait_until,
            "the prefill in flight",
            lambda: metrics(prefill).get("kvpool_worker_inflight_requests", 0) >= 1,
            30,
        )
        request.cancel()  # the client leaves while the prefill runs
        with contextlib.suppress(asyncio.CancelledError):
            await request
        await asyncio.to_thread(
            wait_until,
            "the gateway's release",
            lambda: buffer(pair)["pd_released_total"] >= b0["pd_released_total"] + pages(LONG),
            60,
        )
        gw = (await client.get("/metrics")).text
    b1 = buffer(pair)
    assert b1["pd_buffer_used_bytes"] == 0
    assert b1["pd_released_bytes_total"] - b0["pd_released_bytes_total"] == pages(LONG) * page
    assert b1["pd_unclaimed_freed_total"] == b0["pd_unclaimed_freed_total"]  # not the TTL
    assert metrics(pair["urls"]["decode"]).get("kvpool_worker_requests_total", 0) == served0
    assert 'kvpool_gateway_pd_requests_total{outcome="client_gone",pair="pd"} 1.0' in gw


def start_gateway(pair: dict[str, Any], name: str) -> str:
    tmp: Path = pair["tmp"]
    path = tmp / "gateway.yaml"
    path.write_text(yaml.safe_dump(pd_gateway_config(pair)))
    port = free_port()
    pair["procs"].start(
        name,
        [str(BIN / "kvpool-gateway"), "serve", "--config", str(path), "--host", "127.0.0.1",
         "--port", str(port)],
        {**base_env(), "PYTHONHASHSEED": SEED},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    pair["procs"].wait_ready(name, url)
    return url


def test_a_gateway_killed_between_prefill_and_decode_leaves_a_transfer_the_ttl_frees(
    pair: dict[str, Any], page: float
) -> None:
    wait_empty(pair)
    b0 = buffer(pair)
    decode, prefill = pair["urls"]["decode"], pair["urls"]["prefill"]
    served0 = metrics(decode).get("kvpool_worker_requests_total", 0.0)
    url = start_gateway(pair, "gateway-1")
    proc = pair["procs"].procs["gateway-1"]
    prompt = tokens(LONG, seed=50)
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}

    def client() -> None:
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(f"{url}/v1/completions", json=body, timeout=30)

    with contextlib.ExitStack() as stack:
        thread = threading.Thread(target=client, daemon=True)
        thread.start()
        stack.callback(thread.join, 35)
        wait_until(
            "the prefill in flight",
            lambda: metrics(prefill).get("kvpool_worker_inflight_requests", 0) >= 1,
            30,
        )
        os.kill(proc.pid, signal.SIGSTOP)  # it can no longer send the decode
        filled = grows_to(pair, pages(LONG) * page)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    assert filled == pages(LONG) * page  # the transfer, unclaimed
    freed_in = wait_empty(pair)
    b1 = buffer(pair)
    assert b1["pd_unclaimed_freed_total"] - b0["pd_unclaimed_freed_total"] == pages(LONG)
    assert b1["pd_released_total"] == b0["pd_released_total"]
    assert metrics(decode).get("kvpool_worker_requests_total", 0) == served0  # no decode came
    log = (pair["tmp"] / "decode.log").read_text(errors="replace")
    assert "event=pd_unclaimed_freed instance=dec-0 chunks=" in log
    # A new gateway on the same proxy port serves the pair.
    url = start_gateway(pair, "gateway-2")
    short = {"prompt": tokens(300, seed=51), "max_tokens": 6, "temperature": 0}
    alone = httpx.post(f"{decode}/v1/completions", json=short, timeout=120).json()
    r = httpx.post(f"{url}/v1/completions", json=short, timeout=120)
    assert r.status_code == 200 and r.headers["x-kvpool-instance"] == "pre-0,dec-0"
    assert r.json()["choices"][0]["text"] == alone["choices"][0]["text"]
    pair["procs"].procs["gateway-2"].terminate()
    pair["procs"].procs["gateway-2"].wait(20)
    report(case="gateway_killed", buffer_used_before_ttl=filled, freed_after_s=round(freed_in, 1))


async def _timed_pd(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[float, str]:
    t0 = time.perf_counter()
    r = await client.post("/v1/completions", json=body)
    elapsed = time.perf_counter() - t0
    assert r.status_code == 200 and r.headers["x-kvpool-instance"] == "pre-0,dec-0", r.text
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # transferred
    return elapsed, str(r.json()["choices"][0]["text"])


async def test_1000_unclaimed_transfers_then_pd_at_its_usual_speed(
    pair: dict[str, Any], page: float
) -> None:
    wait_empty(pair)
    b0 = buffer(pair)
    decode, prefill = pair["urls"]["decode"], pair["urls"]["prefill"]
    body = {"prompt": tokens(600, seed=60), "max_tokens": 8, "temperature": 0}
    alone = httpx.post(f"{decode}/v1/completions", json=body, timeout=120).json()
    async with gateway(pair) as client:  # bound to the proxy port: the notifications land
        before = [await _timed_pd(client, body) for _ in range(3)]
        peak = 0.0
        sem = asyncio.Semaphore(4)
        deadline = time.monotonic() + 600
        refused = 0

        async def unclaimed(i: int, http: httpx.AsyncClient) -> None:
            """One prefill whose transfer nobody claims. While the buffer is full the decoder
            answers an allocation only as the TTL frees pages; a push that waits past the
            sender's bound (pd_sender.SEND_TIMEOUT_S) is aborted and answered 503 with
            Retry-After, and retried here as a client would."""
            nonlocal refused
            req = {"prompt": [7, *tokens(15, seed=1000 + i)], "max_tokens": 1, "temperature": 0,
                   "kv_transfer_params": {"ret_first_tok": True,
                                          "disagg_spec": spec(pair, f"unclaimed-{i}")}}  # fmt: skip
            for attempt in range(20):
                async with sem:
                    r = await http.post(f"{prefill}/v1/completions", json=req)
                if r.status_code == 200:
                    return
                assert r.status_code == 503, r.text
                assert r.json()["error"]["code"] == "pd_transfer_failed", r.text
                refused += 1
                req["kv_transfer_params"]["disagg_spec"] = spec(pair, f"unclaimed-{i}-{attempt}")
                await asyncio.sleep(float(r.headers.get("retry-after", "1")))
            raise AssertionError(f"unclaimed-{i}: still refused after 20 attempts")

        async def watch() -> None:
            nonlocal peak
            while True:
                used = await asyncio.to_thread(lambda: buffer(pair)["pd_buffer_used_bytes"])
                peak = max(peak, used)
                await asyncio.sleep(0.5)

        t0 = time.monotonic()
        watcher = asyncio.create_task(watch())
        async with httpx.AsyncClient(timeout=120) as http:
            await asyncio.wait_for(
                asyncio.gather(*(unclaimed(i, http) for i in range(UNCLAIMED_RUN))),
                deadline - time.monotonic(),
            )
        run_s = time.monotonic() - t0
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        at_end = buffer(pair)["pd_buffer_used_bytes"]
        # With the buffer full, the sender's pushes queue behind the answers: they land as the
        # TTL frees pages, then wait their own TTL.
        emptied_in = await asyncio.to_thread(wait_empty, pair, 4 * TTL_S + 30)
        # A push aborted while the buffer was full marked the decoder stale (pd_sender): the
        # first PD request after may be answered 503 pd_transfer_failed while the sender
        # handshakes again; it is retried (bounded) as its Retry-After says, and counted.
        reconnect_refusals = 0
        for _ in range(5):
            probe = await client.post("/v1/completions", json=body)
            if probe.status_code == 200:
                break
            assert probe.status_code == 503 and "pd_transfer_failed" in probe.text, probe.text
            reconnect_refusals += 1
            await asyncio.sleep(float(probe.headers.get("retry-after", "1")))
        after = [await _timed_pd(client, body) for _ in range(3)]
    b1 = buffer(pair)
    assert b1["pd_unclaimed_freed_total"] - b0["pd_unclaimed_freed_total"] >= UNCLAIMED_RUN
    assert b1["pd_buffer_used_bytes"] == 0 and b1["pd_buffer_chunks"] == 0
    texts = {text for _, text in before + after}
    assert texts == {alone["choices"][0]["text"]}  # greedy, equal to a run without PD
    t_before = statistics.median(t for t, _ in before)
    t_after = statistics.median(t for t, _ in after)
    ratio = t_after / t_before
    report(case="unclaimed_1000", run_s=round(run_s, 1), peak_used_bytes=peak,
           used_at_end_bytes=at_end, emptied_after_s=round(emptied_in, 1),
           pd_before_s=round(t_before, 3), pd_after_s=round(t_after, 3),
           ratio=round(ratio, 2), refused_then_retried=refused,
           refused_after_the_run=reconnect_refusals)  # fmt: skip
    assert ratio < 5, f"PD after the unclaimed run took {ratio:.2f}x as long as before"
