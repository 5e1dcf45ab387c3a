"""Micro-benchmark of the controller's chunk index against LMCache 0.5.6's own index.

Why: the gateway asks for a prompt's longest cached prefix on every request and workers stream
admit/evict events all the time, so the index's lookup latency, ingest rate and memory are the
controller's hot path. The peer is LMCache's real ``RegistryTree`` (lmcache/v1/cache_controller/
utils.py) driven in-process, without sockets, exactly as its ``KVController`` drives it:
``handle_batched_kv_operations`` for ingest, a ``find_kv`` per chunk until the first miss for
``lookup`` and ``find_kv_with_worker_info`` + a consecutive count for ``batched_p2p_lookup``.

Workload (deterministic, seeded): 64 instances (the last 16 with TP=2), 512-chunk prompts that
start with one of 16 shared 32-chunk system prompts, each prompt held by 1-3 instances in
``LocalCPUBackend`` and half of them also in ``LocalDiskBackend``; events arrive as LMCache's
batches of 50 from interleaved workers. Queries: 50 % prompts held in full, 30 % held prefix +
novel suffix, 20 % system prompt + novel suffix.

The two P2P lookups answer different questions: LMCache's takes the first other instance that
holds the first chunk and counts its consecutive hits (often a short shared system prompt);
ours scans for the longest prefix per same-rank peer. ``index_p2p_mean_hit_chunks`` reports
what the best returned peer is worth, so the latency ratio is read next to it.

Metric keys: ours unprefixed (``index_`` where the controller's service benchmark has a
metric of the same name), LMCache's prefixed ``lmcache_``.

Each side runs in its own subprocess so its RSS growth is its own memory (LMCache's side also
holds its last window of wire bytes, a few MB). Ingest is timed from the msgpack wire bytes of
``BatchedKVOperationMsg`` (both sides decode the same bytes with msgspec), and for ours also
from ready key lists (the index alone). Times are this thread's CPU time (the shared 2-core box
often runs more processes than cores, and wall time then counts time spent descheduled); the
wall-clock figures are reported too, as ``*_wall_*``.
"""

from __future__ import annotations

import gc
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

CPU, DISK = "LocalCPUBackend", "LocalDiskBackend"
BATCH = 50  # LMCache's BatchedMessageSender flushes every 50 ops (or 10 ms)
WIRE_WINDOW = 2000  # batches encoded ahead of a timed window (bounds the wire bytes held)


@dataclass
class Params:
    chunk_locations: int
    instances: int = 64
    tp2_instances: int = 16
    prompt_chunks: int = 512
    sys_prompts: int = 16
    sys_chunks: int = 32
    queries: int = 2000
    peer_queries: int = 300
    seed: int = 7


@dataclass
class Workload:
    keys: NDArray[np.int64]  # every admitted key, segment after segment
    batches: list[tuple[str, int, str, int, int, int]]  # instance, worker, location, lo, hi, seq
    prompts: NDArray[np.int64]  # (n_prompts, prompt_chunks) stored prompts
    holders: list[list[int]]
    queries: list[list[int]]
    p2p: list[tuple[list[int], str, int]]  # hashes, requester, worker id


def _rand(rng: np.random.Generator, shape: Any) -> NDArray[np.int64]:
    out: NDArray[np.int64] = rng.integers(
        -(2**63), 2**63 - 1, size=shape, dtype=np.int64, endpoint=True
    )
    return out


