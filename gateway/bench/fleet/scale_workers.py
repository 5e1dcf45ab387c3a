"""The processes of the fleet-scale benchmark (``scale.py``); one role per process.

Why separate processes: the controller is measured as users run it, a separate process fed over
its sockets by other processes, and memory is measured as the growth of a fresh process's
resident set, which only a process that did nothing else before can show.

Roles (``python scale_workers.py ROLE ...``; each writes its result as JSON to ``--out``):

- ``send``: one sender of recorded LMCache admit/evict batches. It registers its instances as
  LMCache workers do (``RegisterMsg`` on a DEALER to the reply port, waiting for each
  ``RegisterRetMsg``), prints ``READY``, reads the common start time from stdin, then pushes its
  pre-encoded ``BatchedKVOperationMsg`` frames on one PUSH socket (at most 50 a multipart, as
  LMCache's push loop does), on their recorded times (``paced``) or as fast as ZMQ takes them
  (``flat``). It ends with a sentinel: an admit of a key no instance holds, on one of its own
  instances, numbered after that worker's last event. One PUSH connection is delivered in order,
  so once a P2P lookup finds the sentinel every earlier frame of this sender has been applied.
  The sentinel is then evicted (the next number) and the sender waits until it is gone, so the
  index ends exactly as the instances' tiers.
- ``lookup``: P2P lookups (``BatchedP2PLookupMsg`` on a DEALER, as a worker asks) and
  ``POST /v1/prefix_lookup`` (as a gateway whose replica is out of sync asks), each kind at its
  own fixed rate, over trace prompts' chunk keys, until a stop file appears; every latency
  recorded (until the answer is received, before it is looked at).
- ``replica``: the gateway's own :class:`~kvpool.gateway.index_client.IndexClient` following
  the controller's delta stream (snapshot first, then deltas). It counts the admit and evict
  events the controller applied (the keys of its ADMIT/EVICT deltas, sentinels excluded), and at
  the end dumps its replica for comparison.
- ``memory-index`` / ``memory-replica``: the index memory measurement, each in a fresh process
  (see ``scale.py``).
"""

from __future__ import annotations

import argparse
import array
import asyncio
import contextlib
import gc
import json
import os
import random
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import msgspec
import zmq

from kvpool.protocol import deltas as dl
from kvpool.protocol import lmcache_codec as codec
from kvpool.protocol import lmcache_wire as w
from kvpool.protocol.index import ChunkIndex

