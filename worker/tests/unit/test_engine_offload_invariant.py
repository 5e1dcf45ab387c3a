"""The invariant the project rests on, at the engine: a KV hit changes nothing but the time.

For any prompt, greedy tokens with a KV hit equal those without, and logits agree within fp
tolerance: full hits, whole-prompt hits (the last token is recomputed for its logits),
partial-prefix hits, and hits whose end falls mid-block.

``InMemoryOffload`` stands in for LMCache here (its real tests, per tier, belong to the
offload in ``engine/offload``): it honours the KVOffload contract with real data, copying
K/V out of the engine's paged caches on store and back into freshly allocated blocks on
retrieve, per prefix chunk. A corrupting variant is the negative control showing the loaded
KV is really used.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
import torch

from kvpool.worker.engine import ReferenceEngine
from kvpool.worker.engine_api import GenerationRequest, ReferenceEngineOptions, SamplingParams

CHUNK = 24  # not a multiple of the 16-token block: chunk ends fall mid-block
OPTS = ReferenceEngineOptions(num_kv_blocks=192, block_size=16, max_model_len=1024)
ATOL = 1e-4


class InMemoryOffload:
    """A KVOffload test double standing in for LMCache: prefix-keyed chunks of copied KV."""

    def __init__(self, chunk_size: int = CHUNK, *, save_unfull: bool = False) -> None:
        self.chunk_size = chunk_size
        self.save_unfull = save_unfull
        self.chunks: dict[tuple[int, ...], list[torch.Tensor]] = {}
        self.pinned: set[tuple[int, ...]] = set()
        self.counts = {"stored_tokens": 0.0, "retrieved_tokens": 0.0, "lookups": 0.0}
        self.closed_with: float | None = None

    def _spans(self, tokens: Sequence[int], limit: int | None = None) -> list[tuple[int, int]]:
        n = len(tokens) if limit is None else min(limit, len(tokens))
        spans = [
            (s, s + self.chunk_size) for s in range(0, n - self.chunk_size + 1, self.chunk_size)
        ]
        tail = n % self.chunk_size
        if tail and (self.save_unfull or limit is not None):
            spans.append((n - tail, n))
        return spans

    def lookup(self, token_ids: Sequence[int]) -> int:
        self.counts["lookups"] += 1
        hit = 0
        for _, end in self._spans(token_ids, len(token_ids)):
            if tuple(token_ids[:end]) not in self.chunks:
                break
            hit = end
        return hit

    def store(
        self,
        token_ids: Sequence[int],
        kv_caches: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor,
    ) -> None:
        for start, end in self._spans(token_ids):
            key = tuple(token_ids[:end])
            if key in self.chunks:
                continue
            slots = slot_mapping[start:end]
            self.chunks[key] = [
                torch.stack([kv[i].flatten(0, 1)[slots] for i in (0, 1)]).clone()
                for kv in kv_caches
            ]
            self.counts["stored_tokens"] += end - start

    def loaded_kv(self, layer_kv: torch.Tensor) -> torch.Tensor:
        return layer_kv

    def retrieve(
        self,
        token_ids: Sequence[int],
        num_tokens: int,
        kv_caches: Sequence[torch.Tensor],
        slot_mapping: torch.Tensor,
    ) -> int:
        loaded = 0
        for start, end in self._spans(token_ids, num_tokens):
            data = self.chunks.get(tuple(token_ids[:end]))
            if data is None:
                break
            slots = slot_mapping[start:end]
            for kv, chunk in zip(kv_caches, data, strict=True):
                for i in (0, 1):
                    kv[i].flatten(0, 1)[slots] = self.loaded_kv(chunk[i])
            loaded = end
        self.counts["retrieved_tokens"] += loaded
        return loaded

    def _prefix_keys(self, token_ids: Sequence[int]) -> list[tuple[int, ...]]:
        return [tuple(token_ids[:e]) for _, e in self._spans(token_ids, len(token_ids))]

    def evict(
        self,
        *,
        token_ids: Sequence[int] | None = None,
        chunk_hashes: Sequence[int] | None = None,
        locations: Sequence[str] | None = None,
    ) -> int:
        keys = self._prefix_keys(token_ids or [])
        return sum(self.chunks.pop(k, None) is not None for k in keys if k not in self.pinned)

    def prefetch(self, token_ids: Sequence[int]) -> int:
        return self.lookup(token_ids)

    def pin(self, token_ids: Sequence[int]) -> int:
        keys = [k for k in self._prefix_keys(token_ids) if k in self.chunks]
        self.pinned.update(keys)
        return len(keys[-1]) if keys else 0

    def unpin(self, token_ids: Sequence[int]) -> int:
        keys = [k for k in self._prefix_keys(token_ids) if k in self.pinned]
        self.pinned.difference_update(keys)
        return len(keys[-1]) if keys else 0

    def memory_stats(self) -> dict[str, object]:
        return {"tiers": {"local_cpu": {"chunks": len(self.chunks)}}, "pinned": len(self.pinned)}

    def metrics(self) -> dict[str, float]:
        return {f"inmem_{k}": v for k, v in self.counts.items()}

    def close(self, deadline_s: float) -> None:
        self.closed_with = deadline_s


class CorruptingOffload(InMemoryOffload):
    """Negative control: loads KV with noise added, as a broken tier would."""

    def loaded_kv(self, layer_kv: torch.Tensor) -> torch.Tensor:
        return layer_kv + 0.5 * torch.randn(
            layer_kv.shape, generator=torch.Generator().manual_seed(0)
        )


class FailingOffload(InMemoryOffload):
    """A tier that claims hits but fails every retrieve."""

    def retrieve(self, *args: Any, **kwargs: Any) -> int:
        raise ConnectionError("remote tier went away")


Logits = dict[tuple[str, int], torch.Tensor]


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 8192) for _ in range(n)]


async def started(offload: InMemoryOffload | None, logits: Logits) -> ReferenceEngine:
    def observe(rid: str, index: int, row: torch.Tensor) -> None:
        logits[(rid, index)] = row.clone()

    engine = ReferenceEngine(OPTS, offload, logits_observer=observe)
    await engine.start()
    return engine


@pytest.fixture
async def plain() -> AsyncIterator[tuple[ReferenceEngine, Logits]]:
    logits: Logits = {}
    engine = await started(None, logits)
    yield engine, logits
    await engine.shutdown(2.0)


@pytest.fixture
async def cached() -> AsyncIterator[tuple[ReferenceEngine, Logits, InMemoryOffload]]:
    logits: Logits = {}
    offload = InMemoryOffload()
    engine = await started(offload, logits)
    yield engine, logits, offload
    await engine.shutdown(2.0)


async def run(
    engine: ReferenceEngine, rid: str, ids: list[int], n: int = 6
) -> tuple[list[int], int]:
    """Greedy tokens and the number of prompt tokens that came from the offload."""
    req = GenerationRequest(rid, ids, SamplingParams(max_tokens=n, ignore_eos=True))
    events = [ev async for ev in engine.generate(req)]
    return [e.token_id for e in events], events[0].num_cached_tokens


def assert_same_logits(a: Logits, rid_a: str, b: Logits, rid_b: str, n: int) -> None:
    for i in range(n):
        torch.testing.assert_close(a[(rid_a, i)], b[(rid_b, i)], atol=ATOL, rtol=ATOL)


async def test_full_chunk_hit_changes_nothing_but_the_work(plain: Any, cached: Any) -> None:
    p_engine, p_logits = plain
    c_engine, c_logits, offload = cached
    ids = prompt(100, seed=1)
    ref, _ = await run(p_engine, "ref", ids)
    miss, miss_cached = await run(c_engine, "miss", ids)
    await c_engine.flush()
    computed_before = c_engine.metrics()["computed_tokens_total"]
    hit, hit_cached = await run(c_engine, "hit", ids)
    assert (miss_cached, hit_cached) == (0, 96)  # four full 24-token chunks
    assert miss == ref
    assert hit == ref
    assert_same_logits(p_logits, "ref", c_logits, "hit", 6)
    # only the 4-token suffix and the decodes were computed on the hit
    assert c_engine.metrics()["computed_tokens_total"] - computed_before == 4 + 5
    assert offload.counts["retrieved_tokens"] == 96
    assert c_engine.metrics()["cached_prompt_tokens_total"] == 96


@pytest.mark.parametrize(("length", "unfull", "expect_cached"), [(96, False, 95), (100, True, 99)])
async def test_whole_prompt_hit_recomputes_the_last_token(
    plain: Any, length: int, unfull: bool, expect_cached: int
) -> None:
    p_engine, p_logits = plain
    logits: Logits = {}
    engine = await started(InMemoryOffload(save_unfull=unfull), logits)
    try:
        ids = prompt(length, seed=2)
        ref, _ = await run(p_engine, "ref", ids)
        await run(engine, "first", ids)
        await engine.flush()
        hit, cached_tokens = await run(engine, "again", ids)
        assert cached_tokens == expect_cached
        assert hit == ref
        assert_same_logits(p_logits, "ref", logits, "again", 6)
    finally:
        await engine.shutdown(2.0)


@pytest.mark.parametrize(
    ("shared", "expect_cached"),
    [(70, 48), (30, 24), (23, 0)],  # 48: block-aligned; 24: mid-block (1.5 blocks); 23: < 1 chunk
)
async def test_partial_prefix_hits(
    plain: Any, cached: Any, shared: int, expect_cached: int
) -> None:
    p_engine, p_logits = plain
    c_engine, c_logits, _ = cached
    first = prompt(120, seed=3)
    second = first[:shared] + prompt(90, seed=4)
    await run(c_engine, "first", first)
    await c_engine.flush()
    ref, _ = await run(p_engine, "ref", second)
    hit, cached_tokens = await run(c_engine, "second", second)
    assert cached_tokens == expect_cached
    assert hit == ref
    assert_same_logits(p_logits, "ref", c_logits, "second", 6)


async def test_random_prompts_and_shared_prefixes(plain: Any, cached: Any) -> None:
    p_engine, _ = plain
    c_engine, _, _ = cached
    rng = random.Random(1234)
    history: list[list[int]] = []
    total_cached = 0
    for case in range(8):
        if history and rng.random() < 0.8:
            base = rng.choice(history)
            ids = base[: rng.randrange(1, len(base) + 1)] + prompt(rng.randrange(0, 60), seed=case)
        else:
            ids = prompt(rng.randrange(1, 200), seed=100 + case)
        history.append(ids)
        ref, _ = await run(p_engine, f"r{case}", ids, n=4)
        got, cached_tokens = await run(c_engine, f"c{case}", ids, n=4)
        assert got == ref, f"case {case}: {len(ids)} tokens, {cached_tokens} cached"
        total_cached += cached_tokens
        await c_engine.flush()
    assert total_cached > 0  # the cases did exercise hits


async def test_concurrent_requests_sharing_a_cached_prefix(plain: Any, cached: Any) -> None:
    p_engine, _ = plain
    c_engine, _, _ = cached
    system = prompt(72, seed=5)
    await run(c_engine, "warm", system + prompt(10, seed=6))
    await c_engine.flush()
    users = [system + prompt(15 + i, seed=10 + i) for i in range(4)]
    got = await asyncio.gather(*(run(c_engine, f"u{i}", u) for i, u in enumerate(users)))
    for i, u in enumerate(users):
        ref, _ = await run(p_engine, f"ref{i}", u)
        assert got[i] == (ref, 72)


async def test_corrupted_kv_would_be_caught(plain: Any) -> None:
    """Negative control: if the loaded KV were wrong, the logits comparison would fail."""
    p_engine, p_logits = plain
    logits: Logits = {}
    engine = await started(CorruptingOffload(), logits)
    try:
        ids = prompt(100, seed=7)
        await run(p_engine, "ref", ids, n=1)
        await run(engine, "first", ids, n=1)
        await engine.flush()
        _, cached_tokens = await run(engine, "bad", ids, n=1)
        assert cached_tokens == 96
        assert (logits[("bad", 0)] - p_logits[("ref", 0)]).abs().max() > 100 * ATOL
    finally:
        await engine.shutdown(2.0)


async def test_failing_tier_is_a_miss_and_requests_are_served(plain: Any) -> None:
    p_engine, _ = plain
    offload = FailingOffload()
    engine = await started(offload, {})
    try:
        ids = prompt(60, seed=8)
        await run(engine, "first", ids)
        await engine.flush()
        ref, _ = await run(p_engine, "ref", ids)
        got, cached_tokens = await run(engine, "again", ids)
        assert (got, cached_tokens) == (ref, 0)
        assert engine.metrics()["offload_errors_total"] == 1
    finally:
        await engine.shutdown(2.0)


async def test_single_token_requests_still_store_their_prompt(cached: Any) -> None:
    """The store deferred past the first token happens by itself once the engine is idle."""
    c_engine, _, offload = cached
    ids = prompt(50, seed=9)
    await run(c_engine, "one", ids, n=1)
    for _ in range(200):
        if offload.lookup(ids):
            break
        await asyncio.sleep(0.01)
    assert offload.lookup(ids) == 48


async def test_memory_api_metrics_and_close_delegate_to_the_offload(cached: Any) -> None:
    c_engine, _, offload = cached
    ids = prompt(80, seed=10)
    await run(c_engine, "m", ids, n=1)
    await c_engine.flush()
    assert await c_engine.prefetch(ids) == 72
    assert await c_engine.pin(ids) == 72
    assert await c_engine.evict(token_ids=ids) == 0  # pinned chunks stay
    assert await c_engine.unpin(ids) == 72
    assert await c_engine.evict(token_ids=ids) == 3
    assert c_engine.memory_stats() == {"tiers": {"local_cpu": {"chunks": 0}}, "pinned": 0}
    metrics = c_engine.metrics()
    assert metrics["inmem_stored_tokens"] == 72
    assert metrics["prompt_tokens_total"] == 80
    await c_engine.shutdown(3.0)
    assert offload.closed_with is not None
    assert 0 < offload.closed_with <= 3.0