def make_workload(p: Params) -> Workload:
    rng = np.random.default_rng(p.seed)
    sys_hashes = _rand(rng, (p.sys_prompts, p.sys_chunks))
    tp = [2 if i >= p.instances - p.tp2_instances else 1 for i in range(p.instances)]
    segments: list[NDArray[np.int64]] = []
    idents: list[tuple[str, int, str]] = []
    prompts: list[NDArray[np.int64]] = []
    holders: list[list[int]] = []
    seen: set[tuple[int, int, str, int]] = set()
    total = 0
    while total < p.chunk_locations:
        s = len(prompts) % p.sys_prompts
        prompt = np.concatenate([sys_hashes[s], _rand(rng, p.prompt_chunks - p.sys_chunks)])
        held = sorted(
            int(i)
            for i in rng.choice(
                p.instances, size=rng.choice([1, 2, 3], p=[0.5, 0.3, 0.2]), replace=False
            )
        )
        tiers = (CPU, DISK) if rng.random() < 0.5 else (CPU,)
        for inst in held:
            for wid in range(tp[inst]):
                for loc in tiers:
                    fresh = (inst, wid, loc, s) not in seen
                    seen.add((inst, wid, loc, s))
                    seg = prompt if fresh else prompt[p.sys_chunks :]
                    segments.append(seg)
                    idents.append((f"inst-{inst:02d}", wid, loc))
                    total += len(seg)
        prompts.append(prompt)
        holders.append(held)
    keys = np.concatenate(segments)
    order: list[tuple[int, int, int]] = []  # (segment, lo, hi) in keys
    pos = 0
    for n, seg in enumerate(segments):
        for lo in range(0, len(seg), BATCH):
            order.append((n, pos + lo, pos + min(lo + BATCH, len(seg))))
        pos += len(seg)
    rng.shuffle(order)
    seq: dict[tuple[str, int, str], int] = {}
    batches = []
    for n, lo, hi in order:
        ident = idents[n]
        s0 = seq.get(ident, 0)
        seq[ident] = s0 + hi - lo
        batches.append((*ident, lo, hi, s0))
    stored = np.stack(prompts)
    queries: list[list[int]] = []
    for q in range(p.queries):
        kind = q % 10
        base = stored[rng.integers(len(stored))]
        if kind < 5:
            hashes = base
        elif kind < 8:
            k = int(rng.integers(p.sys_chunks, p.prompt_chunks))
            hashes = np.concatenate([base[:k], _rand(rng, p.prompt_chunks - k)])
        else:
            hashes = np.concatenate(
                [base[: p.sys_chunks], _rand(rng, p.prompt_chunks - p.sys_chunks)]
            )
        queries.append(hashes.tolist())
    p2p = []
    for _ in range(p.queries):
        n = int(rng.integers(len(stored)))
        requester = int(rng.integers(p.instances))
        p2p.append((stored[n].tolist(), f"inst-{requester:02d}", int(rng.integers(tp[requester]))))
    return Workload(keys, batches, stored, holders, queries, p2p)


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class Stopwatch:
    """Accumulates this thread's CPU time and wall time over the ``with`` blocks it times.

    The box is shared and often has more runnable processes than cores: wall time then counts
    time slices spent descheduled, CPU time counts only the work done (cache misses included).
    """

    def __init__(self) -> None:
        self.cpu = 0.0
        self.wall = 0.0
        self._cpu0 = self._wall0 = 0.0

    def __enter__(self) -> Stopwatch:
        self._cpu0, self._wall0 = time.thread_time(), time.perf_counter()
        return self

    def __exit__(self, *_: object) -> None:
        self.cpu += time.thread_time() - self._cpu0
        self.wall += time.perf_counter() - self._wall0


def _pcts(name: str, samples_ns: list[int]) -> dict[str, float]:
    ms = sorted(x / 1e6 for x in samples_ns)
    return {
        f"{name}_p50_ms": statistics.median(ms),
        f"{name}_p99_ms": ms[min(len(ms) - 1, int(len(ms) * 0.99))],
        f"{name}_mean_ms": statistics.fmean(ms),
    }


def _time_each(
    name: str, call: Callable[..., object], argsets: Sequence[tuple[Any, ...]]
) -> dict[str, float]:
    """Per-call latency percentiles: CPU time as ``name``, wall time as ``name_wall``."""
    cpu, wall = [], []
    for args in argsets:
        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        call(*args)
        wall.append(time.perf_counter_ns() - w0)
        cpu.append(time.thread_time_ns() - c0)
    return _pcts(name, cpu) | _pcts(f"{name}_wall", wall)


def _query_metrics(
    lookup: Callable[[list[int]], object],
    p2p: Callable[[list[int], str, int], object],
    queries: list[list[int]],
    p2p_queries: list[tuple[list[int], str, int]],
) -> dict[str, float]:
    """Latency of the same prefix lookups (all, and prompts held in full) and P2P lookups."""
    asked = [(q,) for q in queries]
    out = _time_each("lookup", lookup, asked)
    out |= _time_each("lookup_full_hit", lookup, asked[::10])  # every 10th: a prompt held in full
    out |= _time_each("index_p2p_lookup", p2p, p2p_queries)
    # what the answers are worth: chunks the best peer returned would let the requester skip
    out["index_p2p_mean_hit_chunks"] = statistics.fmean(_best_hit(p2p(*q)) for q in p2p_queries)
    return out


def _best_hit(answer: object) -> int:
    """Hit chunks of the best peer in a P2P answer (ours: a list of rows; LMCache's: one row)."""
    rows: list[Any] = answer if isinstance(answer, list) else [answer]
    return max((int(row[2]) for row in rows), default=0)


def _wire_windows(w: Workload) -> Iterator[list[bytes]]:
    """The batches as LMCache's msgpack wire bytes, a window at a time (encoding untimed)."""
    import msgspec
    from lmcache.v1.cache_controller.message import BatchedKVOperationMsg, KVOpEvent, OpType

    enc = msgspec.msgpack.Encoder()
    for start in range(0, len(w.batches), WIRE_WINDOW):
        window = []
        for inst, wid, loc, lo, hi, s0 in w.batches[start : start + WIRE_WINDOW]:
            ops = [KVOpEvent(OpType.ADMIT, k, s0 + i) for i, k in enumerate(w.keys[lo:hi].tolist())]
            window.append(enc.encode(BatchedKVOperationMsg(inst, wid, loc, ops)))
        yield window


