"""The Redis tier through the real LMCache engine and a real redis-server (started by conftest).

KV round trip per tier at the offload level, a second worker process reading what the first
stored, a corrupted or truncated value being a miss (never wrong KV), remote eviction, and
Redis going down while requests keep being served from the local tier.
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import redis
import torch

from kvpool.worker.engine.offload import LMCacheOffload


def remote_only(url: str) -> dict[str, Any]:
    return {"local_cpu": False, "remote_url": url, "remote_serde": "naive"}


def tokens_for(seed: int, n: int = 800) -> list[int]:
    return torch.randint(3, 8000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def rows(kv: Sequence[torch.Tensor], slots: torch.Tensor) -> list[torch.Tensor]:
    return [layer.view(2, -1, *layer.shape[3:])[:, slots] for layer in kv]


def assert_rows(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def test_round_trip_and_second_process_are_bit_exact(
    make_offload: Callable[..., LMCacheOffload],
    paged_kv: Callable[..., Any],
    redis_url: str,
    second_worker: Callable[..., dict[str, Any]],
) -> None:
    off = make_offload(remote_only(redis_url))
    src, dst = paged_kv(seed=1), paged_kv(zeros=True)
    tokens = tokens_for(1)
    slots = torch.randperm(2048)[:800]
    off.store(tokens, src, slots)
    assert off.flush(10)
    other = torch.randperm(2048)[:800]
    assert off.retrieve(tokens, 768, dst, other) == 768
    assert_rows(rows(src, slots[:768]), rows(dst, other[:768]))
    got = second_worker(remote_only(redis_url), tokens, other.tolist())
    assert (got["hit"], got["loaded"]) == (768, 768)
    assert_rows(rows(src, slots[:768]), got["rows"])
    assert got["metrics"]["loaded_bytes.redis"] == 768 * off._payload_bytes_per_token


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_value_in_redis_is_a_miss(
    make_offload: Callable[..., LMCacheOffload],
    paged_kv: Callable[..., Any],
    redis_url: str,
    damage: str,
) -> None:
    off = make_offload(remote_only(redis_url))
    src, dst = paged_kv(seed=2), paged_kv(zeros=True)
    tokens = tokens_for(2 if damage == "flip" else 3)
    slots = torch.arange(800)
    off.store(tokens, src, slots)
    assert off.flush(10)
    client = redis.Redis.from_url(redis_url)
    key = off.chunk_keys(tokens)[1] + "kv_bytes"
    value = bytearray(client.get(key) or b"")
    assert len(value) > 1000
    if damage == "flip":
        value[len(value) // 2] ^= 0x40
        client.set(key, bytes(value))
    else:
        client.set(key, bytes(value[: len(value) // 3]))
    loaded = off.retrieve(tokens, 768, dst, slots + 1000)
    assert loaded in ((256,) if damage == "flip" else (0, 256))
    assert_rows(rows(src, slots[:loaded]), rows(dst, slots[:loaded] + 1000))
    assert all(torch.count_nonzero(r) == 0 for r in rows(dst, slots[256:768] + 1000))
    if damage == "flip":
        assert off.metrics()["corrupt_chunks"] == 1
        assert client.exists(key) == 0  # dropped from the shared tier
        assert off.lookup(tokens) == 256


def test_evict_from_redis_removes_the_chunks(
    make_offload: Callable[..., LMCacheOffload], paged_kv: Callable[..., Any], redis_url: str
) -> None:
    off = make_offload(remote_only(redis_url))
    tokens = tokens_for(4)
    off.store(tokens, paged_kv(seed=4), torch.arange(800))
    assert off.flush(10)
    assert off.lookup(tokens) == 768
    assert off.evict(token_ids=tokens, locations=["redis"]) == 3
    assert off.lookup(tokens) == 0
    client = redis.Redis.from_url(redis_url)
    assert not any(client.exists(k + "kv_bytes") for k in off.chunk_keys(tokens))


def test_redis_down_is_skipped_and_requests_are_served(
    make_offload: Callable[..., LMCacheOffload],
    paged_kv: Callable[..., Any],
    private_redis: tuple[str, subprocess.Popen[bytes]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    url, proc = private_redis
    off = make_offload(
        {"local_cpu": True, "remote_url": url, "remote_serde": "naive"}, probe_interval_s=0.05
    )
    src, dst = paged_kv(seed=5), paged_kv(zeros=True)
    a, b = tokens_for(5), tokens_for(6)
    off.store(a, src, torch.arange(800))
    assert off.flush(10)
    proc.kill()
    proc.wait(5)
    time.sleep(0.1)
    caplog.set_level(logging.WARNING)
    t0 = time.monotonic()
    assert off.retrieve(a, 768, dst, torch.arange(800) + 1000) == 768  # from local_cpu
    off.store(b, src, torch.arange(800))
    assert off.lookup(b) == 768
    assert time.monotonic() - t0 < 5.0
    assert_rows(rows(src, torch.arange(768)), rows(dst, torch.arange(768) + 1000))
    m = off.metrics()
    assert m["tier_up.redis"] == 0.0
    assert m["tier_errors.redis"] >= 1
    assert off.memory_stats()["tiers"]["redis"]["up"] is False  # type: ignore[index]
    assert any(
        "tier redis" in r.getMessage() and "unreachable" in r.getMessage() for r in caplog.records
    )
    t0 = time.monotonic()
    off.close(10)  # LMCache's own close deadlocks with Redis (dead or alive); ours does not
    assert off.closed_cleanly
    assert time.monotonic() - t0 < 5.0
