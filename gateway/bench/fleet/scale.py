"""Our own parts at fleet scale (issue 14 part 5), measured with the simulated fleet and real
processes: the controller under the admit/evict load of 1000 instances replaying the trace, the
memory of the index and of the gateway's replica per 10M chunk-locations, and the gateway's
routing decision at 1000 instances.

Why this module exists: nothing else ran the controller or the gateway's routing with more than
a handful of instances. The fleet simulator (:mod:`kvpool.gateway.fleetsim`) tells, in virtual
time, which LMCache admit and evict batches a thousand instances send while serving the trace;
here those batches are replayed over sockets into a real ``kvpool-controller`` process, as
LMCache workers send them, and the index it ends with is compared, key by key, with the
instances' tiers.

How (``measure_scale(quick, logdir)``; ``python gateway/bench/fleet/scale.py [--quick]``):

1. **Simulate and record.** The fleet simulator replays the trace (the whole trace; ``--quick``:
   its first requests) on ``instances`` sim engines, the trace's clock compressed ``time_scale``
   times (the fleet is sized for far more than the trace's 3.4 requests/s: at the trace's own pace
   a few dozen instances serve every request, and a thousand instances see no load). An
   :class:`~kvpool.gateway.fleetsim.fleet.Observer` records each instance's LMCache events and
   batches them exactly as LMCache's ``BatchedMessageSender`` does (per location: a batch leaves
   10 ms after its first event, or at once with 50 queued; numbered per (worker, location) from
   0). The recorded events applied in order must give the engines' final DDR and disk tiers
   (checked).
2. **Controller.** For each mode, a fresh ``kvpool-controller`` (127.0.0.1, free ports,
   ``--fingerprint``, delta stream and snapshot sockets on, as the operator renders it); a
   replica process (the gateway's ``IndexClient``) follows its delta stream; ``senders``
   processes register the instances (``RegisterMsg``, ids ``name~fingerprint``) and push the
   recorded batches (``paced``: on their model times, i.e. the trace's pace compressed
   ``time_scale`` times; ``flat``: as fast as the sockets take them), each ending with a
   sentinel; a lookup process issues P2P lookups (``p2p_rate`` per second) and
   ``/v1/prefix_lookup`` calls (``prefix_rate``) and records their latency. Afterwards the
   controller's snapshot and the replica must both equal the union of the engines' tiers.
3. **Memory.** The controller's final index, copied (keys renamed per copy, each instance
   holding its own copies, so sharing between instances and tiers keeps the fleet's shape) to
   ``memory_locations`` chunk-locations, built into a ``ChunkIndex`` in a fresh process (RSS
   growth), snapshotted and encoded as the controller does, then decoded and loaded into an
   ``IndexReplica`` in another fresh process (RSS growth once the decoded snapshot is dropped:
   what the gateway's process keeps). The same again with ``tracemalloc`` (live Python
   allocations, no allocator slack) on ``tracemalloc_locations``, tracing being slow.
4. **Routing.** In process: the gateway's own state (``build_state`` over 1000 instances), its
   ``IndexClient`` in sync with a replica loaded from the controller's final snapshot; each trace
   prompt (its chunk keys) goes through ``IndexClient.lookup``, ``Selector.decide`` and
   ``Selector.admit`` (what ``Selector.attempt`` does), the load tracker fed the simulated first
   tokens and ends so in-flight loads are the fleet's. Timed per request (wall clock).

Metrics (``measure_scale`` returns them; ``markdown`` renders them):

| key | meaning |
|---|---|
| ``controller_events_sent`` | admit/evict events pushed (each run sends them all; |
| | sentinels excluded) |
| ``controller_events_applied`` | events the controller applied in the first run, counted |
| | from its delta stream by the replica process |
| ``controller_events_lost`` | sent − applied, plus chunk-locations where the controller's |
| | or the replica's final index differs from the engines' tiers, both runs (must be 0) |
| ``controller_bad_input`` | the controller's ``bad_input_total`` (seq gaps, stale, unknown |
| | workers...), both runs |
| ``controller_events_per_s`` | flat out: events ÷ (last sentinel applied − start) |
| ``controller_msgs_per_s`` | flat out: ``BatchedKVOperationMsg`` per second, same window |
| ``controller_events_per_s_paced`` | paced: the offered rate (events ÷ replay time) |
| ``controller_paced_late_s`` | paced: how far the senders fell behind their schedule |
| ``controller_paced_drain_s`` | paced: last frame sent → every sentinel applied (the |
| | controller's lag at the end) |
| ``controller_lookup_p50_ms``, ``..._p99_ms`` | paced: every lookup, both kinds pooled |
| ``controller_p2p_lookup_p99_ms`` | paced: P2P lookups (``BatchedP2PLookupMsg``) |
| ``controller_prefix_lookup_p99_ms`` | paced: ``POST /v1/prefix_lookup`` |
| ``controller_lookup_p99_ms_flat`` | flat out: both kinds pooled |
| ``controller_p2p_lookup_inside_ms`` | paced: mean time inside the controller (its histogram) |
| ``controller_prefix_lookup_inside_ms`` | the same for prefix lookups (before the JSON response) |
| ``controller_events_per_cpu_s`` | flat out: events ÷ the controller's CPU seconds (the |
| | lookups it answered meanwhile included) |
| ``controller_lookup_cpu_s_flat`` | flat out: seconds the controller spent inside lookups |
| ``controller_events_per_cpu_s_outside_lookups`` | flat out: events ÷ (CPU − inside lookups) |
| ``controller_lookups_per_s`` | paced: lookups answered per second |
| ``controller_lookup_errors`` | lookups not answered (both runs) |
| ``controller_cpu_s``, ``..._flat`` | controller CPU s (user+system), start to last sentinel |
| ``controller_rss_mb`` | controller resident set at the end of the paced run (MB) |
| ``controller_peak_rss_mb`` | the highest sampled over both runs |
| ``controller_chunk_locations`` | chunk-locations in the final index (DDR + disk) |
| ``controller_instances_with_keys`` | instances holding at least one chunk at the end |
| ``trace_compression`` | the trace's clock ÷ the paced replay's clock |
| ``index_mb_per_10m_locations`` | ChunkIndex: RSS growth of a fresh process, per 10M |
| ``index_bytes_per_location`` | the same, per chunk-location |
| ``index_mb_per_10m_locations_tracemalloc`` | ChunkIndex: live Python allocations |
| ``replica_mb_per_10m_locations`` | IndexReplica loaded from a Snapshot: RSS growth of a |
| | fresh process once the decoded snapshot is dropped, per 10M |
| ``replica_bytes_per_location`` | the same, per chunk-location |
| ``replica_mb_per_10m_locations_tracemalloc`` | IndexReplica: live Python allocations |
| ``memory_locations``, ``memory_chunks`` | chunk-locations built; distinct chunks in them |
| ``snapshot_mb_per_10m_locations`` | the encoded snapshot's size |
| ``snapshot_encode_s_per_10m`` | the controller's snapshot: build + msgpack encode |
| ``snapshot_decode_s_per_10m`` | the gateway: msgpack decode |
| ``snapshot_load_s_per_10m`` | the gateway: ``IndexReplica.load_snapshot`` |
| ``index_build_s_per_10m`` | building the ChunkIndex by admits |
| ``route_p50_ms_1000``, ``route_p99_ms_1000`` | one routing decision over 1000 instances |
| | (target p99 ≤ 1 ms) |
| ``route_cpu_p50_ms_1000``, ``..._p99_...`` | the same in CPU time of the thread (what |
| | the code costs, without the waits for a CPU of a shared box) |
| ``route_hits_p99_ms_1000`` | its part in ``IndexClient.lookup`` |
| ``route_decide_p99_ms_1000`` | its part in ``Selector.decide`` + ``Selector.admit`` |
| ``route_hit_instances_mean`` | instances holding a prefix of the prompt, per decision |
| ``sim_wall_s`` | the simulation's wall time |
| ``box_load_1m_start``, ``..._end`` | the box's 1-minute load average (other work shares it) |
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import heapq
import io
import json
import math
import os
import pstats
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

import httpx
import msgspec
import psutil  # type: ignore[import-untyped]
import zmq

from kvpool.gateway.config import GatewayEnv, parse_config
from kvpool.gateway.fleetsim.fleet import FleetConfig, FleetSim, Observer
from kvpool.gateway.fleetsim.stats import RequestResult
from kvpool.gateway.hitgroups import GroupedHits
from kvpool.gateway.selection import Prompt
from kvpool.gateway.state import build_state
from kvpool.gateway.traces.mooncake import TraceRequest, Window, read_mooncake
from kvpool.protocol import deltas as dl
from kvpool.protocol import lmcache_codec as codec
from kvpool.protocol import lmcache_wire as w
from kvpool.protocol.domain import instance_id
from kvpool.protocol.simcore.kvcache import KvEvent
from kvpool.protocol.simcore.profile import GIB, bundled_profile

HERE = Path(__file__).resolve().parent
WORKERS = HERE / "scale_workers.py"
TRACE = HERE.parents[3] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
PY = sys.executable
ENV = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "PYTHONHASHSEED": "0"}
FINGERPRINT = "5ca1ef1ee700"
PROFILE = "h100-llama-3.1-8b-vllm"
CPU = "LocalCPUBackend"
SENTINEL_BASE = 1 << 62
LMCACHE_BATCH = 50  # kv_msg_batch_size
LMCACHE_BATCH_TIMEOUT_S = 0.01  # kv_msg_batch_timeout
OPS = {"admit": w.OpType.ADMIT, "evict": w.OpType.EVICT}
TEN_M = 10_000_000
PROFILE_DECISIONS = 2000


def log(msg: str) -> None:
    print(f"[fleet scale] {msg}", file=sys.stderr, flush=True)


class PhaseTimeoutError(RuntimeError):
    """A phase ran past its bound; the message names it."""


@dataclass(frozen=True)
class ScaleParams:
    """What one run measures; :meth:`preset` gives the full and the quick run."""

    instances: int = 1000
    requests: int | None = None  # trace requests from the start (None: the whole trace)
    time_scale: float = 100.0  # the simulator's compression of the trace's clock
    ddr_gib: float = 8.0  # LMCache DDR per instance (256 chunks of 32 MiB: Llama-3.1-8B)
    disk_gib: float = 32.0  # LMCache local disk per instance (every stored chunk goes there too)
    senders: int = 3
    replay_speedup: float = 1.0  # the paced replay runs this much faster than model time
    p2p_rate: float = 100.0  # P2P lookups per second (workers ask one per local miss)
    prefix_rate: float = 20.0  # /v1/prefix_lookup per second (a gateway out of sync asks)
    lookup_prompts: int = 2000
    memory_locations: int = TEN_M
    tracemalloc: bool = True
    tracemalloc_locations: int = 2_000_000  # tracing every allocation is slow: a smaller index
    route_requests: int | None = None  # None: every simulated request
    modes: tuple[str, ...] = ("paced", "flat")
    sim_budget_s: float = 900.0
    replay_budget_s: float = 600.0
    memory_budget_s: float = 600.0
    route_budget_s: float = 300.0

    @classmethod
    def preset(cls, quick: bool) -> ScaleParams:
        if quick:
            return cls(
                requests=1200,
                senders=2,
                memory_locations=2_000_000,
                tracemalloc=False,
                sim_budget_s=300.0,
            )
        return cls()


# ---------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Processes:
    """Every child process of a phase; all are stopped on exit (errors and Ctrl-C too)."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.procs: list[subprocess.Popen[bytes]] = []
        self._logs: list[IO[bytes]] = []

    def start(self, name: str, cmd: list[str], *, stdin: bool = False) -> subprocess.Popen[bytes]:
        out = open(self.logdir / f"{name}.log", "ab")  # noqa: SIM115 - closed in stop_all
        self._logs.append(out)
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=out,
            env=ENV,
        )
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        for f in self._logs:
            f.close()
        self.procs.clear()
        self._logs.clear()

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


