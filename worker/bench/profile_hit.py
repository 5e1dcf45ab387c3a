"""Where a DDR hit's time to first token goes: the reference engine with LMCache's local CPU
tier, the same prompts hit again and again, each hit split into its phases.

Why this module exists: ``run.py`` says how a hit compares with a cold prefill; this says
why, phase by phase, and is what the flame graphs in the README were recorded from::

    python worker/bench/profile_hit.py --tokens 1024 --hits 300
    py-spy record -o hit.svg -- python worker/bench/profile_hit.py --hits 600

Phases (milliseconds, median and minimum over the hits): ``queue`` (admitted on the event
loop until the compute thread starts the step), ``load`` (LMCache lookup and retrieve into
the paged cache), ``forward`` (the one token the hit recomputes: its logits give the first
new token), ``sample``; ``ttft`` is what the engine reports.
"""

from __future__ import annotations

import os

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_bench
import run

from kvpool.worker.engine import ReferenceEngine
from kvpool.worker.engine import runner as runner_mod
from kvpool.worker.engine.model import PagedModel
from kvpool.worker.engine_api import ReferenceEngineOptions

PHASES = ("queue", "load", "forward", "sample", "ttft")


def _instrument(marks: dict[str, float]) -> None:
    """Time stamps at the phase boundaries (this process only; the product is not changed)."""
    execute, load, forward = (
        runner_mod.ModelRunner.execute,
        runner_mod.ModelRunner._load_prefix,
        PagedModel.forward,
    )

    def timed_execute(self: Any, items: Any) -> Any:
        marks["execute"] = time.monotonic()
        return execute(self, items)

    def timed_load(self: Any, seq: Any) -> Any:
        marks["load0"] = time.monotonic()
        try:
            return load(self, seq)
        finally:
            marks["load1"] = time.monotonic()

    def timed_forward(self: Any, *args: Any) -> Any:
        marks["forward0"] = time.monotonic()
        try:
            return forward(self, *args)
        finally:
            marks["forward1"] = time.monotonic()

    runner_mod.ModelRunner.execute = timed_execute  # type: ignore[method-assign]
    runner_mod.ModelRunner._load_prefix = timed_load  # type: ignore[method-assign]
    PagedModel.forward = timed_forward  # type: ignore[method-assign]


async def profile(tokens: int, hits: int) -> dict[str, tuple[float, float]]:
    marks: dict[str, float] = {}
    _instrument(marks)
    opts = ReferenceEngineOptions(num_kv_blocks=max(tokens // 16 + 256, 2048))
    config = {"chunk_size": run.CHUNK, "max_local_cpu_size": 1.0, "local_cpu": True}
    engine = ReferenceEngine(opts, run.make_offload(config, opts, "profile-hit"))
    await engine.start()
    rows: list[tuple[float, ...]] = []
    apply = engine._apply

    def timed_apply(out: Any) -> None:
        if out.seq.first_token_at is None:
            m, arrival = marks, out.seq.arrival
            rows.append(
                (
                    m["execute"] - arrival,
                    m["load1"] - m["load0"],
                    m["forward1"] - m["forward0"],
                    out.sampled_at - m["forward1"],
                    out.sampled_at - arrival,
                )
            )
        apply(out)

    try:
        prompts = [engine_bench.random_prompt(tokens, seed=100 + i) for i in range(8)]
        cold = [(await engine_bench.first_token(engine, p))[0] for p in prompts]
        await engine.flush()
        engine._apply = timed_apply  # type: ignore[method-assign]
        for i in range(hits):
            await engine_bench.first_token(engine, prompts[i % len(prompts)])
    finally:
        await engine.shutdown(10.0)
    out = {
        name: (statistics.median(r[j] for r in rows) * 1e3, min(r[j] for r in rows) * 1e3)
        for j, name in enumerate(PHASES)
    }
    out["cold_ttft"] = (statistics.median(cold), min(cold))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hits", type=int, default=300)
    args = parser.parse_args()
    result = asyncio.run(profile(args.tokens, args.hits))
    print(f"DDR hit of {args.tokens} tokens, {args.hits} hits, load {os.getloadavg()[0]:.1f}")
    print("| phase | median ms | min ms |\n|---|---:|---:|")
    for name, (med, low) in result.items():
        print(f"| {name} | {med:.2f} | {low:.2f} |")


if __name__ == "__main__":
    main()
