"""Multi-process load generator for an LMCache-protocol controller (ours or LMCache's).

Why: LMCache's ``controller_benchmark`` is one Python client that builds every message while it
measures (100 ``random.choice`` per batch), so it saturates before a fast controller does — it
measures the client. Here every message is built with LMCache's own message classes and encoded
*before* a common start time, so during the run a process only hands bytes to ZMQ.

Roles (the last stdout line of each is a JSON result):

- ``blast`` — saturation. LMCache's message mix (``admit:35,evict:29,heartbeat:1,p2p_lookup:35``
  per 100 operations, batches of ``--batch`` events, lookups of ``--hashes`` hashes) in a
  seeded shuffled order: admit/evict batches go out on a PUSH socket as fast as ZMQ takes them
  (grouped into multipart messages as LMCache workers send them), P2P lookups and heartbeats on
  DEALER sockets with up to ``--window`` requests in flight each. The run ends with a sentinel
  admit: a PULL socket delivers one connection's messages in order, so once a lookup finds the
  sentinel every earlier batch of this process has been applied. Messages are counted like
  ``controller_benchmark``: a batch counts its events, a lookup its hashes, a heartbeat one.
- ``background`` — a fixed offered load: admit/evict batches at ``--rate`` events per second for
  ``--duration`` seconds (paced in 1 ms steps), the same load for every controller.
- ``lookup`` — paced closed-loop P2P lookups (``--rate`` per second) until a stop file appears;
  reports their latency percentiles.

Run: ``python loadgen.py --role blast|background|lookup --pull P --reply R [--heartbeat H] ...``.
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
MIX = {"admit": 35, "evict": 29, "heartbeat": 1, "p2p_lookup": 35}


def _request(sock: zmq.Socket[bytes], msg: Any) -> Any:
    sock.send_multipart([b"", msgspec.msgpack.encode(msg)])
    return msgspec.msgpack.decode(sock.recv_multipart()[-1], type=lm.Msg)


def _dealer(ctx: zmq.Context[Any], port: int) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 120_000)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def _push(ctx: zmq.Context[Any], port: int) -> zmq.Socket[bytes]:
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)
    push.connect(f"tcp://127.0.0.1:{port}")
    return push


def _register(req: zmq.Socket[bytes], instances: list[str]) -> None:
    for inst in instances:
        _request(req, lm.RegisterMsg(inst, 0, "127.0.0.1", 1, f"peer-{inst}"))


def _kv_frame(
    rng: random.Random, inst: str, op: lm.OpType, args: argparse.Namespace, seq: dict[str, int]
) -> bytes:
    ops = []
    for _ in range(args.batch):
        ops.append(lm.KVOpEvent(op, rng.randrange(args.keys), seq[inst]))
        seq[inst] += 1
    return msgspec.msgpack.encode(lm.BatchedKVOperationMsg(inst, 0, "LocalCPUBackend", ops))


def _wait_sentinel(req: zmq.Socket[bytes], sentinel: int, owner: str) -> None:
    probe = lm.BatchedP2PLookupMsg([sentinel], "lg-probe", 0)
    while True:
        reply = _request(req, probe)
        if reply.layout_info and reply.layout_info[0][0] == owner:
            return
        time.sleep(0.001)


def blast(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.id)
    ctx: zmq.Context[Any] = zmq.Context()
    push, req = _push(ctx, args.pull), _dealer(ctx, args.reply)
    beat = _dealer(ctx, args.heartbeat) if args.heartbeat else req
    instances = [f"lg{args.id}_{j}" for j in range(args.instances)]
    _register(req, instances)
    seq = dict.fromkeys(instances, 0)
    deck = [op for op, share in MIX.items() for _ in range(share)] * (args.batches // 100 + 1)
    rng.shuffle(deck)
    plan: list[tuple[str, bytes]] = []  # ("push" | "req" | "beat", frame)
    msgs = 0
    for op in deck[: args.batches]:
        inst = rng.choice(instances)
        if op in ("admit", "evict"):
            kind = lm.OpType.ADMIT if op == "admit" else lm.OpType.EVICT
            plan.append(("push", _kv_frame(rng, inst, kind, args, seq)))
            msgs += args.batch
        elif op == "p2p_lookup":
            hashes = [rng.randrange(args.keys) for _ in range(args.hashes)]
            plan.append(("req", msgspec.msgpack.encode(lm.BatchedP2PLookupMsg(hashes, inst, 0))))
            msgs += args.hashes
        else:
            hb = lm.HeartbeatMsg(inst, 0, "127.0.0.1", 1, f"peer-{inst}")
            plan.append(("beat" if args.heartbeat else "req", msgspec.msgpack.encode(hb)))
            msgs += 1
    sentinel = SENTINEL_BASE + args.id
    last = lm.BatchedKVOperationMsg(
        instances[0],
        0,
        "LocalCPUBackend",
        [lm.KVOpEvent(lm.OpType.ADMIT, sentinel, seq[instances[0]])],
    )
    sockets = {"req": req, "beat": beat}
    inflight = {"req": 0, "beat": 0}
    poller = zmq.Poller()
    for sock in {req, beat}:
        poller.register(sock, zmq.POLLIN)

    def reap(block: bool) -> None:
        for sock, _ in poller.poll(None if block else 0):
            while True:
                try:
                    sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                inflight["req" if sock is req else "beat"] -= 1

    time.sleep(max(0.0, args.start_at - time.time()))
    t0 = time.time()
    group: list[bytes] = []
    for where, frame in plan:
        if where == "push":
            group.append(frame)
            if len(group) == args.multipart:
                push.send_multipart(group)
                group = []
            continue
        while inflight[where] >= args.window:
            reap(block=True)
        sockets[where].send_multipart([b"", frame])
        inflight[where] += 1
        reap(block=False)
    if group:
        push.send_multipart(group)
    push.send(msgspec.msgpack.encode(last))
    t_sent = time.time()
    while inflight["req"] or inflight["beat"]:
        reap(block=True)
    _wait_sentinel(req, sentinel, instances[0])
    t_done = time.time()
    ctx.destroy(linger=0)
    events = sum(args.batch for where, _ in plan if where == "push")
    return {"msgs": msgs, "events": events, "t0": t0, "t_sent": t_sent, "t_done": t_done}


def background(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(500 + args.id)
    ctx: zmq.Context[Any] = zmq.Context()
    push, req = _push(ctx, args.pull), _dealer(ctx, args.reply)
    instances = [f"bg{args.id}_{j}" for j in range(args.instances)]
    _register(req, instances)
    seq = dict.fromkeys(instances, 0)
    n = int(args.rate * args.duration / args.batch)
    admit_share = MIX["admit"] / (MIX["admit"] + MIX["evict"])
    frames = [
        _kv_frame(
            rng,
            rng.choice(instances),
            lm.OpType.ADMIT if rng.random() < admit_share else lm.OpType.EVICT,
            args,
            seq,
        )
        for _ in range(n)
    ]
    time.sleep(max(0.0, args.start_at - time.time()))
    t0 = time.perf_counter()
    per_s = args.rate / args.batch
    sent = 0
    while sent < n:
        due = min(n, int((time.perf_counter() - t0) * per_s) + 1)
        while sent < due:
            push.send(frames[sent])
            sent += 1
        time.sleep(0.001)
    elapsed = time.perf_counter() - t0
    ctx.destroy(linger=0)
    return {"events": n * args.batch, "seconds": elapsed, "events_per_s": n * args.batch / elapsed}


def lookup(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(1000 + args.id)
    ctx: zmq.Context[Any] = zmq.Context()
    req = _dealer(ctx, args.reply)
    time.sleep(max(0.0, args.start_at - time.time()))
    lat: list[float] = []
    stop = Path(args.stop_file)
    prefix = args.lookup_prefix
    start = time.perf_counter()
    n = 0
    while n % 64 or not stop.exists():
        if args.rate > 0:
            time.sleep(max(0.0, start + n / args.rate - time.perf_counter()))
        n += 1
        hashes = [rng.randrange(args.keys) for _ in range(args.hashes)]
        frame = msgspec.msgpack.encode(
            lm.BatchedP2PLookupMsg(hashes, f"{prefix}{rng.randrange(args.instances)}", 0)
        )
        t = time.perf_counter()
        req.send_multipart([b"", frame])
        req.recv_multipart()
        lat.append(time.perf_counter() - t)
    ctx.destroy(linger=0)
    lat.sort()

    def pct(q: float) -> float:
        return lat[min(len(lat) - 1, int(len(lat) * q))] * 1e3 if lat else 0.0

    return {"lookups": len(lat), "p50_ms": pct(0.5), "p95_ms": pct(0.95), "p99_ms": pct(0.99)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=("blast", "background", "lookup"), required=True)
    ap.add_argument("--pull", type=int, required=True)
    ap.add_argument("--reply", type=int, required=True)
    ap.add_argument("--heartbeat", type=int, default=0)
    ap.add_argument("--id", type=int, default=0)
    ap.add_argument("--start-at", type=float, required=True)
    ap.add_argument("--instances", type=int, default=10)
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--batches", type=int, default=2000, help="operations per blast process")
    ap.add_argument("--multipart", type=int, default=10)
    ap.add_argument("--window", type=int, default=16, help="requests in flight per socket")
    ap.add_argument("--hashes", type=int, default=100)
    ap.add_argument("--rate", type=float, default=0.0, help="events/s (background), lookups/s")
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--lookup-prefix", default="bg0_")
    ap.add_argument("--stop-file", default="/nonexistent", help="lookups run until it exists")
    args = ap.parse_args()
    roles = {"blast": blast, "background": background, "lookup": lookup}
    print(json.dumps(roles[args.role](args)), flush=True)


if __name__ == "__main__":
    main()