def wait_line(proc: subprocess.Popen[bytes], expect: str, timeout: float, what: str) -> None:
    """Wait for ``expect`` on the child's stdout (a thread reads, so the wait is bounded)."""
    got: list[bytes] = []

    def read() -> None:
        assert proc.stdout is not None
        got.append(proc.stdout.readline())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    if not got:
        raise PhaseTimeoutError(f"{what}: no {expect} within {timeout:.0f}s")
    if got[0].strip().decode() != expect:
        raise RuntimeError(f"{what} failed (exit {proc.poll()}); see its log")


def wait_exit(proc: subprocess.Popen[bytes], timeout: float, what: str) -> None:
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        raise PhaseTimeoutError(f"{what} did not finish within {timeout:.0f}s") from None
    if rc != 0:
        raise RuntimeError(f"{what} failed with exit status {rc}; see its log")


def worker_cmd(role: str, *args: object) -> list[str]:
    return [PY, str(WORKERS), role, *(str(a) for a in args)]


class Controller:
    """A ``kvpool-controller`` process on free 127.0.0.1 ports, as the operator renders it."""

    def __init__(self, procs: Processes, tag: str) -> None:
        self.ports = {"pull": free_port(), "reply": free_port(), "heartbeat": free_port()}
        self.http = free_port()
        self.pub = free_port()
        self.snapshot_port = free_port()
        cmd = [
            PY, "-m", "kvpool.controller.main", "--host", "127.0.0.1", "--port", str(self.http),
            "--monitor-ports", json.dumps(self.ports), "--fingerprint", FINGERPRINT,
            "--pub-port", str(self.pub), "--snapshot-port", str(self.snapshot_port),
        ]  # fmt: skip
        self.proc = procs.start(f"controller-{tag}", cmd)
        self.ps = psutil.Process(self.proc.pid)
        self.peak_rss = 0

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url("/readyz"), timeout=1).status_code == 200:
                    break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                rc = self.proc.poll()
                raise PhaseTimeoutError(f"controller did not become ready (exit {rc})")
            time.sleep(0.05)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.http}{path}"

    def cpu_s(self) -> float:
        t = self.ps.cpu_times()
        return float(t.user + t.system)

    def rss(self) -> int:
        rss = int(self.ps.memory_info().rss)
        self.peak_rss = max(self.peak_rss, rss)
        return rss

    def snapshot(self) -> tuple[bytes, dl.Snapshot]:
        ctx: zmq.Context[Any] = zmq.Context()
        try:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, 60_000)
            sock.connect(f"tcp://127.0.0.1:{self.snapshot_port}")
            sock.send_multipart([b"", dl.SNAPSHOT_REQUEST])
            frame = sock.recv_multipart()[-1]
        except zmq.Again:
            raise PhaseTimeoutError("the controller sent no snapshot within 60s") from None
        finally:
            ctx.destroy(linger=0)
        return frame, dl.decode_snapshot(frame)

    def metric_sum(self, name: str, label: str | None = None) -> float:
        """Sum of the samples of one metric on /metrics (optionally one label value)."""
        text = httpx.get(self.url("/metrics"), timeout=10).text
        total = 0.0
        for line in text.splitlines():
            metric = line.split("{", 1)[0].split(" ", 1)[0]
            if metric == name and (label is None or label in line):
                total += float(line.rsplit(" ", 1)[1])
        return total


