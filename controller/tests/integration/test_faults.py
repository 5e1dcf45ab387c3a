"""Faults end to end: a killed worker, a killed and restarted controller (full sync or Redis),
and a Redis outage. After each, lookups answer what the workers really hold — nothing stale.

Workers are stock LMCache worker processes (``lmcache_side.py``); Redis is Debian's
``redis-server``; the controller is our real process, killed with SIGKILL.
"""

from __future__ import annotations

from typing import Any

import httpx
import msgspec
import redis
import zmq
from conftest import start_redis, wait_until
from lmcache.v1.cache_controller import message as lm

KEYS = [11, 12, 13, 14, 15]


def test_killed_worker_is_purged_after_the_heartbeat_ttl(
    controllers: Any, lmcache_procs: Any
) -> None:
    ctl = controllers("--health-check-interval", "0.5", "--lmcache-worker-timeout", "3")
    dead = lmcache_procs("dead", ctl.ports, KEYS)
    lmcache_procs("alive", ctl.ports, KEYS[:2])
    wait_until(lambda: ctl.hits(KEYS) == {"dead": 5, "alive": 2}, what="both indexed")
    dead.kill()
    dead.wait(10)
    wait_until(lambda: ctl.hits(KEYS) == {"alive": 2}, timeout=10, what="purge of the dead worker")
    assert ctl.metric("kvpool_controller_purges_total") == 1
    infos = ctl.post("/query_worker_info", {"instance_id": "all"})["worker_infos"]
    assert [i["instance_id"] for i in infos] == ["alive"]


def test_controller_restart_without_redis_recovers_by_full_sync(
    controllers: Any, lmcache_procs: Any
) -> None:
    ctl = controllers()
    lmcache_procs("w", ctl.ports, KEYS)
    wait_until(lambda: ctl.hits(KEYS) == {"w": 5}, what="indexed")
    ctl.kill()
    ctl.start()  # same ports, empty memory: it knows nothing until the worker re-syncs
    wait_until(lambda: ctl.hits(KEYS) == {"w": 5}, timeout=20, what="full sync after restart")
    assert ctl.metric('kvpool_controller_full_syncs_total{outcome="completed"}') >= 1


def test_controller_restart_with_redis_reloads_the_index(
    controllers: Any, lmcache_procs: Any, redis_server: dict[str, Any]
) -> None:
    ctl = controllers("--redis-url", redis_server["url"], "--redis-namespace", "t")
    lmcache_procs("w", ctl.ports, KEYS)
    wait_until(lambda: ctl.hits(KEYS) == {"w": 5}, what="indexed")
    r = redis.Redis(port=redis_server["port"])
    wait_until(lambda: r.scard("t:keys:w\x1f0\x1fLocalCPUBackend") == 5, what="write-behind")
    ctl.kill()
    ctl.start()
    assert ctl.hits(KEYS) == {"w": 5}  # reloaded before any heartbeat
    assert ctl.metric('kvpool_controller_full_syncs_total{outcome="started"}') == 0


def _push(ctx: zmq.Context[Any], port: int, *msgs: Any) -> None:
    sock = ctx.socket(zmq.PUSH)
    sock.connect(f"tcp://127.0.0.1:{port}")
    sock.send_multipart([msgspec.msgpack.encode(m) for m in msgs])
    sock.close(linger=2000)


def test_redis_outage_keeps_serving_counts_errors_and_rewrites_on_return(
    controllers: Any, redis_server: dict[str, Any]
) -> None:
    ctl = controllers("--redis-url", redis_server["url"], "--redis-namespace", "o")
    ctx: zmq.Context[Any] = zmq.Context()
    ops = [lm.KVOpEvent(op_type=lm.OpType.ADMIT, key=k, seq_num=i) for i, k in enumerate(KEYS)]
    _push(
        ctx, ctl.ports["pull"],
        lm.RegisterMsg(instance_id="i", worker_id=0, ip="127.0.0.1", port=1, peer_init_url=None),
        lm.BatchedKVOperationMsg(instance_id="i", worker_id=0, location="L", operations=ops[:2]),
    )  # fmt: skip
    wait_until(lambda: ctl.hits(KEYS) == {"i": 2})
    redis_server["proc"].kill()
    redis_server["proc"].wait(10)
    _push(
        ctx,
        ctl.ports["pull"],
        lm.BatchedKVOperationMsg(instance_id="i", worker_id=0, location="L", operations=ops[2:]),
    )
    wait_until(lambda: ctl.hits(KEYS) == {"i": 5}, what="serving from memory during the outage")
    wait_until(
        lambda: ctl.metric("kvpool_controller_persistence_errors_total") >= 1, what="errors counted"
    )
    assert ctl.post("/v1/prefix_lookup", {"hashes": KEYS})["instances"]["i"]["hit_chunks"] == 5
    assert httpx.get(f"{ctl.url}/readyz").json()["redis"] == "unavailable"
    # Redis comes back empty on the same port: the controller rewrites the whole index
    redis_server["proc"] = start_redis(redis_server["port"], redis_server["dir"])
    r = redis.Redis(port=redis_server["port"])
    wait_until(
        lambda: _scard(r, "o:keys:i\x1f0\x1fL") == 5, timeout=15, what="rewrite after the outage"
    )
    ctx.destroy(linger=0)


def _scard(r: redis.Redis, key: str) -> int:
    try:
        return int(r.scard(key))
    except redis.RedisError:
        return -1


def test_redis_restarted_empty_between_writes_gets_the_index_again(
    controllers: Any, redis_server: dict[str, Any]
) -> None:
    """Redis killed and restarted empty while no change was written (the chaos suite's
    redis-kill): no write fails, so nothing marked the store dirty and the index there stayed
    lost (the next controller restart reloaded 0 workers). The marker check rewrites it."""
    ctl = controllers("--redis-url", redis_server["url"], "--redis-namespace", "e")
    ctx: zmq.Context[Any] = zmq.Context()
    ops = [lm.KVOpEvent(op_type=lm.OpType.ADMIT, key=k, seq_num=i) for i, k in enumerate(KEYS)]
    _push(
        ctx, ctl.ports["pull"],
        lm.RegisterMsg(instance_id="i", worker_id=0, ip="127.0.0.1", port=1, peer_init_url=None),
        lm.BatchedKVOperationMsg(instance_id="i", worker_id=0, location="L", operations=ops),
    )  # fmt: skip
    ctx.destroy(linger=0)
    r = redis.Redis(port=redis_server["port"])
    wait_until(lambda: _scard(r, "e:keys:i\x1f0\x1fL") == 5, what="write-behind")
    redis_server["proc"].kill()
    redis_server["proc"].wait(10)
    redis_server["proc"] = start_redis(redis_server["port"], redis_server["dir"])
    # empty now, and no change is on its way to it
    wait_until(
        lambda: _scard(r, "e:keys:i\x1f0\x1fL") == 5 and r.hlen("e:workers") == 1,
        timeout=15,
        what="the index rewritten into the restarted Redis",
    )
    ctl.kill()
    ctl.start()  # and a restart reloads it, before any worker re-syncs
    assert ctl.hits(KEYS) == {"i": 5}
