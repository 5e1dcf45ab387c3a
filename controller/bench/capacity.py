"""Controller capacity: the same wire frames through each controller's own handlers, in process.

Why: over sockets on this shared 2-core box, both LMCache's ``controller_benchmark`` client and
our load generator compete with the controller for CPU, so the end-to-end rates mostly measure
the clients. This measures the controllers themselves: the identical msgpack frames of
``controller_benchmark``'s workload (``admit:35,evict:29,p2p_lookup:35``, batch 100, 100 hashes
per lookup, 1M keys) are decoded and handled by

- LMCache 0.5.6: ``msgspec.msgpack.decode(frame, type=Msg)`` then
  ``LMCacheControllerManager.handle_worker_message`` / ``handle_worker_req_message`` (+ reply
  encoding), exactly what its socket loops call;
- kvpool: ``protocol.decode`` then ``ControllerService.handle_push`` / ``handle_request`` (+
  reply encoding), what ``server.py``'s loops call.

Messages are counted like ``controller_benchmark`` (a batch counts its events, a lookup its
hashes). Time is the thread's CPU time; each side runs in its own process.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

OPS = {"admit": 35, "evict": 29, "p2p_lookup": 35}


def _frames(
    instances: int, keys: int, n_ops: int, batch: int, hashes: int
) -> list[tuple[str, bytes, int]]:
    from lmcache.v1.cache_controller import message as lm

    rng = random.Random(7)
    names = [f"instance_{i}" for i in range(instances)]
    seq = dict.fromkeys(names, 0)
    deck = [op for op, share in OPS.items() for _ in range(share)]
    out: list[tuple[str, bytes, int]] = []
    for i in range(n_ops):
        op = deck[i % len(deck)] if i >= len(deck) else rng.choice(deck)
        inst = rng.choice(names)
        if op == "p2p_lookup":
            msg: Any = lm.BatchedP2PLookupMsg(
                [rng.choice(range(keys)) for _ in range(hashes)], inst, 0
            )
            out.append(("req", msgspec.msgpack.encode(msg), hashes))
            continue
        kind = lm.OpType.ADMIT if op == "admit" else lm.OpType.EVICT
        events = []
        for _ in range(batch):
            events.append(lm.KVOpEvent(kind, rng.randrange(keys), seq[inst]))
            seq[inst] += 1
        out.append(
            (
                "push",
                msgspec.msgpack.encode(
                    lm.BatchedKVOperationMsg(inst, 0, "LocalCPUBackend", events)
                ),
                batch,
            )
        )
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def side_lmcache(params: dict[str, Any]) -> dict[str, float]:
    from lmcache.v1.cache_controller import message as lm
    from lmcache.v1.cache_controller.controller_manager import LMCacheControllerManager

    frames = _frames(**params)

    async def go() -> float:
        urls = {"pull": f"127.0.0.1:{_free_port()}", "reply": f"127.0.0.1:{_free_port()}"}
        manager = LMCacheControllerManager(urls, -1, 300)
        for i in range(params["instances"]):
            reg = lm.RegisterMsg(f"instance_{i}", 0, "127.0.0.1", _free_port(), f"peer-{i}")
            await manager.handle_worker_req_message(reg)
        decode = msgspec.msgpack.decode
        encode = msgspec.msgpack.encode
        spent = {"push": 0.0, "req": 0.0}
        clock = time.thread_time
        for where, frame, _ in frames:
            t0 = clock()
            msg = decode(frame, type=lm.Msg)
            if where == "push":
                await manager.handle_worker_message(msg)
            else:
                encode(await manager.handle_worker_req_message(msg))
            spent[where] += clock() - t0
        manager.close()
        return spent

    return _summary(frames, asyncio.run(go()))


def _summary(frames: list[tuple[str, bytes, int]], spent: dict[str, float]) -> dict[str, float]:
    total = spent["push"] + spent["req"]
    events = sum(n for where, _, n in frames if where == "push")
    lookups = sum(1 for where, _, _ in frames if where == "req")
    return {
        "msgs_per_s": sum(n for *_, n in frames) / total,
        "seconds": total,
        "kv_events_per_s": events / spent["push"],
        "p2p_lookup_us": spent["req"] / max(lookups, 1) * 1e6,
    }


def side_ours(params: dict[str, Any]) -> dict[str, float]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from kvpool.controller.service import ControllerService
    from kvpool.controller.settings import ControllerSettings
    from kvpool.protocol import lmcache_codec as codec

    frames = _frames(**params)
    svc = ControllerService(ControllerSettings(monitor_ports={"pull": 0}))
    for i in range(params["instances"]):
        svc.register(f"instance_{i}", 0, "127.0.0.1", 1, f"peer-{i}")
    spent = {"push": 0.0, "req": 0.0}
    clock = time.thread_time
    for where, frame, _ in frames:
        t0 = clock()
        msg = codec.decode(frame)
        if where == "push":
            svc.handle_push(msg)
        else:
            codec.encode(svc.handle_request(msg))
        spent[where] += clock() - t0
    return _summary(frames, spent)


SIDES = {"lmcache": side_lmcache, "ours": side_ours}


def run(quick: bool) -> dict[str, Any]:
    params = {
        "instances": 50,
        "keys": 1_000_000,
        "n_ops": 4_000 if quick else 40_000,
        "batch": 100,
        "hashes": 100,
    }
    results = {}
    for side in ("lmcache", "ours"):
        cmd = [sys.executable, str(Path(__file__).resolve()), side, json.dumps(params)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"capacity side {side} failed:\n{done.stderr[-3000:]}")
        results[side] = json.loads(done.stdout.strip().splitlines()[-1])
    return {
        "params": params,
        "ours": results["ours"],
        "lmcache": results["lmcache"],
        "ratio": results["ours"]["msgs_per_s"] / results["lmcache"]["msgs_per_s"],
    }


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] in SIDES:
        print(json.dumps(SIDES[sys.argv[1]](json.loads(sys.argv[2]))))
    else:
        print(json.dumps(run("--quick" in sys.argv), indent=1))