@contextlib.contextmanager
def sampling(ctl: Controller, every_s: float = 0.2) -> Iterator[None]:
    """Sample the controller's RSS in a thread while the block runs."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(every_s):
            with contextlib.suppress(psutil.Error):
                ctl.rss()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(2)


# ---------------------------------------------------------------- simulate and record


@dataclass
class Batch:
    """One BatchedKVOperationMsg of one instance's location, leaving at model time ``t``."""

    t: float
    instance: str
    location: str
    events: list[KvEvent] = field(default_factory=list)


class Recorder(Observer):
    """Batches each instance's LMCache events as LMCache's ``BatchedMessageSender`` does: per
    location, a batch leaves ``timeout_s`` after its first event, or at once when ``batch``
    events are queued (with everything queued by then)."""

    def __init__(self, batch: int = LMCACHE_BATCH, timeout_s: float = LMCACHE_BATCH_TIMEOUT_S):
        self.batch = batch
        self.timeout_s = timeout_s
        self.closed: list[Batch] = []
        self._open: dict[tuple[str, str], Batch] = {}
        self.events = 0

    def indexed(self, now: float, instance: str, events: Sequence[KvEvent]) -> None:
        self.events += len(events)
        for e in events:
            key = (instance, e.location)
            b = self._open.get(key)
            if b is not None and now >= b.t:  # its timer fired before these events
                self.closed.append(self._open.pop(key))
                b = None
            if b is None:
                b = self._open[key] = Batch(now + self.timeout_s, instance, e.location)
            b.events.append(e)
        for key in {(instance, e.location) for e in events}:
            b = self._open[key]
            if len(b.events) >= self.batch:
                b.t = now
                self.closed.append(self._open.pop(key))

    def finish(self) -> list[Batch]:
        """Every batch, in the order they leave (stable: per location in order)."""
        self.closed.extend(self._open.values())
        self._open.clear()
        return sorted(self.closed, key=lambda b: b.t)


@dataclass
class Recorded:
    params: ScaleParams
    requests: list[TraceRequest]
    results: list[RequestResult]
    keys: dict[int, tuple[int, ...]]  # request index -> its chunk keys
    batches: list[Batch]
    expected: dict[tuple[str, str], set[int]]  # (instance id, location) -> keys held at the end
    names: list[str]
    sim_wall_s: float
    events: int

    def iid(self, name: str) -> str:
        return instance_id(name, FINGERPRINT)


def simulate(params: ScaleParams, trace: Path) -> Recorded:
    requests = read_mooncake(trace, Window(count=params.requests))
    cfg = FleetConfig(
        instances=params.instances,
        profile=bundled_profile(PROFILE),
        ddr_bytes=int(params.ddr_gib * GIB),
        disk_bytes=int(params.disk_gib * GIB),
    )
    recorder = Recorder()
    sim = FleetSim(cfg, time_scale=params.time_scale, observer=recorder)
    deadline = time.monotonic() + params.sim_budget_s
    last = [time.monotonic()]

    def progress(done: int, total: int, now: float) -> None:
        if time.monotonic() > deadline:
            raise PhaseTimeoutError(f"the simulation ran past {params.sim_budget_s:.0f}s")
        if time.monotonic() - last[0] > 10:
            last[0] = time.monotonic()
            log(f"  simulated {done}/{total} requests (model time {now:.0f} s)")

    log(
        f"simulating {len(requests)} trace requests on {params.instances} instances "
        f"(trace clock / {params.time_scale:g}, {params.ddr_gib:g} GiB DDR + "
        f"{params.disk_gib:g} GiB disk each)"
    )
    run = sim.run(requests, progress)
    batches = recorder.finish()
    expected: dict[tuple[str, str], set[int]] = {}
    for name, engine in sim.engines.items():
        for tier in (engine.ddr, engine.disk):
            if len(tier):
                expected[(instance_id(name, FINGERPRINT), tier.location)] = set(tier.keys())
    # the recorded events, applied in order, must leave exactly the engines' tiers
    replayed: dict[tuple[str, str], set[int]] = {}
    for b in batches:
        held = replayed.setdefault((instance_id(b.instance, FINGERPRINT), b.location), set())
        for e in b.events:
            if e.op == "admit":
                held.add(e.key)
            else:
                held.discard(e.key)
    replayed = {k: v for k, v in replayed.items() if v}
    if replayed != expected:
        raise RuntimeError("the recorded admit/evict events do not end in the engines' tiers")
    keys = {r.index: sim.keys_of(r) for r in requests}
    log(
        f"  {run.wall_s:.1f}s: {recorder.events:,} events in {len(batches):,} batches, "
        f"{sum(map(len, expected.values())):,} chunk-locations at the end"
    )
    return Recorded(
        params, requests, run.results, keys, batches, expected, cfg.names(), run.wall_s,
        recorder.events,
    )  # fmt: skip


