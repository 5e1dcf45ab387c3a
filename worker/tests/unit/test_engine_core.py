"""ReferenceEngine end to end on CPU, without a KV offload: streams, batching, stops, errors,
abort and shutdown, against the transformers model's own greedy decoding (real model math).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

from kvpool.worker.engine import ABORT_TOKEN_ID, ReferenceEngine
from kvpool.worker.engine_api import (
    EngineError,
    GenerationRequest,
    ReferenceEngineOptions,
    SamplingParams,
    TokenEvent,
)

OPTS = ReferenceEngineOptions(num_kv_blocks=128, max_model_len=512, max_num_seqs=4)


def prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 8192) for _ in range(n)]


@pytest.fixture
async def engine() -> AsyncIterator[ReferenceEngine]:
    eng = ReferenceEngine(OPTS)
    await eng.start()
    yield eng
    await eng.shutdown(5.0)


async def collect(
    eng: ReferenceEngine, rid: str, ids: list[int], **sampling: Any
) -> list[TokenEvent]:
    req = GenerationRequest(rid, ids, SamplingParams(**sampling))
    return [ev async for ev in eng.generate(req)]


def hf_greedy(eng: ReferenceEngine, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    with torch.inference_mode():
        for _ in range(n):
            logits = eng.model.hf_model(torch.tensor([out])).logits[0, -1]
            out.append(int(torch.argmax(logits)))
    return out[len(ids) :]


async def test_greedy_stream_matches_transformers_greedy(engine: ReferenceEngine) -> None:
    ids = prompt(60)
    events = await collect(engine, "r1", ids, max_tokens=6, ignore_eos=True)
    assert [e.token_id for e in events] == hf_greedy(engine, ids, 6)
    assert [e.index for e in events] == list(range(6))
    assert events[0].ttft_s is not None
    assert events[0].ttft_s > 0
    assert all(e.ttft_s is None for e in events[1:])
    assert events[0].num_prompt_tokens == 60
    assert events[0].num_cached_tokens == 0
    assert [e.finished for e in events] == [False] * 5 + [True]
    assert events[-1].finish_reason == "length"
    assert engine.num_free_blocks == OPTS.num_kv_blocks


async def test_concurrent_streams_interleave_and_match_solo_runs(engine: ReferenceEngine) -> None:
    prompts = {f"c{i}": prompt(20 + 30 * i, seed=i) for i in range(4)}
    order: list[str] = []

    async def run(rid: str) -> list[int]:
        toks = []
        req = GenerationRequest(rid, prompts[rid], SamplingParams(max_tokens=6, ignore_eos=True))
        async for ev in engine.generate(req):
            order.append(rid)
            toks.append(ev.token_id)
        return toks

    together = await asyncio.gather(*(run(rid) for rid in prompts))
    # continuous batching: no request ran to completion before the others started
    assert len(set(order[:8])) > 1
    for rid, toks in zip(prompts, together, strict=True):
        solo = await collect(engine, rid + "-solo", prompts[rid], max_tokens=6, ignore_eos=True)
        assert toks == [e.token_id for e in solo]
    metrics = engine.metrics()
    assert metrics["generated_tokens_total"] == 48
    assert metrics["requests_finished_total"] == 8
    assert metrics["ttft_seconds_count"] == 8


async def test_stop_tokens_eos_and_ignore_eos(engine: ReferenceEngine) -> None:
    ids = prompt(30, seed=9)
    free = [e.token_id for e in await collect(engine, "a", ids, max_tokens=6, ignore_eos=True)]
    stop_at = free[2]
    stopped = await collect(engine, "b", ids, max_tokens=6, stop_token_ids=(stop_at,))
    assert [e.token_id for e in stopped] == free[: free.index(stop_at) + 1]
    assert stopped[-1].finish_reason == "stop"
    # the model's EOS ends a request unless ignore_eos; make the first greedy token the EOS
    eos_engine = ReferenceEngine(ReferenceEngineOptions(num_kv_blocks=64, eos_token_id=free[0]))
    await eos_engine.start()
    try:
        eos_run = await collect(eos_engine, "c", ids, max_tokens=6)
        assert [(e.token_id, e.finish_reason) for e in eos_run] == [(free[0], "stop")]
        ignored = await collect(eos_engine, "d", ids, max_tokens=6, ignore_eos=True)
        assert [e.token_id for e in ignored] == free
    finally:
        await eos_engine.shutdown(2.0)


async def test_seeded_sampling_is_reproducible(engine: ReferenceEngine) -> None:
    ids = prompt(25, seed=4)
    runs = [
        [
            e.token_id
            for e in await collect(
                engine, f"s{i}", ids, max_tokens=12, temperature=1.5, seed=seed, ignore_eos=True
            )
        ]
        for i, seed in enumerate((1, 1, 2))
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


async def test_max_model_len_is_refused_before_the_first_token(engine: ReferenceEngine) -> None:
    with pytest.raises(EngineError, match=r"prompt has 600 tokens but max_model_len is 512"):
        await collect(engine, "long", prompt(600))
    events = await collect(engine, "edge", prompt(505), max_tokens=50, ignore_eos=True)
    assert len(events) == 7  # generation stops at max_model_len
    assert events[-1].finish_reason == "length"


@pytest.mark.parametrize(
    ("ids", "sampling", "message"),
    [
        ([], {}, "prompt_token_ids is empty"),
        ([5, 8192], {}, r"prompt_token_ids\[1\] = 8192 is outside the vocabulary"),
        ([5, 6], {"top_p": 2.0}, "top_p"),
        ([5, 6], {"max_tokens": 0}, "max_tokens"),
    ],
)
async def test_bad_requests_are_engine_errors(
    engine: ReferenceEngine, ids: list[int], sampling: dict[str, Any], message: str
) -> None:
    with pytest.raises(EngineError, match=message):
        await collect(engine, "bad", ids, **sampling)


async def test_prompt_larger_than_the_kv_cache_is_refused() -> None:
    eng = ReferenceEngine(ReferenceEngineOptions(num_kv_blocks=4, block_size=16))
    await eng.start()
    try:
        with pytest.raises(EngineError, match=r"needs 5 KV blocks.*num_kv_blocks"):
            await collect(eng, "big", prompt(70))
    finally:
        await eng.shutdown(2.0)


async def test_abort_and_closed_streams_free_their_blocks(engine: ReferenceEngine) -> None:
    req = GenerationRequest("ab", prompt(100), SamplingParams(max_tokens=400, ignore_eos=True))
    stream = engine.generate(req)
    first = await anext(stream)
    assert first.index == 0
    assert engine.num_free_blocks < OPTS.num_kv_blocks
    await engine.abort("ab")
    assert engine.num_free_blocks == OPTS.num_kv_blocks
    rest = [ev async for ev in stream]
    assert rest[-1].finish_reason == "abort"
    assert rest[-1].token_id == ABORT_TOKEN_ID

    gen = engine.generate(GenerationRequest("cl", prompt(50), SamplingParams(max_tokens=400)))
    await anext(gen)
    await gen.aclose()  # the client went away
    for _ in range(100):
        if engine.num_free_blocks == OPTS.num_kv_blocks:
            break
        await asyncio.sleep(0.01)
    assert engine.num_free_blocks == OPTS.num_kv_blocks
    assert engine.metrics()["requests_aborted_total"] == 2


async def test_preemption_when_out_of_blocks_keeps_results() -> None:
    """Six requests that cannot all hold their KV at once: the youngest are preempted and
    recomputed, and every request still gets exactly the tokens it gets alone."""
    small = ReferenceEngine(ReferenceEngineOptions(num_kv_blocks=12, block_size=16))
    await small.start()
    try:
        prompts = [prompt(40, seed=20 + i) for i in range(6)]
        together = await asyncio.gather(
            *(
                collect(small, f"p{i}", p, max_tokens=12, ignore_eos=True)
                for i, p in enumerate(prompts)
            )
        )
        assert small.metrics()["preemptions_total"] > 0
        for i, p in enumerate(prompts):
            alone = await collect(small, f"q{i}", p, max_tokens=12, ignore_eos=True)
            assert [e.token_id for e in together[i]] == [e.token_id for e in alone]
        assert small.num_free_blocks == 12
    finally:
        await small.shutdown(2.0)


async def test_chunked_prefill_equals_one_shot_prefill(engine: ReferenceEngine) -> None:
    chunked = ReferenceEngine(OPTS, max_batched_tokens=48)
    await chunked.start()
    try:
        ids = prompt(200, seed=11)
        a = await collect(engine, "one", ids, max_tokens=5, ignore_eos=True)
        b = await collect(chunked, "chunks", ids, max_tokens=5, ignore_eos=True)
        assert [e.token_id for e in a] == [e.token_id for e in b]
    finally:
        await chunked.shutdown(2.0)


async def test_shutdown_aborts_in_flight_work_within_the_deadline() -> None:
    eng = ReferenceEngine(OPTS)
    await eng.start()
    stream = eng.generate(
        GenerationRequest("long", prompt(50), SamplingParams(max_tokens=10_000, ignore_eos=True))
    )
    await anext(stream)
    loop = asyncio.get_running_loop()
    began = loop.time()
    await eng.shutdown(0.5)
    assert loop.time() - began < 1.5
    events = [ev async for ev in stream]
    assert events[-1].finish_reason == "abort"
    with pytest.raises(EngineError, match="shutting down"):
        await collect(eng, "late", prompt(5))


async def test_memory_api_without_offload_is_empty(engine: ReferenceEngine) -> None:
    assert await engine.evict(token_ids=[1, 2]) == 0
    assert await engine.prefetch([1, 2]) == 0
    assert await engine.pin([1]) == 0
    assert await engine.unpin([1]) == 0
    assert engine.memory_stats() == {}


async def test_a_failing_step_fails_its_streams_and_the_engine_keeps_serving() -> None:
    broken = {"on": True}

    def observer(rid: str, index: int, row: torch.Tensor) -> None:
        if broken["on"]:
            raise ValueError("observer bug")

    eng = ReferenceEngine(OPTS, logits_observer=observer)
    await eng.start()
    try:
        with pytest.raises(RuntimeError, match="observer bug"):
            await collect(eng, "x", prompt(10), max_tokens=3)
        assert eng.num_free_blocks == OPTS.num_kv_blocks
        broken["on"] = False
        assert len(await collect(eng, "y", prompt(10), max_tokens=3, ignore_eos=True)) == 3
    finally:
        await eng.shutdown(2.0)


async def test_request_outgrowing_the_kv_cache_ends_without_repeating_a_token() -> None:
    """4 blocks of 16 = 64 slots: a 40-token prompt can generate until the cache is full; the
    final "length" event must not replay the last token (the runtime would print it twice)."""
    eng = ReferenceEngine(ReferenceEngineOptions(num_kv_blocks=4, block_size=16))
    await eng.start()
    try:
        events = await collect(eng, "big", prompt(40), max_tokens=100, ignore_eos=True)
    finally:
        await eng.shutdown(5.0)
    tokens = [e for e in events if e.token_id >= 0]
    assert [e.index for e in tokens] == list(range(len(tokens)))
    assert 0 < len(tokens) <= 64 - 40 + 1
    assert events[-1].finished
    assert events[-1].finish_reason == "length"
    assert events[-1].token_id == ABORT_TOKEN_ID
    assert sum(e.finished for e in events) == 1
