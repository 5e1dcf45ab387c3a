"""``SimEngine``'s driver: model time to wall time, token streams, hits, abort, shutdown.

The engine runs here without a controller (no LMCache config): simcore's device prefix cache
and DDR tier still work. Time checks are lower bounds (a step never ends before its model time
divided by the speedup) plus generous upper bounds, so a loaded box cannot fail them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from kvpool.protocol.chat import REFERENCE_TOKENIZER_DIR, load_tokenizer
from kvpool.worker.engine_api import (
    EngineError,
    GenerationRequest,
    KVTransferParams,
    SamplingParams,
    TokenEvent,
)
from kvpool.worker.sim.engine import ABORT_TOKEN_ID, SimEngine

Make = Callable[..., SimEngine]

SPECIAL = load_tokenizer(REFERENCE_TOKENIZER_DIR).special_token_ids()


PROMPT = [(i * 37) % 8000 + 5 for i in range(100)]  # 6 full chunks of 16 + 4 tokens


async def collect(eng: SimEngine, rid: str, prompt: list[int], n: int, **kw: Any) -> list[Any]:
    req = GenerationRequest(rid, prompt, SamplingParams(max_tokens=n, **kw))
    return [e async for e in eng.generate(req)]


def test_exactly_max_tokens_ordinary_tokens_deterministic_and_repeats_hit(
    make_sim_engine: Make,
) -> None:
    async def run() -> tuple[list[Any], list[Any], list[Any], dict[str, float]]:
        eng = make_sim_engine()
        await eng.start()
        a = await collect(eng, "a", PROMPT, 40, stop_token_ids=(7,))
        b = await collect(eng, "b", PROMPT, 40, stop_token_ids=(7,))
        c = await collect(eng, "c", PROMPT, 40, seed=3)
        m = eng.metrics()
        await eng.shutdown(1.0)
        return a, b, c, m

    a, b, c, m = asyncio.run(run())
    assert len(a) == 40 and [e.index for e in a] == list(range(40))
    assert all(not e.finished for e in a[:-1]) and a[-1].finished
    assert a[-1].finish_reason == "length"
    ids = [e.token_id for e in a]
    assert not set(ids) & (SPECIAL | {7})
    assert ids == [e.token_id for e in b]  # same prompt, same seed: same text
    assert ids != [e.token_id for e in c]
    assert a[0].num_prompt_tokens == 100 and a[0].ttft_s is not None
    assert a[0].num_cached_tokens == 0
    assert b[0].num_cached_tokens == 96  # six chunks from the device prefix cache
    assert m["cached_tokens_total.device"] == 192 and m["requests_finished_total"] == 3
    assert m["generated_tokens_total"] == 120 and m["requests_running"] == 0


def test_model_time_maps_to_wall_time_by_the_speedup(make_sim_engine: Make) -> None:
    """One request: a 0.01 + 100 x 0.0001 s prefill step, then 9 decode steps of 0.01 s:
    0.11 model seconds, 0.11 / speedup wall seconds at least."""

    async def run(speedup: float) -> float:
        eng = make_sim_engine(speedup=speedup)
        await eng.start()
        t0 = time.monotonic()
        await collect(eng, "a", PROMPT, 10)
        wall = time.monotonic() - t0
        await eng.shutdown(1.0)
        return wall

    slow = asyncio.run(run(1.0))
    assert 0.11 <= slow < 0.11 + 2.0
    fast = asyncio.run(run(4.0))
    assert 0.11 / 4 <= fast < 0.11 / 4 + 2.0
    slow_motion = asyncio.run(run(0.5))
    assert slow_motion >= 0.22


def test_a_lagging_process_shows_as_latency_not_catch_up(make_sim_engine: Make) -> None:
    """The loop is blocked 0.3 s after the first token: the 19 decode steps left still take
    their 0.19 model seconds after that, and the lag is exported."""

    async def run() -> tuple[float, dict[str, float]]:
        eng = make_sim_engine(speedup=1.0)
        await eng.start()
        req = GenerationRequest("a", PROMPT, SamplingParams(max_tokens=20))
        stream = eng.generate(req)
        await anext(stream)
        time.sleep(0.3)  # the process stalls (a GC pause, a busy neighbour)
        unblocked = time.monotonic()
        rest = [e async for e in stream]
        tail = time.monotonic() - unblocked
        assert len(rest) == 19
        m = eng.metrics()
        await eng.shutdown(1.0)
        return tail, m

    tail, m = asyncio.run(run())
    assert tail >= 0.18  # a catch-up would deliver the remaining tokens at once
    assert m["sim_lag_seconds_max"] >= 0.25


def test_client_gone_and_abort_free_the_request(make_sim_engine: Make) -> None:
    async def run() -> tuple[list[TokenEvent], dict[str, float], dict[str, float]]:
        eng = make_sim_engine(speedup=1.0)
        await eng.start()
        stream = eng.generate(GenerationRequest("a", PROMPT, SamplingParams(max_tokens=500)))
        await anext(stream)
        await stream.aclose()  # the client went away
        gone = eng.metrics()
        events: list[TokenEvent] = []

        async def consume() -> None:
            req = GenerationRequest("b", PROMPT, SamplingParams(max_tokens=500))
            events.extend([e async for e in eng.generate(req)])

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        await eng.abort("b")
        await asyncio.wait_for(task, 2)
        m = eng.metrics()
        await eng.shutdown(1.0)
        return events, gone, m

    events, gone, m = asyncio.run(run())
    assert gone["requests_running"] == 0 and gone["requests_aborted_total"] == 1
    assert events[-1].token_id == ABORT_TOKEN_ID and events[-1].finish_reason == "abort"
    assert m["requests_aborted_total"] == 2
    assert m["kv_blocks_free"] == m["kv_blocks_total"] - 6 * 4  # only the cached prefix stays


def test_refusals_are_engine_errors_and_shutdown_aborts_in_flight_work(
    make_sim_engine: Make,
) -> None:
    async def run() -> list[TokenEvent]:
        eng = make_sim_engine(speedup=0.01)  # slow motion: nothing finishes before the shutdown
        with pytest.raises(EngineError, match="not started"):
            await collect(eng, "x", PROMPT, 1)
        await eng.start()
        with pytest.raises(EngineError, match="max_model_len"):
            await collect(eng, "x", PROMPT, 2000)
        with pytest.raises(EngineError, match="outside the vocabulary"):
            await collect(eng, "x", [9000], 1)
        pd = GenerationRequest("x", PROMPT, kv_transfer=KVTransferParams("r", "h", (1,), (2,)))
        with pytest.raises(EngineError, match="PD is not simulated"):
            [e async for e in eng.generate(pd)]
        events: list[TokenEvent] = []

        async def consume() -> None:
            req = GenerationRequest("s", PROMPT, SamplingParams(max_tokens=5))
            events.extend([e async for e in eng.generate(req)])

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.02)
        await eng.shutdown(0.3)
        await asyncio.wait_for(task, 2)
        with pytest.raises(EngineError, match="shutting down"):
            await collect(eng, "y", PROMPT, 1)
        return events

    events = asyncio.run(run())
    assert events and events[-1].finish_reason == "abort"


def test_ddr_hits_after_the_device_forgot_and_memory_api(make_sim_engine: Make) -> None:
    async def run() -> tuple[list[Any], dict[str, float], dict[str, Any]]:
        eng = make_sim_engine()
        await eng.start()
        await collect(eng, "a", PROMPT, 2)
        assert await eng.evict(token_ids=PROMPT, locations=["device"]) == 6
        again = await collect(eng, "b", PROMPT, 2)
        assert await eng.pin(PROMPT) == 96
        assert await eng.lookup(PROMPT) == 96 and await eng.lookup([7, 7, 7]) == 0
        assert await eng.evict(token_ids=PROMPT, locations=["local_cpu"]) == 0
        assert await eng.unpin(PROMPT) == 96
        stats = eng.memory_stats()
        m = eng.metrics()
        await eng.shutdown(1.0)
        return again, m, stats

    again, m, stats = asyncio.run(run())
    assert again[0].num_cached_tokens == 96
    assert m["cached_tokens_total.local_cpu"] == 96
    assert m["evicted_chunks_total.device"] == 6 and m["stored_chunks_total.local_cpu"] == 6
    assert stats["tiers"]["local_cpu"]["chunks"] == 6 and stats["hit_tokens"] == 96


def test_readyz_says_when_lmcache_is_frozen(make_sim_engine: Make) -> None:
    """During a full-sync freeze the worker is ready but stores nothing it prefills; /readyz
    says so (``frozen``) and the gateway prefers other instances meanwhile."""
    import httpx

    from kvpool.protocol.chat import REFERENCE_TOKENIZER_DIR, load_tokenizer
    from kvpool.worker.server import WorkerRuntime, build_app

    async def run() -> list[dict[str, Any]]:
        eng = make_sim_engine()
        rt = WorkerRuntime(eng, load_tokenizer(REFERENCE_TOKENIZER_DIR))
        await rt.start_engine()
        transport = httpx.ASGITransport(app=build_app(rt, start_engine=False))
        seen = []
        async with httpx.AsyncClient(transport=transport, base_url="http://w") as c:
            seen.append((await c.get("/readyz")).json())
            eng.set_frozen(True)
            seen.append((await c.get("/readyz")).json())
        await eng.shutdown(2.0)
        return seen

    before, during = asyncio.run(run())
    assert before["status"] == during["status"] == "ready"
    assert (before["frozen"], during["frozen"]) == (False, True)