def _wire_ingest(w: Workload, apply: Callable[[Any], object]) -> dict[str, float]:
    """Decode every batch from LMCache's wire bytes and apply it; events per second."""
    import msgspec
    from lmcache.v1.cache_controller.message import BatchedKVOperationMsg

    dec = msgspec.msgpack.Decoder(BatchedKVOperationMsg)
    clock, events = Stopwatch(), 0
    for window in _wire_windows(w):
        with clock:
            for raw in window:
                msg = dec.decode(raw)
                apply(msg)
                events += len(msg.operations)
    return {
        "ingest_wire_events_per_s": events / clock.cpu,
        "ingest_wire_wall_events_per_s": events / clock.wall,
    }


def side_ours(p: Params) -> dict[str, float]:
    from kvpool.protocol.index import ChunkIndex

    w = make_workload(p)
    gc.collect()
    rss0 = _rss()
    ix = ChunkIndex()
    admit = ix.admit
    keys = w.keys
    with Stopwatch() as ingest:
        for inst, wid, loc, lo, hi, _ in w.batches:
            admit(inst, wid, loc, keys[lo:hi].tolist())
    gc.collect()
    out: dict[str, float] = {
        "chunk_locations": len(ix),
        "chunks": ix.stats()["chunks"],
        "ingest_events_per_s": len(w.keys) / ingest.cpu,
        "ingest_wall_events_per_s": len(w.keys) / ingest.wall,
        "bytes_per_chunk_location": (_rss() - rss0) / len(ix),
    }
    out |= _query_metrics(ix.prefix_hits, ix.p2p_lookup, w.queries, w.p2p)
    # evict a twentieth of the admitted batches, batched like the wire
    victims = w.batches[: len(w.batches) // 20]
    with Stopwatch() as evict:
        for inst, wid, loc, lo, hi, _ in victims:
            ix.evict(inst, wid, loc, keys[lo:hi].tolist())
    out["evict_events_per_s"] = sum(b[4] - b[3] for b in victims) / evict.cpu
    worker_keys = len(ix.worker_keys("inst-63", 1, CPU)) + len(ix.worker_keys("inst-63", 1, DISK))
    with Stopwatch() as purge:
        purged = ix.remove_worker("inst-63", 1)
    out["remove_worker_ms"] = purge.cpu * 1e3
    out["remove_worker_chunk_locations"] = purged
    assert purged == worker_keys
    # the purged worker's keys leave the shared masks later, in bounded steps: the same
    # per-key work the purge used to do inline, timed here in one go
    with Stopwatch() as sweep:
        ix.sweep()
    out["remove_worker_sweep_ms"] = sweep.cpu * 1e3
    del ix
    gc.collect()
    fresh = ChunkIndex()

    def apply(msg: Any) -> None:
        fresh.admit(msg.instance_id, msg.worker_id, msg.location, [op.key for op in msg.operations])

    return out | _wire_ingest(w, apply)


def side_lmcache(p: Params) -> dict[str, float]:
    from lmcache.v1.cache_controller.utils import RegistryTree

    w = make_workload(p)
    gc.collect()
    rss0 = _rss()
    tree = RegistryTree()
    for inst in range(p.instances):
        for wid in range(2 if inst >= p.instances - p.tp2_instances else 1):
            tree.register_worker(
                f"inst-{inst:02d}", wid, "127.0.0.1", 0, f"tcp://127.0.0.1:{inst}", None, 0.0
            )
    out = _wire_ingest(w, tree.handle_batched_kv_operations)
    gc.collect()
    total = tree.get_total_kv_count()
    out |= {"chunk_locations": total, "bytes_per_chunk_location": (_rss() - rss0) / total}

    def lookup(hashes: list[int]) -> dict[str, tuple[str, int]]:
        # KVController.lookup's loop, minus its tokenisation (we hand it the chunk hashes)
        layout: dict[str, tuple[str, int]] = {}
        for n, key in enumerate(hashes):
            found = tree.find_kv(key)
            if found is None:
                break
            layout[found.instance_id] = (found.location, n + 1)
        return layout

    def p2p(hashes: list[int], requester: str, _wid: int) -> tuple[str, str, int, str]:
        # KVController.batched_p2p_lookup (upstream ignores the worker id)
        found = tree.find_kv_with_worker_info(hashes[0], exclude_instance_id=requester)
        if found is None or found[1] is None:
            return ("", "", 0, "")
        info, url, held = found
        n = 0
        for key in hashes:
            if key not in held:
                break
            n += 1
        return (info.instance_id, info.location, n, url)

    out |= _query_metrics(lookup, p2p, w.queries[: p.peer_queries], w.p2p[: p.peer_queries])
    node = tree.get_worker("inst-63", 1)
    held = 0 if node is None else node.get_kv_count()
    del node
    with Stopwatch() as purge:
        tree.deregister_worker("inst-63", 1)  # the dropped node frees its key sets right here
    out["remove_worker_ms"] = purge.cpu * 1e3
    out["remove_worker_chunk_locations"] = held
    return out


SIDES = {"ours": side_ours, "lmcache": side_lmcache}


def _in_subprocess(side: str, p: Params) -> dict[str, float]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--side", side, json.dumps(p.__dict__)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"index bench side {side!r} failed:\n{done.stderr[-3000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def run(quick: bool) -> dict[str, Any]:
    """Run both sides (each in its own process) and compare them."""
    p = (
        Params(chunk_locations=300_000, queries=500, peer_queries=100)
        if quick
        else Params(10_000_000)
    )
    print(
        f"index bench: {p.chunk_locations:,} chunk-locations, {p.instances} instances",
        file=sys.stderr,
    )
    ours = _in_subprocess("ours", p)
    print("index bench: ours done, running LMCache's RegistryTree", file=sys.stderr)
    peer = _in_subprocess("lmcache", p)
    ratios = {
        "lookup_speedup_vs_lmcache": peer["lookup_p50_ms"] / ours["lookup_p50_ms"],
        "lookup_p99_speedup_vs_lmcache": peer["lookup_p99_ms"] / ours["lookup_p99_ms"],
        "index_p2p_lookup_speedup_vs_lmcache": peer["index_p2p_lookup_p50_ms"]
        / ours["index_p2p_lookup_p50_ms"],
        "ingest_wire_vs_lmcache": ours["ingest_wire_events_per_s"]
        / peer["ingest_wire_events_per_s"],
        "memory_vs_lmcache": ours["bytes_per_chunk_location"] / peer["bytes_per_chunk_location"],
        # time per purged chunk-location, kvpool / LMCache: <= 1 is "no slower than LMCache's"
        "remove_worker_time_vs_lmcache": (
            ours["remove_worker_ms"] / ours["remove_worker_chunk_locations"]
        )
        / (peer["remove_worker_ms"] / peer["remove_worker_chunk_locations"]),
    }
    metrics = dict(ours) | {f"lmcache_{k}": v for k, v in peer.items()}
    rows = [
        ("lookup p50 (ms)", "lookup_p50_ms"),
        ("lookup p99 (ms)", "lookup_p99_ms"),
        ("lookup, prompt held in full, p99 (ms)", "lookup_full_hit_p99_ms"),
        ("p2p lookup p50 (ms)", "index_p2p_lookup_p50_ms"),
        ("p2p lookup p99 (ms)", "index_p2p_lookup_p99_ms"),
        ("p2p: chunks the best peer returned, mean", "index_p2p_mean_hit_chunks"),
        ("lookup p99, wall clock (ms)", "lookup_wall_p99_ms"),
        ("ingest from wire bytes (events/s)", "ingest_wire_events_per_s"),
        ("bytes per chunk-location (RSS)", "bytes_per_chunk_location"),
    ]
    lines = [
        f"Index: {int(ours['chunk_locations']):,} chunk-locations, {p.instances} instances, "
        f"{p.prompt_chunks}-chunk prompts{' (quick)' if quick else ''}; "
        "times are CPU time of the calling thread unless marked wall clock",
        "",
        "| metric | kvpool | LMCache 0.5.6 RegistryTree |",
        "|---|---:|---:|",
    ]
    lines += [f"| {label} | {ours[key]:,.4g} | {peer[key]:,.4g} |" for label, key in rows]
    lines += [
        f"| ingest, index alone (events/s) | {ours['ingest_events_per_s']:,.4g} | - |",
        f"| evict (events/s) | {ours['evict_events_per_s']:,.4g} | - |",
        "| remove_worker (ms, chunk-locations purged) | "
        + " | ".join(
            f"{side['remove_worker_ms']:,.4g} ({int(side['remove_worker_chunk_locations']):,})"
            for side in (ours, peer)
        )
        + " |",
        "| remove_worker: deferred sweep of its keys from the shared masks (ms) | "
        f"{ours['remove_worker_sweep_ms']:,.4g} | - |",
    ]
    return {
        "metrics": metrics,
        "ratios": ratios,
        "peers": {"lmcache": version("lmcache")},
        "markdown": "\n".join(lines),
    }


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--side":
        print(json.dumps(SIDES[sys.argv[2]](Params(**json.loads(sys.argv[3])))))
    else:
        result = run(quick="--quick" in sys.argv)
        print(result["markdown"])
        print(json.dumps({k: result[k] for k in ("metrics", "ratios", "peers")}, indent=1))
