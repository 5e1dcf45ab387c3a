"""TTFT helpers for the worker benchmark: time-to-first-token of the reference engine, on a
miss and on a KV hit, as the engine itself measures it (request admitted → first token
sampled).

Why this module exists: ``bench/run.py`` (ttft_hit_over_miss at 1K/4K/8K per tier) needs the
same measurement for every tier; keeping it next to the engine keeps it honest about what is
timed (the prefill and the KV load, not HTTP or tokenization). Run it directly for the
engine alone: ``python worker/bench/engine_bench.py [--lengths 1024,4096]``, or miss vs hit
through LMCache: ``... --lmcache-config lmcache.yaml``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import Sequence

from kvpool.worker.engine import ReferenceEngine
from kvpool.worker.engine_api import GenerationRequest, ReferenceEngineOptions, SamplingParams

_counter = 0


def random_prompt(length: int, seed: int, vocab_size: int = 8192) -> list[int]:
    """A prompt no other seed shares a prefix with (first token ids are random)."""
    rng = random.Random(seed)
    return [rng.randrange(3, vocab_size) for _ in range(length)]


async def first_token(engine: ReferenceEngine, prompt: Sequence[int]) -> tuple[float, int]:
    """(TTFT in ms, prompt tokens that came from the offload) of one greedy 1-token request."""
    global _counter  # noqa: PLW0603 (unique request ids across calls)
    _counter += 1
    req = GenerationRequest(
        f"bench-{_counter}", list(prompt), SamplingParams(max_tokens=1, ignore_eos=True)
    )
    async for event in engine.generate(req):
        if event.ttft_s is not None:
            return event.ttft_s * 1000.0, event.num_cached_tokens
    raise RuntimeError("the engine finished without a first token")


async def ttft_ms(engine: ReferenceEngine, prompt_len: int, *, seed: int | None = None) -> float:
    """TTFT (ms) of a fresh prompt of ``prompt_len`` tokens: a miss unless ``seed`` repeats
    a prompt already stored."""
    prompt = random_prompt(prompt_len, seed if seed is not None else random.getrandbits(48))
    ms, _ = await first_token(engine, prompt)
    return ms


async def miss_and_hit_ms(
    engine: ReferenceEngine, prompt_len: int, *, seed: int, repeats: int = 1
) -> dict[str, float]:
    """Miss TTFT of a new prompt, then (after its KV is stored) hit TTFT of the same prompt.
    With ``repeats`` > 1 each is the median over distinct prompts."""
    misses: list[float] = []
    hits: list[float] = []
    cached: list[int] = []
    for r in range(repeats):
        prompt = random_prompt(prompt_len, seed * 1000 + r)
        miss, _ = await first_token(engine, prompt)
        await engine.flush()
        hit, n_cached = await first_token(engine, prompt)
        misses.append(miss)
        hits.append(hit)
        cached.append(n_cached)
    return {
        "miss_ms": _median(misses),
        "hit_ms": _median(hits),
        "hit_over_miss": _median(hits) / _median(misses),
        "cached_tokens": float(min(cached)),
    }


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


async def _main(lengths: list[int], lmcache_config: str | None) -> None:
    options = ReferenceEngineOptions(lmcache_config_file=lmcache_config)
    engine = ReferenceEngine(options)
    began = time.perf_counter()
    await engine.start()
    print(f"engine started in {time.perf_counter() - began:.2f}s", flush=True)
    try:
        await ttft_ms(engine, 64)  # warm-up
        if lmcache_config is None:
            print("| prompt tokens | TTFT (ms, no offload) |\n|---:|---:|")
            for n in lengths:
                print(f"| {n} | {await ttft_ms(engine, n):.0f} |", flush=True)
            return
        print("| prompt tokens | miss TTFT (ms) | hit TTFT (ms) | hit/miss | cached tokens |")
        print("|---:|---:|---:|---:|---:|")
        for n in lengths:
            r = await miss_and_hit_ms(engine, n, seed=n)
            print(
                f"| {n} | {r['miss_ms']:.0f} | {r['hit_ms']:.0f} | {r['hit_over_miss']:.3f} "
                f"| {r['cached_tokens']:.0f} |",
                flush=True,
            )
    finally:
        await engine.shutdown(5.0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,4096,8192")
    parser.add_argument("--lmcache-config", help="LMCache YAML: measure miss and hit TTFT")
    args = parser.parse_args()
    asyncio.run(_main([int(x) for x in args.lengths.split(",")], args.lmcache_config))
