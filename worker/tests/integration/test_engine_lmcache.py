"""The hit/miss invariant through the real LMCache engine, per tier, at the engine level.

A ReferenceEngine stores its prompts' KV through ``LMCacheOffload`` (real LMCache 0.5.6);
then the same engine (local tiers) or a second engine with its own LMCache instance on the
same remote service (Redis, Mooncake: real servers started by conftest) serves the prompt
again. Greedy tokens must equal the transformers model's own greedy decoding, the first
token's logits must match its forward within fp tolerance, and the hit must be real
(num_cached_tokens > 0, fewer tokens computed).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvpool.worker.engine import ReferenceEngine
from kvpool.worker.engine_api import (
    EngineError,
    GenerationRequest,
    ReferenceEngineOptions,
    SamplingParams,
)

OPTS = ReferenceEngineOptions(num_kv_blocks=128, block_size=16, max_model_len=1024)
CHUNK = 64
ATOL = 1e-4

Logits = dict[str, torch.Tensor]


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 8192) for _ in range(n)]


@pytest.fixture
async def engines(make_offload: Callable[..., Any]) -> AsyncIterator[Callable[..., Any]]:
    made: list[ReferenceEngine] = []

    async def make(config: dict[str, Any], logits: Logits) -> ReferenceEngine:
        def observe(rid: str, index: int, row: torch.Tensor) -> None:
            if index == 0:
                logits[rid] = row.clone()

        offload = make_offload({"chunk_size": CHUNK, **config})
        engine = ReferenceEngine(OPTS, offload, logits_observer=observe)
        await engine.start()
        made.append(engine)
        return engine

    yield make
    for engine in made:
        await engine.shutdown(1.5)


async def run(
    engine: ReferenceEngine, rid: str, ids: list[int], n: int = 5
) -> tuple[list[int], int]:
    req = GenerationRequest(rid, ids, SamplingParams(max_tokens=n, ignore_eos=True))
    events = [ev async for ev in engine.generate(req)]
    return [e.token_id for e in events], events[0].num_cached_tokens


def reference(
    engine: ReferenceEngine, ids: list[int], n: int = 5
) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and first-token logits from the transformers model itself."""
    out = list(ids)
    first: torch.Tensor | None = None
    with torch.inference_mode():
        for _ in range(n):
            logits = engine.model.hf_model(torch.tensor([out])).logits[0, -1].float()
            first = logits if first is None else first
            out.append(int(torch.argmax(logits)))
    assert first is not None
    return out[len(ids) :], first


async def check_hit(
    stored_by: ReferenceEngine, served_by: ReferenceEngine, logits: Logits, seed: int
) -> None:
    ids = prompt(200, seed)
    want, want_logits = reference(stored_by, ids)
    miss, miss_cached = await run(stored_by, f"miss-{seed}", ids)
    await stored_by.flush()
    computed = served_by.metrics()["computed_tokens_total"]
    hit, hit_cached = await run(served_by, f"hit-{seed}", ids)
    assert miss_cached == 0
    assert hit_cached == 192  # three whole 64-token chunks
    assert miss == want
    assert hit == want
    torch.testing.assert_close(logits[f"hit-{seed}"], want_logits, atol=ATOL, rtol=ATOL)
    assert served_by.metrics()["computed_tokens_total"] - computed == 8 + 4  # suffix + decodes
    # a partial prefix that ends mid-chunk: only the whole shared chunk is reused
    other = ids[:100] + prompt(50, seed + 1)
    want_other, other_logits = reference(served_by, other)
    got, cached = await run(served_by, f"partial-{seed}", other)
    assert (got, cached) == (want_other, 64)
    torch.testing.assert_close(logits[f"partial-{seed}"], other_logits, atol=ATOL, rtol=ATOL)


async def test_local_cpu_hit(engines: Callable[..., Any]) -> None:
    logits: Logits = {}
    engine = await engines({"local_cpu": True}, logits)
    await check_hit(engine, engine, logits, seed=1)
    assert engine.metrics()["cached_prompt_tokens_total"] == 192 + 64


async def test_local_cpu_whole_prompt_hit_with_unfull_chunk(engines: Callable[..., Any]) -> None:
    """save_unfull_chunk: the 200-token prompt is all cached (ending mid-block); the engine
    still recomputes the last token for its logits."""
    logits: Logits = {}
    engine = await engines({"local_cpu": True, "save_unfull_chunk": True}, logits)
    ids = prompt(200, seed=3)
    want, want_logits = reference(engine, ids)
    await run(engine, "first", ids)
    await engine.flush()
    hit, cached = await run(engine, "again", ids)
    assert (hit, cached) == (want, 199)
    torch.testing.assert_close(logits["again"], want_logits, atol=ATOL, rtol=ATOL)


async def test_local_disk_hit(engines: Callable[..., Any], tmp_path: Path) -> None:
    logits: Logits = {}
    config = {
        "local_cpu": False,
        "local_disk": f"file://{tmp_path}/",
        "max_local_disk_size": 0.1,
    }
    engine = await engines(config, logits)
    await check_hit(engine, engine, logits, seed=5)


async def test_redis_hit_from_a_second_engine(engines: Callable[..., Any], redis_url: str) -> None:
    logits: Logits = {}
    config = {"local_cpu": False, "remote_url": redis_url, "remote_serde": "naive"}
    first = await engines(config, logits)
    second = await engines(config, logits)
    await check_hit(first, second, logits, seed=7)


async def test_mooncake_hit_from_a_second_engine(
    engines: Callable[..., Any], mooncake: dict[str, Any]
) -> None:
    logits: Logits = {}
    config = {
        "local_cpu": False,
        "remote_url": mooncake["remote_url"],
        "remote_serde": "naive",
        "extra_config": mooncake["extra_config"],
    }
    first = await engines(config, logits)
    second = await engines(config, logits)
    await check_hit(first, second, logits, seed=9)


async def test_engine_builds_lmcache_from_its_options(tmp_path: Path) -> None:
    """``lmcache_config_file`` alone (no offload passed in): the engine builds LMCache for
    its own KV shape; a missing file is a clear EngineError at start."""
    config = tmp_path / "lmcache.yaml"
    config.write_text(f"chunk_size: {CHUNK}\nlocal_cpu: true\nmax_local_cpu_size: 0.1\n")
    opts = dataclasses.replace(OPTS, lmcache_config_file=str(config), lmcache_instance_id="t-own")
    engine = ReferenceEngine(opts)
    await engine.start()
    try:
        ids = prompt(130, seed=11)
        first, _ = await run(engine, "a", ids)
        await engine.flush()
        again, cached = await run(engine, "b", ids)
        assert (again, cached) == (first, 128)
        assert engine.memory_stats()
    finally:
        await engine.shutdown(1.5)
    missing = dataclasses.replace(OPTS, lmcache_config_file=str(tmp_path / "nope.yaml"))
    with pytest.raises(EngineError, match=r"nope\.yaml"):
        await ReferenceEngine(missing).start()
