"""Does a calibrated profile predict the reference engine? The same workload on both engines.

Why this module exists: ``kvpool-worker calibrate`` reports how well its fit predicts single
steps; what the sim is for is whole workloads (queueing, continuous batching, mixed prefill and
decode steps). This runs one closed-loop workload at the engine API (no HTTP, no LMCache:
distinct prompts, so neither engine hits) on the reference engine, then on the simulated engine
with the profile at speedup 1, alternately (``--rounds`` sim runs between ``--rounds + 1``
reference runs: the box's load drifts), and writes TTFT and end-to-end percentiles, each
engine's median over its runs with the range, and the sim ÷ reference ratios of the medians as
JSON and a Markdown table. Nothing is asserted.

    python worker/bench/sim_vs_reference.py --profile box.json --out bench-results/sim-vs-reference
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

from kvpool.worker.cli import build_runtime
from kvpool.worker.engine import ReferenceEngine
from kvpool.worker.engine_api import (
    Engine,
    GenerationRequest,
    ReferenceEngineOptions,
    SamplingParams,
)
from kvpool.worker.settings import WorkerSettings


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def workload(
    engine: Engine, lengths: list[int], concurrency: int, max_tokens: int, seed: int
) -> dict[str, Any]:
    """Every prompt once, ``concurrency`` in flight; TTFT and end to end per request (s)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(5, 8192) for _ in range(n)] for n in lengths]
    queue = list(enumerate(prompts))
    ttft: list[float] = []
    e2e: list[float] = []

    async def client() -> None:
        while queue:
            i, ids = queue.pop(0)
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            t0 = time.monotonic()
            first = None
            async for _ in engine.generate(GenerationRequest(f"r{seed}-{i}", ids, params)):
                first = first if first is not None else time.monotonic() - t0
            ttft.append(first or 0.0)
            e2e.append(time.monotonic() - t0)

    started = time.monotonic()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    makespan = time.monotonic() - started
    return {
        "ttft_p50_ms": pct(ttft, 0.5) * 1e3,
        "ttft_p90_ms": pct(ttft, 0.9) * 1e3,
        "e2e_p50_ms": pct(e2e, 0.5) * 1e3,
        "e2e_p90_ms": pct(e2e, 0.9) * 1e3,
        "e2e_mean_ms": statistics.mean(e2e) * 1e3,
        "makespan_s": makespan,
    }


async def run(engine: Engine, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    await engine.start()
    try:
        lengths = [args.lengths[i % len(args.lengths)] for i in range(args.requests)]
        return await workload(engine, lengths, args.concurrency, args.max_tokens, seed)
    finally:
        await engine.shutdown(5.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", required=True, help="a calibrated profile file")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")],
                        default=[256, 1024, 512, 2048])  # fmt: skip
    parser.add_argument("--rounds", type=int, default=2, help="sim runs (reference: one more)")
    parser.add_argument("--out", required=True, help="path prefix of the .json and .md")
    args = parser.parse_args()
    sim_settings = WorkerSettings(engine="sim", sim_profile=args.profile, num_layers=4,
                                  num_kv_heads=2, head_dim=64, port=0)  # fmt: skip
    load0 = os.getloadavg()[0]
    runs: dict[str, list[dict[str, Any]]] = {"reference": [], "sim": []}
    for i in range(2 * args.rounds + 1):  # reference, sim, reference, ..., reference
        if i % 2 == 0:
            engine: Engine = ReferenceEngine(ReferenceEngineOptions())
        else:
            engine = build_runtime(sim_settings, {}).engine
        runs["sim" if i % 2 else "reference"].append(asyncio.run(run(engine, args, i)))
    keys = list(runs["sim"][0])
    med = {e: {k: statistics.median(r[k] for r in rs) for k in keys} for e, rs in runs.items()}
    ratios = {k: med["sim"][k] / med["reference"][k] for k in keys}
    report = {
        "profile": args.profile,
        "workload": {"requests": args.requests, "concurrency": args.concurrency,
                     "max_tokens": args.max_tokens, "lengths": args.lengths},
        "loadavg": {"start": load0, "end": os.getloadavg()[0]},
        "runs": runs, "medians": med, "ratios_sim_over_reference": ratios,
    }  # fmt: skip
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    lines = [
        "| | reference: median (min-max) | sim: median (min-max) | sim ÷ reference |",
        "|---|---:|---:|---:|",
    ]
    for k in keys:
        cells = []
        for e in ("reference", "sim"):
            xs = [r[k] for r in runs[e]]
            cells.append(f"{med[e][k]:.1f} ({min(xs):.1f}-{max(xs):.1f})")
        lines.append(f"| {k} | {cells[0]} | {cells[1]} | {ratios[k]:.2f} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
