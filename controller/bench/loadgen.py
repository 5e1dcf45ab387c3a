"""Multi-process load generator for an LMCache-protocol controller (ours or LMCache's).

Why: LMCache's ``controller_benchmark`` is one Python client that builds every message while it
measures (100 ``random.choice`` per batch), so it saturates before a fast controller does — it
measures the client. Here each blaster process pre-encodes its admit/evict batches (LMCache's own
message classes, same sizes and op mix) before a common start time, then sends them as fast as
ZMQ takes them, and ends with a sentinel admit. A PULL socket delivers one connection's messages
in order, so when a P2P lookup finds the sentinel, every earlier batch of that process has been
applied. Throughput = events applied ÷ (last sentinel seen − start). One more process issues
closed-loop P2P lookups until the blast ends (a stop file appears) and reports their latency.

Run: ``python loadgen.py --role blast|lookup --pull P --reply R --id N --start-at T ...``; the
last stdout line is a JSON result.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq
from lmcache.v1.cache_controller import message as lm

SENTINEL_BASE = 1 << 60


def _request(sock: zmq.Socket[bytes], msg: Any) -> Any:
    sock.send_multipart([b"", msgspec.msgpack.encode(msg)])
    return msgspec.msgpack.decode(sock.recv_multipart()[-1], type=lm.Msg)


def _sockets(
    args: argparse.Namespace,
) -> tuple[zmq.Context[Any], zmq.Socket[bytes], zmq.Socket[bytes]]:
    ctx: zmq.Context[Any] = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)
    push.connect(f"tcp://127.0.0.1:{args.pull}")
    req = ctx.socket(zmq.DEALER)
    req.setsockopt(zmq.RCVTIMEO, 60_000)
    req.connect(f"tcp://127.0.0.1:{args.reply}")
    return ctx, push, req


def blast(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.id)
    ctx, push, req = _sockets(args)
    instances = [f"lg{args.id}_{j}" for j in range(args.instances)]
    for inst in instances:
        _request(req, lm.RegisterMsg(inst, 0, "127.0.0.1", 1, f"peer-{inst}"))
    seq = dict.fromkeys(instances, 0)
    frames: list[bytes] = []
    events = 0
    for _ in range(args.batches):
        inst = rng.choice(instances)
        op = lm.OpType.ADMIT if rng.random() < args.admit_share else lm.OpType.EVICT
        ops = []
        for _ in range(args.batch):
            ops.append(lm.KVOpEvent(op, rng.randrange(args.keys), seq[inst]))
            seq[inst] += 1
        frames.append(
            msgspec.msgpack.encode(lm.BatchedKVOperationMsg(inst, 0, "LocalCPUBackend", ops))
        )
        events += args.batch
    sentinel = SENTINEL_BASE + args.id
    last = lm.BatchedKVOperationMsg(
        instances[0],
        0,
        "LocalCPUBackend",
        [lm.KVOpEvent(lm.OpType.ADMIT, sentinel, seq[instances[0]])],
    )
    frames.append(msgspec.msgpack.encode(last))
    time.sleep(max(0.0, args.start_at - time.time()))
    t0 = time.time()
    group = args.multipart
    for start in range(0, len(frames), group):
        push.send_multipart(frames[start : start + group])
    t_sent = time.time()
    probe = lm.BatchedP2PLookupMsg([sentinel], "lg-probe", 0)
    while True:
        reply = _request(req, probe)
        if reply.layout_info and reply.layout_info[0][0] == instances[0]:
            break
        time.sleep(0.002)
    t_done = time.time()
    ctx.destroy(linger=0)
    return {"events": events, "t0": t0, "t_sent": t_sent, "t_done": t_done}


def lookup(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(1000 + args.id)
    ctx, _push, req = _sockets(args)
    time.sleep(max(0.0, args.start_at - time.time()))
    lat: list[float] = []
    stop = Path(args.stop_file)
    n = 0
    while n % 64 or not stop.exists():
        n += 1
        hashes = [rng.randrange(args.keys) for _ in range(args.hashes)]
        who = f"lg0_{rng.randrange(args.instances)}"
        t = time.perf_counter()
        _request(req, lm.BatchedP2PLookupMsg(hashes, who, 0))
        lat.append(time.perf_counter() - t)
    ctx.destroy(linger=0)
    lat.sort()
    return {
        "lookups": len(lat),
        "p50_ms": lat[len(lat) // 2] * 1e3 if lat else 0.0,
        "p95_ms": lat[int(len(lat) * 0.95)] * 1e3 if lat else 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=("blast", "lookup"), required=True)
    ap.add_argument("--pull", type=int, required=True)
    ap.add_argument("--reply", type=int, required=True)
    ap.add_argument("--id", type=int, default=0)
    ap.add_argument("--start-at", type=float, required=True)
    ap.add_argument("--instances", type=int, default=10)
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--batches", type=int, default=2000)
    ap.add_argument("--admit-share", type=float, default=35 / 64)
    ap.add_argument("--multipart", type=int, default=10)
    ap.add_argument("--hashes", type=int, default=100)
    ap.add_argument("--stop-file", default="/nonexistent", help="lookups run until it exists")
    args = ap.parse_args()
    result = blast(args) if args.role == "blast" else lookup(args)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
