"""SSE pass-through: streamed events per second through a router from many decoding upstreams.

Why this module exists: a pool of decoding instances sends every generated token through the
gateway as one SSE event, so how many events per second one gateway process carries bounds the
pool it can front. The upstreams (``upstream.py --decode``) answer each streamed request with
``events`` one-token events written one at a time, every stream of an upstream taking its turn
between two of its events, as an engine decoding a batch does; ``streams`` clients stream at
once, spread over the upstreams, and read every byte. The rate is events received by the
clients per second of wall time; the same client runs directly against the upstreams (their
ceiling), through our gateway and through sglang-router, interleaved. The router's resident
memory is sampled while the streams run: its peak over the idle figure, per stream in flight,
says whether it holds a stream's events or passes them on.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import loadgen


def rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` and its children (``--workers``), MiB."""
    total = 0
    pids = [pid]
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            pids += [int(p) for p in f.read().split()]
    except OSError:
        pass
    for p in pids:
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


async def _stream(port: int, raw: bytes) -> tuple[int, int]:
    """One streamed request: (events, body bytes) received (events end with a blank line)."""
    conn = await loadgen.Conn.open(port)
    try:
        conn.writer.write(raw)
        await conn.writer.drain()
        head = await conn.reader.readuntil(b"\r\n\r\n")
        if head[9:12] != b"200":
            raise RuntimeError(f"127.0.0.1:{port} answered {head[:12]!r}")
        events = size_total = 0
        last = b""
        while True:
            size = int((await conn.reader.readuntil(b"\r\n")).strip().split(b";")[0], 16)
            data = await conn.reader.readexactly(size + 2)
            if size == 0:
                return events, size_total
            chunk = data[:-2]
            size_total += size
            events += (last + chunk).count(b"\n\n") - last.count(b"\n\n")
            last = chunk[-1:]
    finally:
        conn.close()


async def measure_one(
    urls: list[str], model: str, streams: int, events: int, sample: Callable[[], None]
) -> dict[str, float]:
    """``streams`` streamed chat requests at once over ``urls``: events/s and bytes/s."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": events,
        "stream": True,
    }
    raws = [
        (port, loadgen.encode("/v1/chat/completions", body, port))
        for port in (urlsplit(u).port or 80 for u in urls)
    ]
    stop = asyncio.Event()

    async def sampler() -> None:
        while not stop.is_set():
            sample()
            await asyncio.sleep(0.05)

    task = asyncio.create_task(sampler())
    t0 = time.perf_counter()
    try:
        got = await asyncio.wait_for(
            asyncio.gather(*(_stream(*raws[n % len(raws)]) for n in range(streams))), 300
        )
    finally:
        stop.set()
        await task
    wall = time.perf_counter() - t0
    received = sum(e for e, _ in got)
    return {
        "events_per_s": received / wall,
        "bytes_per_s": sum(b for _, b in got) / wall,
        "events": float(received),
        "wall_s": wall,
    }


async def measure(
    targets: dict[str, list[str]],
    model: str,
    pids: dict[str, int],
    *,
    rounds: int,
    streams: int,
    events: int,
) -> dict[str, dict[str, float]]:
    """Per target: best events/s of ``rounds`` interleaved runs, and for a router with a pid
    its resident memory idle and at peak (MiB) and the peak's excess per stream (KiB)."""
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in targets}
    peak: dict[str, float] = {}
    idle = {n: rss_mb(pid) for n, pid in pids.items()}
    for urls in targets.values():  # warm-up: connections, first-request paths
        await measure_one(urls, model, 4, 8, lambda: None)
    for _ in range(rounds):
        for name, urls in targets.items():
            pid = pids.get(name)

            def sample(name: str = name, pid: int | None = pid) -> None:
                if pid is not None:
                    peak[name] = max(peak.get(name, 0.0), rss_mb(pid))

            runs[name].append(await measure_one(urls, model, streams, events, sample))
    out: dict[str, dict[str, float]] = {}
    for name, rs in runs.items():
        best = max(rs, key=lambda r: r["events_per_s"])
        out[name] = {
            "events_per_s": best["events_per_s"],
            "events_per_s_median": statistics.median(r["events_per_s"] for r in rs),
            "bytes_per_s": best["bytes_per_s"],
            "events_per_run": best["events"],
        }
        if name in pids:
            out[name]["rss_idle_mb"] = idle[name]
            out[name]["rss_peak_mb"] = peak.get(name, idle[name])
            excess = max(0.0, peak.get(name, idle[name]) - idle[name])
            out[name]["rss_kib_per_stream"] = excess * 1024 / streams
    return out


def run(
    targets: dict[str, list[str]], model: str, pids: dict[str, int], quick: bool
) -> dict[str, dict[str, float]]:
    return asyncio.run(
        measure(
            targets,
            model,
            pids,
            rounds=2 if quick else 4,
            streams=64 if quick else 128,
            events=128 if quick else 256,
        )
    )


if __name__ == "__main__":  # python sse.py URL[,URL...] MODEL: a quick look at one target
    import sys

    print(json.dumps(run({"target": sys.argv[1].split(",")}, sys.argv[2], {}, True), indent=2))
