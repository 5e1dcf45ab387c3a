"""How much load one ``kvpool-gateway replay`` process can offer: requests/s and SSE events/s
against an instant upstream.

Why this module exists: a load generator that saturates before the system under test measures
itself. This runs the replay's own parts (``replay_plan`` prompts and jobs, ``loadgen``'s client
and SSE reader) in this process against ``upstream.py`` (an instant OpenAI-shaped server, in its
own process) with every request due at once, so the client sends as fast as it can:

1. ``requests``: one-block prompts (64 tokens), one output token: the per-request cost;
2. ``events``: one-block prompts, 256 output tokens each streamed as 256 SSE events: the
   per-event cost;
3. ``mooncake``: the first requests of the Mooncake trace (prompts of ~12K tokens built from
   their hash ids, as text), one output token: the cost of building and sending real prompts.

For each: requests/s, SSE events/s, the client's CPU time over wall time (near 1.0: the client
is the bottleneck; below, the upstream or the box's other load is) and its CPU time per request
and per event, whose inverse is what one client process on a core of its own would sustain.
Prints a Markdown table; ``--out`` writes JSON.

    python gateway/bench/replay_capacity.py [--requests 4000] [--out bench-results/replay.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from kvpool.gateway.loadgen import Endpoint, Replay
from kvpool.gateway.prompts import local_tokenizer
from kvpool.gateway.replay_plan import load_trace, make_jobs, prompt_builder
from kvpool.gateway.traces import Window

HERE = Path(__file__).resolve().parent
MOONCAKE = HERE.parents[2] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def upstream(max_events: int) -> Iterator[str]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "upstream.py"), "--ports", str(port),
         "--max-events", str(max_events)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "READY":
            raise RuntimeError("upstream.py did not start")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def synthetic(path: Path, n: int, input_length: int, output_length: int) -> None:
    """``n`` Mooncake rows, all at time 0, each its own block."""
    with path.open("w") as fp:
        for i in range(n):
            row = {"timestamp": 0, "input_length": input_length,
                   "output_length": output_length, "hash_ids": [i]}  # fmt: skip
            fp.write(json.dumps(row) + "\n")


def measure(
    trace: str, count: int, block: int, max_events: int, concurrency: int
) -> dict[str, float]:
    loaded = load_trace(trace, "mooncake", Window(count=count))
    builder = prompt_builder(loaded, local_tokenizer("reference"), block)
    with upstream(max_events) as url:
        jobs = make_jobs(loaded, builder, "kvpool/reference-tiny", time_scale=1e9)
        rep = Replay(Endpoint(url, concurrency=concurrency, timeout_s=60), jobs)
        cpu0, t0 = time.process_time(), time.perf_counter()
        run = asyncio.run(rep.run())
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    ok = sum(1 for o in run.outcomes if o.ok)
    if ok != len(jobs):
        errors = {o.error for o in run.outcomes if not o.ok}
        raise RuntimeError(f"{len(jobs) - ok} of {len(jobs)} requests failed: {errors}")
    events = sum(o.events for o in run.outcomes)
    return {"requests": float(len(jobs)), "wall_s": wall, "req_per_s": len(jobs) / wall,
            "events_per_s": events / wall, "client_cpu_share": cpu / wall,
            "client_cpu_us_per_request": cpu / len(jobs) * 1e6,
            "client_cpu_us_per_event": cpu / max(events, 1) * 1e6}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--requests", type=int, default=4000, help="requests per scenario (4000)")
    ap.add_argument("--concurrency", type=int, default=64, help="requests in flight (64)")
    ap.add_argument("--out", help="JSON result path")
    args = ap.parse_args()
    n = args.requests
    out: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        short, long_ = Path(tmp) / "short.jsonl", Path(tmp) / "events.jsonl"
        synthetic(short, n, 64, 1)
        synthetic(long_, max(1, n // 8), 64, 256)
        out["requests"] = measure(str(short), n, 64, 1, args.concurrency)
        out["events"] = measure(str(long_), n, 64, 256, args.concurrency)
        if MOONCAKE.is_file():
            out["mooncake"] = measure(str(MOONCAKE), max(1, n // 4), 512, 1, args.concurrency)
    print("| scenario | requests | req/s | SSE events/s | client CPU / wall "
          "| client CPU per request (µs) | per event (µs) |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, m in out.items():
        cells = [f"{m['requests']:.0f}", f"{m['req_per_s']:,.0f}", f"{m['events_per_s']:,.0f}",
                 f"{m['client_cpu_share']:.2f}", f"{m['client_cpu_us_per_request']:,.0f}",
                 f"{m['client_cpu_us_per_event']:.1f}"]  # fmt: skip
        print(f"| {name} | {' | '.join(cells)} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