PUSH_BATCH = 50  # LMCache's push loop sends at most 50 queued messages in one multipart
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    """This process's resident set (bytes), from /proc."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def _write(path: str, data: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(data))


def _dealer(ctx: zmq.Context[Any], port: int, timeout_ms: int = 30_000) -> zmq.Socket[bytes]:
    sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def _request(sock: zmq.Socket[bytes], frame: bytes) -> Any:
    sock.send_multipart([b"", frame])
    return codec.decode(sock.recv_multipart()[-1])


def _read_start() -> float:
    line = sys.stdin.readline().strip()
    if not line:
        raise SystemExit("no start time on stdin (the parent went away)")
    return float(line)


# ---------------------------------------------------------------- send


def _holder(reply: Any) -> str:
    if isinstance(reply, w.BatchedP2PLookupRetMsg) and reply.layout_info:
        return str(reply.layout_info[0][0])
    return ""


def send(args: argparse.Namespace) -> None:
    spec = msgspec.msgpack.decode(Path(args.spec).read_bytes())
    ctx: zmq.Context[Any] = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)
    push.setsockopt(zmq.LINGER, 5_000)
    push.connect(f"tcp://127.0.0.1:{args.pull}")
    req = _dealer(ctx, args.reply)
    refused = []
    for frame in spec["register"]:
        reply = _request(req, frame)
        if not isinstance(reply, w.RegisterRetMsg):
            refused.append(repr(reply)[:200])
    if refused:
        raise SystemExit(f"{len(refused)} registrations refused, first: {refused[0]}")
    print("READY", flush=True)
    start_at = _read_start()
    times: list[float] = spec["times"]
    frames: list[bytes] = spec["frames"]
    speed = args.speedup
    time.sleep(max(0.0, start_at - time.time()))
    t0 = time.time()
    late = 0.0
    if args.mode == "flat":
        for i in range(0, len(frames), PUSH_BATCH):
            push.send_multipart(frames[i : i + PUSH_BATCH])
    else:
        i, n = 0, len(frames)
        while i < n:
            now = time.time() - start_at
            due = times[i] / speed
            if due > now:
                time.sleep(min(due - now, 0.5))
                continue
            j = i
            while j < n and j - i < PUSH_BATCH and times[j] / speed <= now:
                j += 1
            push.send_multipart(frames[i:j])
            late = max(late, now - due)
            i = j
    t_sent = time.time()
    sentinel = spec["sentinel"]  # [instance_id, key, admit frame, evict frame]
    probe = codec.encode(w.BatchedP2PLookupMsg([sentinel[1]], "scale-probe~probe", 0))
    push.send(sentinel[2])
    deadline = time.time() + args.timeout
    while _holder(_request(req, probe)) != sentinel[0]:
        if time.time() > deadline:
            raise SystemExit(f"sentinel of {sentinel[0]} not applied within {args.timeout}s")
        time.sleep(0.002)
    t_done = time.time()
    push.send(sentinel[3])
    while _holder(_request(req, probe)) != "":
        if time.time() > deadline:
            raise SystemExit(f"sentinel of {sentinel[0]} not evicted within {args.timeout}s")
        time.sleep(0.002)
    ctx.destroy(linger=1000)
    _write(
        args.out,
        {
            "events": spec["events"],
            "messages": len(frames),
            "instances": len(spec["register"]),
            "start_at": start_at,
            "t0": t0,
            "t_sent": t_sent,
            "t_done": t_done,
            "max_late_s": late,
        },
    )


# ---------------------------------------------------------------- lookup


def lookup(args: argparse.Namespace) -> None:
    import httpx

    spec = msgspec.msgpack.decode(Path(args.spec).read_bytes())
    prompts: list[list[int]] = spec["prompts"]
    requesters: list[str] = spec["instances"]
    ctx: zmq.Context[Any] = zmq.Context()
    req = _dealer(ctx, args.reply, 10_000)
    http = httpx.Client(base_url=f"http://127.0.0.1:{args.http}", timeout=10)
    rng = random.Random(7)
    print("READY", flush=True)
    start_at = _read_start()
    time.sleep(max(0.0, start_at - time.time()))
    stop = Path(args.stop_file)
    lat: dict[str, list[float]] = {"p2p": [], "http": []}
    errors = {"p2p": 0, "http": 0}
    hits = {"p2p": 0, "http": 0}
    # each kind on its own fixed schedule; one that fell behind does not burst to catch up
    period = {"p2p": 1.0 / args.p2p_rate, "http": 1.0 / args.prefix_rate}
    due = dict.fromkeys(period, time.perf_counter())
    n = 0
    while not stop.exists():
        kind = min(due, key=lambda k: due[k])
        pause = due[kind] - time.perf_counter()
        if pause > 0:
            time.sleep(min(pause, 0.05))
            continue
        hashes = prompts[n % len(prompts)]
        n += 1
        t = time.perf_counter()
        try:
            if kind == "p2p":
                who = rng.choice(requesters)
                reply = _request(req, codec.encode(w.BatchedP2PLookupMsg(hashes, who, 0)))
                lat[kind].append(time.perf_counter() - t)
                ok = isinstance(reply, w.BatchedP2PLookupRetMsg)
                found = ok and bool(_holder(reply))
            else:
                resp = http.post("/v1/prefix_lookup", json={"hashes": hashes})
                lat[kind].append(time.perf_counter() - t)
                ok = resp.status_code == 200
                found = ok and bool(resp.json().get("instances"))
        except (zmq.ZMQError, httpx.HTTPError, codec.ProtocolError):
            lat[kind].append(time.perf_counter() - t)
            ok = found = False
        errors[kind] += 0 if ok else 1
        hits[kind] += 1 if found else 0
        due[kind] = max(due[kind] + period[kind], time.perf_counter())
    ctx.destroy(linger=0)
    http.close()
    _write(
        args.out,
        {
            "latency_s": lat,
            "errors": errors,
            "found": hits,
            "wall_s": time.time() - start_at,
        },
    )


# ---------------------------------------------------------------- replica


class _CountingReplica(dl.IndexReplica):
    """An IndexReplica that counts the admit and evict events it applies from deltas."""

    def __init__(self, sentinels: set[int]) -> None:
        super().__init__()
        self.sentinels = sentinels
        self.events = 0
        self.sentinel_events = 0

    def _apply(self, delta: dl.Delta) -> None:
        if delta.op in (dl.DeltaOp.ADMIT, dl.DeltaOp.EVICT):
            # a sentinel travels alone in its batch, so its delta holds it alone
            if len(delta.keys) == 1 and delta.keys[0] in self.sentinels:
                self.sentinel_events += 1
            else:
                self.events += len(delta.keys)
        super()._apply(delta)


async def _replica(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    from kvpool.gateway.index_client import IndexClient
    from kvpool.gateway.metrics import GatewayMetrics

    sentinels = {int(k) for k in args.sentinels.split(",") if k}
    metrics = GatewayMetrics()
    async with httpx.AsyncClient() as http:
        client = IndexClient(
            f"http://127.0.0.1:{args.http}",
            f"tcp://127.0.0.1:{args.pub}",
            f"tcp://127.0.0.1:{args.snapshot}",
            http,
            metrics,
            poll_interval_s=0.2,
        )
        replica = _CountingReplica(sentinels)
        client.replica = replica
        task = asyncio.create_task(client.run())
        try:
            deadline = time.monotonic() + args.timeout
            while not client.in_sync:
                if time.monotonic() > deadline or task.done():
                    raise SystemExit("the replica never got in sync with the controller")
                await asyncio.sleep(0.02)
            print("READY", flush=True)
            target = Path(args.target_file)
            while not target.exists():
                if task.done():
                    raise SystemExit(f"the index client stopped: {task.exception()!r}")
                await asyncio.sleep(0.05)
            want = int(target.read_text())
            deadline = time.monotonic() + args.timeout
            while replica.seq < want and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            resyncs = sum(
                s.value
                for m in metrics.index_resyncs.collect()
                for s in m.samples
                if s.name.endswith("_total")
            )
            entries = [
                [inst, wid, loc, replica.index.worker_keys(inst, wid, loc)]
                for (inst, wid) in sorted(replica.workers)
                for loc in replica.index.locations_of(inst, wid)
            ]
            Path(args.dump).write_bytes(msgspec.msgpack.encode(entries))
            return {
                "events": replica.events,
                "sentinel_events": replica.sentinel_events,
                "seq": replica.seq,
                "target_seq": want,
                "gaps": replica.gaps,
                "snapshots": resyncs,
                "workers": len(replica.workers),
                "chunk_locations": len(replica.index),
            }
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            client.close()


def replica(args: argparse.Namespace) -> None:
    _write(args.out, asyncio.run(_replica(args)))


# ---------------------------------------------------------------- memory


def _scaled_entries(state: bytes, target: int) -> list[tuple[str, str, array.array[int]]]:
    """The controller's final index, copied until it holds ``target`` chunk-locations: each
    instance holds copy ``c`` of its own tiers with every key ``k`` renamed ``hash((c, k))``
    (copy 0 keeps the real keys), so chunks are shared by as many instances, and held in as
    many tiers, as in the simulated fleet."""
    snap = dl.decode_snapshot(state)
    base = sum(len(e.keys) for e in snap.entries)
    if base == 0:
        raise SystemExit("the state to scale is empty")
    out: list[tuple[str, str, array.array[int]]] = []
    left = target
    copy = 0
    while left > 0:
        for e in snap.entries:
            keys = e.keys[:left]
            if copy:
                keys = [hash((copy, k)) for k in keys]
            out.append((e.instance_id, e.location, array.array("q", keys)))
            left -= len(keys)
            if left <= 0:
                break
        copy += 1
    return out


def _measure_start(mode: str) -> float:
    gc.collect()
    if mode == "tracemalloc":
        tracemalloc.start()
        return float(tracemalloc.get_traced_memory()[0])
    return float(rss_bytes())


def _measure_now(mode: str) -> float:
    gc.collect()
    if mode == "tracemalloc":
        return float(tracemalloc.get_traced_memory()[0])
    return float(rss_bytes())


def memory_index(args: argparse.Namespace) -> None:
    """Build a ChunkIndex of ``--target`` chunk-locations; its memory; a snapshot of it."""
    entries = _scaled_entries(Path(args.state).read_bytes(), args.target)
    before = _measure_start(args.mode)
    index = ChunkIndex()
    t = time.perf_counter()
    step = 65_536
    for inst, loc, keys in entries:
        for i in range(0, len(keys), step):
            index.admit(inst, 0, loc, keys[i : i + step].tolist())
    build_s = time.perf_counter() - t
    grown = _measure_now(args.mode) - before
    if args.mode == "tracemalloc":
        tracemalloc.stop()  # the snapshot below is for the replica's process, not measured here
    result: dict[str, Any] = {
        "mode": args.mode,
        "chunk_locations": len(index),
        "chunks": index.stats()["chunks"],
        "instances": index.stats()["instances"],
        "bytes": grown,
        "build_s": build_s,
    }
    if args.snapshot_out:
        instances = sorted({inst for inst, _, _ in entries})
        del entries
        # as the controller builds its snapshot: per worker, per tier, the keys it holds
        t = time.perf_counter()
        snap = dl.Snapshot(
            "scale",
            0,
            [],
            [
                dl.LocationEntry(inst, 0, loc, index.worker_keys(inst, 0, loc))
                for inst in instances
                for loc in index.locations_of(inst, 0)
            ],
        )
        result["snapshot_build_s"] = time.perf_counter() - t
        t = time.perf_counter()
        frame = dl.encode(snap)
        result["snapshot_encode_s"] = time.perf_counter() - t
        result["snapshot_bytes"] = len(frame)
        Path(args.snapshot_out).write_bytes(frame)
    _write(args.out, result)


def memory_replica(args: argparse.Namespace) -> None:
    """Decode a snapshot and load it into a gateway-side IndexReplica; its memory."""
    frame = Path(args.snapshot_in).read_bytes()
    before = _measure_start(args.mode)
    t = time.perf_counter()
    snap = dl.decode_snapshot(frame)
    decode_s = time.perf_counter() - t
    peak = _measure_now(args.mode) - before
    replica = dl.IndexReplica()
    t = time.perf_counter()
    replica.load_snapshot(snap)
    load_s = time.perf_counter() - t
    del snap
    grown = _measure_now(args.mode) - before
    _write(
        args.out,
        {
            "mode": args.mode,
            "chunk_locations": len(replica.index),
            "bytes": grown,
            "decoded_snapshot_bytes": peak,
            "decode_s": decode_s,
            "load_s": load_s,
            "in_sync": not replica.needs_snapshot,
        },
    )


# ---------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="role", required=True)
    s = sub.add_parser("send")
    s.add_argument("--spec", required=True)
    s.add_argument("--pull", type=int, required=True)
    s.add_argument("--reply", type=int, required=True)
    s.add_argument("--mode", choices=("paced", "flat"), required=True)
    s.add_argument("--speedup", type=float, default=1.0)
    s.add_argument("--timeout", type=float, default=300.0)
    s.add_argument("--out", required=True)
    lk = sub.add_parser("lookup")
    lk.add_argument("--spec", required=True)
    lk.add_argument("--reply", type=int, required=True)
    lk.add_argument("--http", type=int, required=True)
    lk.add_argument("--p2p-rate", type=float, required=True, help="P2P lookups per second")
    lk.add_argument("--prefix-rate", type=float, required=True, help="prefix lookups per second")
    lk.add_argument("--stop-file", required=True)
    lk.add_argument("--out", required=True)
    r = sub.add_parser("replica")
    r.add_argument("--http", type=int, required=True)
    r.add_argument("--pub", type=int, required=True)
    r.add_argument("--snapshot", type=int, required=True)
    r.add_argument("--sentinels", default="")
    r.add_argument("--target-file", required=True)
    r.add_argument("--timeout", type=float, default=120.0)
    r.add_argument("--dump", required=True)
    r.add_argument("--out", required=True)
    for name in ("memory-index", "memory-replica"):
        m = sub.add_parser(name)
        m.add_argument("--mode", choices=("rss", "tracemalloc"), default="rss")
        m.add_argument("--out", required=True)
        if name == "memory-index":
            m.add_argument("--state", required=True, help="an encoded Snapshot to scale up")
            m.add_argument("--target", type=int, required=True)
            m.add_argument("--snapshot-out", default=None)
        else:
            m.add_argument("--snapshot-in", required=True)
    args = ap.parse_args()
    handlers = {
        "send": send,
        "lookup": lookup,
        "replica": replica,
        "memory-index": memory_index,
        "memory-replica": memory_replica,
    }
    handlers[args.role](args)


if __name__ == "__main__":
    main()