# ---------------------------------------------------------------- controller replay


@dataclass
class SenderSpec:
    path: Path
    events: int
    sentinel: int


def write_specs(rec: Recorded, workdir: Path) -> list[SenderSpec]:
    """Per sender: its instances' registrations, its frames and times, its sentinel."""
    n = rec.params.senders
    owner = {name: i % n for i, name in enumerate(rec.names)}
    seq: dict[tuple[str, str], int] = {}
    first_t = rec.batches[0].t if rec.batches else 0.0
    times: list[list[float]] = [[] for _ in range(n)]
    frames: list[list[bytes]] = [[] for _ in range(n)]
    events = [0] * n
    held_keys: set[int] = set()
    for b in rec.batches:
        iid = rec.iid(b.instance)
        start = seq.get((iid, b.location), 0)
        ops = [w.KVOpEvent(OPS[e.op], e.key, start + j) for j, e in enumerate(b.events)]
        seq[(iid, b.location)] = start + len(ops)
        s = owner[b.instance]
        times[s].append(b.t - first_t)
        frames[s].append(codec.encode(w.BatchedKVOperationMsg(iid, 0, b.location, ops)))
        events[s] += len(ops)
        held_keys.update(e.key for e in b.events)
    specs = []
    for s in range(n):
        mine = [(i, name) for i, name in enumerate(rec.names) if owner[name] == s]
        register = [
            codec.encode(
                w.RegisterMsg(rec.iid(name), 0, "127.0.0.1", 20000 + i, f"127.0.0.1:{40000 + i}")
            )
            for i, name in mine
        ]
        key = SENTINEL_BASE + s
        if key in held_keys:
            raise RuntimeError("a sentinel key collides with a chunk key")
        iid = rec.iid(mine[0][1])
        at = seq.get((iid, CPU), 0)
        admit = w.BatchedKVOperationMsg(iid, 0, CPU, [w.KVOpEvent(w.OpType.ADMIT, key, at)])
        evict = w.BatchedKVOperationMsg(iid, 0, CPU, [w.KVOpEvent(w.OpType.EVICT, key, at + 1)])
        path = workdir / f"sender-{s}.msgpack"
        path.write_bytes(
            msgspec.msgpack.encode(
                {
                    "register": register,
                    "times": times[s],
                    "frames": frames[s],
                    "events": events[s],
                    "sentinel": [iid, key, codec.encode(admit), codec.encode(evict)],
                }
            )
        )
        specs.append(SenderSpec(path, events[s], key))
    return specs


