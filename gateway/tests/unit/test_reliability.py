"""Circuit breaker, token buckets, backoff and admission: pure timing with a fake clock
(admission uses real asyncio waits, bounded to a fraction of a second)."""

from __future__ import annotations

import asyncio
import random

import pytest

from kvpool.gateway.admission import Admission, once
from kvpool.gateway.errors import GatewayError
from kvpool.gateway.reliability import (
    BreakerState,
    CircuitBreaker,
    KeyedBuckets,
    TokenBucket,
    backoff_s,
)


def test_breaker_opens_after_consecutive_failures_and_recovers_through_one_trial() -> None:
    b = CircuitBreaker(failure_threshold=3, cooldown_s=2.0, max_cooldown_s=5.0)
    for _ in range(2):
        b.failure(0.0)
    assert b.available(0.0)
    b.failure(0.0)
    assert b.state is BreakerState.OPEN and not b.available(1.9)
    assert b.acquire(2.0) and b.state is BreakerState.HALF_OPEN
    assert not b.acquire(2.0)  # one trial at a time
    b.failure(2.1)  # the trial failed: open again, longer
    assert not b.available(5.0) and b.available(6.2)
    assert b.acquire(6.2)
    b.success()
    assert b.state is BreakerState.CLOSED and b.available(6.2)


def test_breaker_success_resets_the_count() -> None:
    b = CircuitBreaker(failure_threshold=2)
    b.failure(0)
    b.success()
    b.failure(0)
    assert b.state is BreakerState.CLOSED


def test_token_bucket_allows_burst_then_rate() -> None:
    bucket = TokenBucket(rate=2.0, burst=3.0)
    assert [bucket.take(0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take(0.0) == pytest.approx(0.5)
    assert bucket.take(0.5) == 0.0


def test_keyed_buckets_are_bounded_and_independent() -> None:
    buckets = KeyedBuckets(rate=1.0, burst=1.0, max_keys=3)
    assert buckets.take("k1", 0.0) == 0.0
    assert buckets.take("k1", 0.0) > 0
    assert buckets.take("k2", 0.0) == 0.0
    for i in range(10):
        buckets.take(f"other{i}", 0.0)
    assert len(buckets) == 3


def test_backoff_grows_and_is_capped() -> None:
    rng = random.Random(1)
    first = [backoff_s(1, 0.05, 1.0, rng) for _ in range(50)]
    late = [backoff_s(10, 0.05, 1.0, rng) for _ in range(50)]
    assert all(0.025 <= x <= 0.05 for x in first)
    assert all(0.5 <= x <= 1.0 for x in late)


async def test_admission_queues_then_refuses_with_retry_after() -> None:
    adm = Admission(max_inflight=2, max_queue=1, queue_timeout_s=0.2)
    await adm.acquire()
    await adm.acquire()
    waiter = asyncio.create_task(adm.acquire())
    await asyncio.sleep(0.01)
    assert adm.waiting == 1
    with pytest.raises(GatewayError) as refused:
        await adm.acquire()  # queue full
    assert refused.value.status == 429 and refused.value.headers["Retry-After"] == "1"
    adm.release()
    await asyncio.wait_for(waiter, 1)
    assert adm.inflight == 2
    with pytest.raises(GatewayError) as timed_out:
        await adm.acquire()  # waits 0.2 s, nobody releases
    assert timed_out.value.status == 429


def test_once_runs_once() -> None:
    calls: list[int] = []
    f = once(lambda: calls.append(1))
    f()
    f()
    assert calls == [1]