def write_lookup_spec(rec: Recorded, workdir: Path) -> Path:
    chunk = 256
    step = max(1, len(rec.requests) // rec.params.lookup_prompts)
    prompts = [list(rec.keys[r.index][: r.input_length // chunk]) for r in rec.requests[::step]]
    path = workdir / "lookup.msgpack"
    path.write_bytes(
        msgspec.msgpack.encode(
            {"prompts": [p for p in prompts if p], "instances": [rec.iid(n) for n in rec.names]}
        )
    )
    return path


def _as_sets(
    entries: Sequence[tuple[str, int, str, Sequence[int]]],
) -> tuple[dict[Any, set[int]], int]:
    """(instance, location) -> keys of worker 0, and how many keys were listed twice or were
    held by another worker (both are errors here)."""
    out: dict[tuple[str, str], set[int]] = {}
    odd = 0
    for inst, wid, loc, keys in entries:
        if wid != 0:
            odd += len(keys)
            continue
        held = out.setdefault((inst, loc), set())
        before = len(held)
        held.update(keys)
        odd += len(keys) - (len(held) - before)
    return {k: v for k, v in out.items() if v}, odd


def differences(got: dict[Any, set[int]], want: dict[Any, set[int]]) -> int:
    """Chunk-locations in one and not the other."""
    return sum(len(got.get(k, set()) ^ want.get(k, set())) for k in got.keys() | want.keys())


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def replay(
    rec: Recorded,
    specs: list[SenderSpec],
    lookup_spec: Path,
    mode: str,
    logdir: Path,
    workdir: Path,
) -> tuple[dict[str, float], bytes]:
    """One controller run: register, replay ``mode``, look up meanwhile, check the end state."""
    p = rec.params
    budget = p.replay_budget_s
    log(f"controller, {mode} replay: {sum(s.events for s in specs):,} events, {len(specs)} senders")
    with Processes(logdir) as procs:
        # every process starts at once (their sockets connect before the controller binds)
        ctl = Controller(procs, mode)
        target = workdir / f"target-{mode}"
        dump = workdir / f"replica-{mode}.msgpack"
        replica_out = workdir / f"replica-{mode}.json"
        replica = procs.start(
            f"replica-{mode}",
            worker_cmd(
                "replica", "--http", ctl.http, "--pub", ctl.pub, "--snapshot", ctl.snapshot_port,
                "--sentinels", ",".join(str(s.sentinel) for s in specs), "--target-file", target,
                "--timeout", 120, "--dump", dump, "--out", replica_out,
            ),
        )  # fmt: skip
        senders = []
        outs = []
        for i, spec in enumerate(specs):
            out = workdir / f"sender-{mode}-{i}.json"
            outs.append(out)
            cmd = worker_cmd(
                "send", "--spec", spec.path, "--pull", ctl.ports["pull"],
                "--reply", ctl.ports["reply"], "--mode", mode, "--speedup", p.replay_speedup,
                "--timeout", budget, "--out", out,
            )  # fmt: skip
            senders.append(procs.start(f"sender-{mode}-{i}", cmd, stdin=True))
        stop = workdir / f"stop-{mode}"
        lookup_out = workdir / f"lookup-{mode}.json"
        looker = procs.start(
            f"lookup-{mode}",
            worker_cmd(
                "lookup", "--spec", lookup_spec, "--reply", ctl.ports["reply"],
                "--http", ctl.http, "--p2p-rate", p.p2p_rate, "--prefix-rate", p.prefix_rate,
                "--stop-file", stop,
                "--out", lookup_out,
            ),
            stdin=True,
        )  # fmt: skip
        ctl.wait_ready()
        wait_line(replica, "READY", 60, "the replica process")
        for i, proc in enumerate(senders):
            wait_line(proc, "READY", 120, f"sender {i} (registering its instances)")
        wait_line(looker, "READY", 60, "the lookup process")
        registered = ctl.metric_sum("kvpool_controller_workers")
        if registered != p.instances:
            raise RuntimeError(f"{registered:.0f} workers registered, expected {p.instances}")
        start_at = time.time() + 0.3
        for proc in [*senders, looker]:
            assert proc.stdin is not None
            proc.stdin.write(f"{start_at}\n".encode())
            proc.stdin.close()
        time.sleep(max(0.0, start_at - time.time()))
        cpu0 = ctl.cpu_s()
        with sampling(ctl):
            for i, proc in enumerate(senders):
                wait_exit(proc, budget, f"sender {i} ({mode})")
            cpu1 = ctl.cpu_s()
            stop.touch()
            wait_exit(looker, 60, "the lookup process")
        sent = [json.loads(o.read_text()) for o in outs]
        looked = json.loads(lookup_out.read_text())
        frame, snap = ctl.snapshot()
        target.write_text(str(snap.seq))
        wait_exit(replica, 180, "the replica process")
        seen = json.loads(replica_out.read_text())
        got, odd = _as_sets(
            [(e.instance_id, e.worker_id, e.location, e.keys) for e in snap.entries]
        )
        ctl_diff = differences(got, rec.expected) + odd
        rep, rodd = _as_sets(msgspec.msgpack.decode(dump.read_bytes()))
        rep_diff = differences(rep, rec.expected) + rodd
        inside_s = {
            kind: ctl.metric_sum("kvpool_controller_lookup_seconds_sum", f'kind="{kind}"')
            for kind in ("p2p", "prefix")
        }
        inside = {
            kind: total
            / max(1.0, ctl.metric_sum("kvpool_controller_lookup_seconds_count", f'kind="{kind}"'))
            for kind, total in inside_s.items()
        }
        bad = ctl.metric_sum("kvpool_controller_bad_input_total")
        msgs = ctl.metric_sum("kvpool_controller_messages_total", 'type="BatchedKVOperationMsg"')
        rss = ctl.rss()
        events = sum(s["events"] for s in sent)
        t0 = min(s["start_at"] for s in sent)
        wall = max(s["t_done"] for s in sent) - t0
        lat = looked["latency_s"]
        both = lat["p2p"] + lat["http"]
        res = {
            "events_sent": float(events),
            "events_applied": float(seen["events"]),
            "lost": float(events - seen["events"] + ctl_diff + rep_diff),
            "controller_diff": float(ctl_diff),
            "replica_diff": float(rep_diff),
            "replica_gaps": float(seen["gaps"]),
            "bad_input": bad,
            "messages": msgs - 2 * len(specs),  # each sender's sentinel admit and evict
            "events_per_s": events / wall,
            "msgs_per_s": sum(s["messages"] for s in sent) / wall,
            "wall_s": wall,
            "late_s": max(s["max_late_s"] for s in sent),
            "drain_s": max(s["t_done"] for s in sent) - max(s["t_sent"] for s in sent),
            "lookup_p50_ms": _pct(both, 0.5) * 1e3,
            "lookup_p99_ms": _pct(both, 0.99) * 1e3,
            "p2p_lookup_p50_ms": _pct(lat["p2p"], 0.5) * 1e3,
            "p2p_lookup_p99_ms": _pct(lat["p2p"], 0.99) * 1e3,
            "prefix_lookup_p50_ms": _pct(lat["http"], 0.5) * 1e3,
            "prefix_lookup_p99_ms": _pct(lat["http"], 0.99) * 1e3,
            "p2p_lookup_inside_ms": inside["p2p"] * 1e3,
            "prefix_lookup_inside_ms": inside["prefix"] * 1e3,
            "lookups": float(len(both)),
            "lookups_per_s": len(both) / looked["wall_s"],
            "lookup_errors": float(sum(looked["errors"].values())),
            "lookups_found": float(sum(looked["found"].values())),
            "cpu_s": cpu1 - cpu0,
            "lookup_inside_s": sum(inside_s.values()),
            "rss_mb": rss / 1e6,
            "peak_rss_mb": ctl.peak_rss / 1e6,
            "chunk_locations": float(sum(map(len, got.values()))),
            "instances_with_keys": float(len({inst for inst, _ in got})),
        }
    log("  " + ", ".join(f"{k} {v:,.4g}" for k, v in res.items() if k in _REPLAY_SHOWN))
    return res, frame


_REPLAY_SHOWN = (
    "events_sent", "events_applied", "lost", "bad_input", "events_per_s", "wall_s", "late_s",
    "drain_s", "lookup_p50_ms", "lookup_p99_ms", "cpu_s", "lookup_inside_s", "rss_mb",
)  # fmt: skip


# ---------------------------------------------------------------- memory


def memory(state: Path, params: ScaleParams, logdir: Path, workdir: Path) -> dict[str, float]:
    """Index and replica memory per 10M chunk-locations, each in a fresh process."""
    target = params.memory_locations
    deadline = time.monotonic() + params.memory_budget_s
    scaled = workdir / "scaled.snapshot"
    out: dict[str, float] = {}
    modes = ["rss", "tracemalloc"] if params.tracemalloc else ["rss"]
    with Processes(logdir) as procs:
        for mode in modes:
            size = target if mode == "rss" else min(target, params.tracemalloc_locations)
            log(f"memory ({mode}): ChunkIndex of {size:,} chunk-locations in a fresh process")
            res_i = workdir / f"memory-index-{mode}.json"
            proc = procs.start(
                f"memory-index-{mode}",
                worker_cmd(
                    "memory-index", "--mode", mode, "--state", state, "--target", size,
                    "--out", res_i, "--snapshot-out", scaled,
                ),
            )  # fmt: skip
            wait_exit(proc, max(1.0, deadline - time.monotonic()), f"memory-index ({mode})")
            idx = json.loads(res_i.read_text())
            log(f"  {idx}")
            log(f"memory ({mode}): IndexReplica loaded from that snapshot in a fresh process")
            res_r = workdir / f"memory-replica-{mode}.json"
            proc = procs.start(
                f"memory-replica-{mode}",
                worker_cmd(
                    "memory-replica", "--mode", mode, "--snapshot-in", scaled, "--out", res_r
                ),
            )
            wait_exit(proc, max(1.0, deadline - time.monotonic()), f"memory-replica ({mode})")
            rep = json.loads(res_r.read_text())
            log(f"  {rep}")
            per = TEN_M / idx["chunk_locations"]
            rper = TEN_M / rep["chunk_locations"]
            suffix = "" if mode == "rss" else "_tracemalloc"
            out[f"index_mb_per_10m_locations{suffix}"] = idx["bytes"] * per / 1e6
            out[f"replica_mb_per_10m_locations{suffix}"] = rep["bytes"] * rper / 1e6
            if mode == "rss":
                out["index_bytes_per_location"] = idx["bytes"] / idx["chunk_locations"]
                out["replica_bytes_per_location"] = rep["bytes"] / rep["chunk_locations"]
                out["memory_locations"] = float(idx["chunk_locations"])
                out["memory_chunks"] = float(idx["chunks"])
                out["memory_instances"] = float(idx["instances"])
                out["index_build_s_per_10m"] = idx["build_s"] * per
                out["snapshot_mb_per_10m_locations"] = idx["snapshot_bytes"] * per / 1e6
                out["snapshot_encode_s_per_10m"] = (
                    idx["snapshot_build_s"] + idx["snapshot_encode_s"]
                ) * per
                out["snapshot_decode_s_per_10m"] = rep["decode_s"] * rper
                out["snapshot_load_s_per_10m"] = rep["load_s"] * rper
                if not rep["in_sync"] or rep["chunk_locations"] != idx["chunk_locations"]:
                    raise RuntimeError("the replica loaded from the snapshot differs in size")
    with contextlib.suppress(OSError):
        scaled.unlink()
    return out


# ---------------------------------------------------------------- routing


def route_config(names: Sequence[str]) -> dict[str, Any]:
    return {
        "model": "fleet",
        "chunkSize": 256,
        "controllerUrl": "http://127.0.0.1:9",
        "controllerPubUrl": "tcp://127.0.0.1:9",
        "controllerSnapshotUrl": "tcp://127.0.0.1:9",
        "p2pGroups": [
            {
                "name": "fleet",
                "p2p": False,
                "instances": [{"name": n, "url": f"http://{n}.sim"} for n in names],
            }
        ],
    }


async def _route(
    rec: Recorded, snapshot: dl.Snapshot, count: int | None, deadline: float, profile: bool
) -> tuple[dict[str, list[float]], str]:
    state = build_state(parse_config(route_config(rec.names)), GatewayEnv())
    try:
        for inst in state.instances:
            inst.ready = True
        client = state.index
        client.controller_up = True
        if not client.replica.load_snapshot(snapshot) or not client.in_sync:
            raise RuntimeError("the gateway's replica is not in sync with the snapshot")
        sel = state.selector
        now = [0.0]
        sel.clock = lambda: now[0]
        pool = state.instances.peers()
        by_index = {r.index: r for r in rec.results}
        pending: list[tuple[float, int, int, Any]] = []  # (time, order, 0 first byte/1 end, ticket)
        order = 0
        times: dict[str, list[float]] = {
            "total": [],
            "cpu": [],
            "hits": [],
            "decide": [],
            "hit_instances": [],
        }
        prof = cProfile.Profile() if profile else None
        clock = time.perf_counter
        cpu = time.thread_time
        requests = sorted(rec.requests, key=lambda r: by_index[r.index].arrival_s)
        for n, r in enumerate(requests[:count]):
            res = by_index[r.index]
            now[0] = res.arrival_s
            while pending and pending[0][0] <= now[0]:
                at, _, kind, ticket = heapq.heappop(pending)
                if kind == 0:
                    state.load.first_byte(ticket, at)
                else:
                    state.load.finish(ticket)
            prompt = Prompt(r.input_length, rec.keys[r.index][: r.input_length // 256], None)
            if prof is not None:
                prof.enable()
            c0 = cpu()
            t0 = clock()
            hits = await client.lookup(prompt.hashes)  # what Selector.hits asks
            t1 = clock()
            inst, decision = sel.decide(pool, prompt, hits, set(), record=False)
            attempt = sel.admit(inst, prompt, decision)
            t2 = clock()
            c2 = cpu()
            if prof is not None:
                prof.disable()
            times["total"].append(t2 - t0)
            times["cpu"].append(c2 - c0)
            times["hits"].append(t1 - t0)
            times["decide"].append(t2 - t1)
            times["hit_instances"].append(float(_holders(hits)))
            ticket = attempt.ticket
            if res.ttft_s is not None:
                heapq.heappush(pending, (res.arrival_s + res.ttft_s, order, 0, ticket))
            end = res.arrival_s + (res.e2e_s if res.e2e_s is not None else 0.0)
            heapq.heappush(pending, (end, order + 1, 1, ticket))
            order += 2
            if n % 512 == 0 and time.monotonic() > deadline:
                raise PhaseTimeoutError("the routing measurement ran past its budget")
        text = ""
        if prof is not None:
            buf = io.StringIO()
            stats = pstats.Stats(prof, stream=buf)
            stats.sort_stats("tottime").print_stats(12)
            stats.sort_stats("cumulative").print_stats(12)
            text = buf.getvalue()
        return times, text
    finally:
        await state.http.aclose()


def _holders(hits: GroupedHits | dict[str, Any] | None) -> int:
    """Instances holding a prefix of the prompt, in either shape of the index's answer."""
    if isinstance(hits, GroupedHits):
        return sum(g.instances.bit_count() for g in hits.groups)
    return len(hits or {})


def route(
    rec: Recorded, snapshot: dl.Snapshot, params: ScaleParams, logdir: Path
) -> dict[str, float]:
    """The gateway's routing decision over ``instances`` candidates, per trace prompt."""
    deadline = time.monotonic() + params.route_budget_s
    count = params.route_requests
    log(f"routing: {count or len(rec.requests)} trace prompts over {params.instances} instances")
    times, _ = asyncio.run(_route(rec, snapshot, count, deadline, profile=False))
    out = {
        "route_p50_ms_1000": _pct(times["total"], 0.5) * 1e3,
        "route_p99_ms_1000": _pct(times["total"], 0.99) * 1e3,
        "route_max_ms_1000": max(times["total"]) * 1e3,
        "route_cpu_p50_ms_1000": _pct(times["cpu"], 0.5) * 1e3,
        "route_cpu_p99_ms_1000": _pct(times["cpu"], 0.99) * 1e3,
        "route_hits_p50_ms_1000": _pct(times["hits"], 0.5) * 1e3,
        "route_hits_p99_ms_1000": _pct(times["hits"], 0.99) * 1e3,
        "route_decide_p50_ms_1000": _pct(times["decide"], 0.5) * 1e3,
        "route_decide_p99_ms_1000": _pct(times["decide"], 0.99) * 1e3,
        "route_hit_instances_mean": sum(times["hit_instances"]) / len(times["hit_instances"]),
        "route_decisions": float(len(times["total"])),
    }
    log("  " + ", ".join(f"{k} {v:.4g}" for k, v in out.items()))
    if out["route_p99_ms_1000"] > 1.0:
        # best effort, on the first decisions only: the measurement above is what counts
        n = min(count or len(rec.requests), PROFILE_DECISIONS)
        try:
            _, text = asyncio.run(_route(rec, snapshot, n, time.monotonic() + 120, profile=True))
        except PhaseTimeoutError as exc:
            log(f"  no profile: {exc}")
            return out
        (logdir / "route-profile.txt").write_text(text)
        log(f"  over 1 ms at p99; where the time goes (cProfile of {n} decisions):")
        for line in text.splitlines():
            if line.strip():
                log(f"    {line}")
    return out


# ---------------------------------------------------------------- all of it


def measure_controller(
    params: ScaleParams, trace: Path, logdir: Path, workdir: Path
) -> tuple[dict[str, float], Recorded, bytes]:
    """Parts 1 and 2 of the module docstring: simulate, record, replay into fresh controllers.
    Returns the metrics, the recording and the controller's final snapshot (encoded)."""
    p = params
    rec = simulate(p, trace)
    specs = write_specs(rec, workdir)
    lookup_spec = write_lookup_spec(rec, workdir)
    runs: dict[str, dict[str, float]] = {}
    state: bytes | None = None
    for mode in p.modes:
        runs[mode], frame = replay(rec, specs, lookup_spec, mode, logdir, workdir)
        state = state or frame
    assert state is not None
    m: dict[str, float] = {}
    first = runs[p.modes[0]]
    paced = runs.get("paced", first)
    flat = runs.get("flat", first)
    every = list(runs.values())
    m["controller_events_sent"] = first["events_sent"]
    m["controller_events_applied"] = first["events_applied"]
    m["controller_events_lost"] = sum(r["lost"] for r in every)
    m["controller_bad_input"] = sum(r["bad_input"] for r in every)
    m["controller_replica_gaps"] = sum(r["replica_gaps"] for r in every)
    m["controller_events_per_s"] = flat["events_per_s"]
    m["controller_events_per_cpu_s"] = flat["events_sent"] / max(flat["cpu_s"], 1e-3)
    m["controller_events_per_cpu_s_outside_lookups"] = flat["events_sent"] / max(
        flat["cpu_s"] - flat["lookup_inside_s"], 1e-3
    )
    m["controller_msgs_per_s"] = flat["msgs_per_s"]
    m["controller_messages"] = first["messages"]
    m["controller_events_per_s_paced"] = paced["events_per_s"]
    m["controller_paced_wall_s"] = paced["wall_s"]
    m["controller_paced_late_s"] = paced["late_s"]
    m["controller_paced_drain_s"] = paced["drain_s"]
    for k in ("p50", "p99"):
        m[f"controller_lookup_{k}_ms"] = paced[f"lookup_{k}_ms"]
        m[f"controller_p2p_lookup_{k}_ms"] = paced[f"p2p_lookup_{k}_ms"]
        m[f"controller_prefix_lookup_{k}_ms"] = paced[f"prefix_lookup_{k}_ms"]
        m[f"controller_lookup_{k}_ms_flat"] = flat[f"lookup_{k}_ms"]
    m["controller_p2p_lookup_inside_ms"] = paced["p2p_lookup_inside_ms"]
    m["controller_prefix_lookup_inside_ms"] = paced["prefix_lookup_inside_ms"]
    m["controller_lookups_per_s"] = paced["lookups_per_s"]
    m["controller_lookup_errors"] = sum(r["lookup_errors"] for r in every)
    m["controller_cpu_s"] = paced["cpu_s"]
    m["controller_cpu_s_flat"] = flat["cpu_s"]
    m["controller_lookup_cpu_s_flat"] = flat["lookup_inside_s"]
    m["controller_rss_mb"] = paced["rss_mb"]
    m["controller_peak_rss_mb"] = max(r["peak_rss_mb"] for r in every)
    m["controller_chunk_locations"] = first["chunk_locations"]
    m["controller_instances_with_keys"] = first["instances_with_keys"]
    m["controller_instances"] = float(p.instances)
    m["trace_requests"] = float(len(rec.requests))
    m["trace_compression"] = p.time_scale * p.replay_speedup
    m["sim_wall_s"] = rec.sim_wall_s
    return m, rec, state


def measure_scale(
    quick: bool,
    logdir: Path,
    *,
    trace: Path = TRACE,
    params: ScaleParams | None = None,
) -> dict[str, float]:
    """Run every part (see the module docstring); returns the metrics. Child processes bind
    127.0.0.1 only and are stopped before returning (also on errors and Ctrl-C); their logs
    are in ``logdir``."""
    p = params or ScaleParams.preset(quick)
    logdir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="kvpool-fleet-scale-") as tmp:
        workdir = Path(tmp)
        m, rec, state = measure_controller(p, trace, logdir, workdir)
        state_path = workdir / "state.snapshot"
        state_path.write_bytes(state)
        m.update(memory(state_path, p, logdir, workdir))
        m.update(route(rec, dl.decode_snapshot(state), p, logdir))
    m["scale_wall_s"] = time.perf_counter() - t_start
    m["box_load_1m_start"] = load_start
    m["box_load_1m_end"] = os.getloadavg()[0]
    return m


ROWS: tuple[tuple[str, str, str], ...] = (
    ("controller_instances", "instances registered (LMCache RegisterMsg)", "{:,.0f}"),
    ("trace_requests", "trace requests simulated", "{:,.0f}"),
    ("trace_compression", "trace clock ÷ paced replay clock", "{:g}x"),
    ("controller_events_sent", "admit/evict events sent", "{:,.0f}"),
    ("controller_events_applied", "events applied (delta stream, paced run)", "{:,.0f}"),
    ("controller_events_lost", "events lost (both runs; index vs engines' tiers)", "{:,.0f}"),
    ("controller_bad_input", "controller bad input (seq gaps, stale, unknown)", "{:,.0f}"),
    ("controller_events_per_s_paced", "paced: events/s offered", "{:,.0f}"),
    ("controller_paced_late_s", "paced: senders behind schedule at worst (s)", "{:.3f}"),
    ("controller_paced_drain_s", "paced: controller behind at the end (s)", "{:.3f}"),
    ("controller_lookup_p50_ms", "paced: lookup p50 (ms, P2P + HTTP)", "{:.2f}"),
    ("controller_lookup_p99_ms", "paced: lookup p99 (ms, P2P + HTTP)", "{:.2f}"),
    ("controller_p2p_lookup_p99_ms", "paced: P2P lookup p99 (ms)", "{:.2f}"),
    ("controller_prefix_lookup_p99_ms", "paced: /v1/prefix_lookup p99 (ms)", "{:.2f}"),
    (
        "controller_p2p_lookup_inside_ms",
        "paced: P2P lookup inside the controller, mean (ms)",
        "{:.2f}",
    ),
    (
        "controller_prefix_lookup_inside_ms",
        "paced: prefix lookup inside the controller, mean (ms)",
        "{:.2f}",
    ),
    ("controller_cpu_s", "paced: controller CPU (s)", "{:.1f}"),
    ("controller_events_per_s", "flat out: events/s applied", "{:,.0f}"),
    ("controller_msgs_per_s", "flat out: messages/s applied", "{:,.0f}"),
    ("controller_events_per_cpu_s", "flat out: events per controller CPU second", "{:,.0f}"),
    ("controller_lookup_p99_ms_flat", "flat out: lookup p99 (ms)", "{:.2f}"),
    ("controller_cpu_s_flat", "flat out: controller CPU (s)", "{:.1f}"),
    ("controller_lookup_cpu_s_flat", "flat out: of which inside lookups (s)", "{:.1f}"),
    (
        "controller_events_per_cpu_s_outside_lookups",
        "flat out: events per controller CPU second outside lookups",
        "{:,.0f}",
    ),
    ("controller_rss_mb", "controller RSS at the end (MB)", "{:.0f}"),
    ("controller_chunk_locations", "chunk-locations at the end", "{:,.0f}"),
    ("controller_instances_with_keys", "instances holding chunks at the end", "{:,.0f}"),
    ("index_mb_per_10m_locations", "ChunkIndex MB per 10M chunk-locations (RSS)", "{:.0f}"),
    (
        "index_mb_per_10m_locations_tracemalloc",
        "ChunkIndex MB per 10M chunk-locations (tracemalloc)",
        "{:.0f}",
    ),
    ("replica_mb_per_10m_locations", "IndexReplica MB per 10M chunk-locations (RSS)", "{:.0f}"),
    (
        "replica_mb_per_10m_locations_tracemalloc",
        "IndexReplica MB per 10M chunk-locations (tracemalloc)",
        "{:.0f}",
    ),
    ("memory_locations", "chunk-locations built for the memory figures", "{:,.0f}"),
    ("memory_chunks", "distinct chunks among them", "{:,.0f}"),
    ("snapshot_mb_per_10m_locations", "snapshot MB per 10M", "{:.0f}"),
    ("snapshot_encode_s_per_10m", "snapshot build + encode (s per 10M)", "{:.2f}"),
    ("snapshot_decode_s_per_10m", "snapshot decode (s per 10M)", "{:.2f}"),
    ("snapshot_load_s_per_10m", "snapshot load into IndexReplica (s per 10M)", "{:.2f}"),
    ("route_p50_ms_1000", "routing decision p50 (ms, 1000 instances)", "{:.3f}"),
    ("route_p99_ms_1000", "routing decision p99 (ms, 1000 instances; target ≤ 1)", "{:.3f}"),
    ("route_cpu_p50_ms_1000", "routing decision p50, CPU time of the thread (ms)", "{:.3f}"),
    ("route_cpu_p99_ms_1000", "routing decision p99, CPU time of the thread (ms)", "{:.3f}"),
    ("route_hits_p99_ms_1000", "of which IndexClient.lookup p99 (ms)", "{:.3f}"),
    ("route_decide_p99_ms_1000", "of which decide + admit p99 (ms)", "{:.3f}"),
    ("route_hit_instances_mean", "instances holding a prefix, per decision", "{:.0f}"),
    ("box_load_1m_start", "load average of the box at the start (2 cores)", "{:.1f}"),
    ("box_load_1m_end", "load average of the box at the end", "{:.1f}"),
)


def markdown(m: dict[str, float], quick: bool = False) -> str:
    lines = [
        f"Fleet scale{' (quick)' if quick else ''}: kvpool-controller and the gateway's routing "
        "with 1000 simulated instances replaying the Mooncake trace",
        "",
        "| metric | value |",
        "|---|---:|",
    ]
    for key, label, fmt in ROWS:
        if key in m and not math.isnan(m[key]):
            lines.append(f"| {label} | {fmt.format(m[key])} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a trace window; 2M chunk-locations")
    ap.add_argument("--out", default=None, help="write the metrics as JSON here")
    ap.add_argument("--logdir", default=None, help="child process logs (default: a temp dir)")
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--requests", type=int, default=None, help="override the trace window")
    ap.add_argument("--instances", type=int, default=None)
    ap.add_argument("--time-scale", type=float, default=None)
    a = ap.parse_args()
    params = ScaleParams.preset(a.quick)
    overrides = {
        k: v
        for k, v in (
            ("requests", a.requests),
            ("instances", a.instances),
            ("time_scale", a.time_scale),
        )
        if v is not None
    }
    params = replace(params, **overrides)
    with contextlib.ExitStack() as stack:
        logdir = Path(a.logdir) if a.logdir else Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="kvpool-fleet-scale-logs-")
        ))  # fmt: skip
        metrics = measure_scale(a.quick, logdir, trace=Path(a.trace), params=params)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(metrics, indent=1, sort_keys=True))
    print(markdown(metrics, a.quick))


if __name__ == "__main__":
    main()
