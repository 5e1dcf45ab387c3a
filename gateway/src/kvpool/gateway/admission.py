"""Admission control: a bounded number of requests upstream, a bounded queue, then 429.

Why this module exists: a gateway that accepts everything under overload turns a traffic
spike into unbounded memory and timeouts for everyone. At most ``max_inflight`` requests are
sent upstream at once; up to ``max_queue`` more wait (each at most ``queue_timeout_s``);
beyond that a request is refused at once with 429 and ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

from kvpool.gateway.errors import GatewayError


def saturated(message: str, retry_after_s: float) -> GatewayError:
    return GatewayError(
        message,
        status=429,
        type_="rate_limit_error",
        code="saturated",
        headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))},
    )


class Admission:
    """A semaphore with a bounded, timed wait."""

    def __init__(self, max_inflight: int, max_queue: int, queue_timeout_s: float) -> None:
        self.max_inflight = max_inflight
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self._sem = asyncio.Semaphore(max_inflight)
        self.waiting = 0
        self.inflight = 0

    async def acquire(self) -> None:
        """Take a slot, waiting in the queue if there is room; raise 429 otherwise."""
        if self._sem.locked():
            if self.waiting >= self.max_queue:
                raise saturated(
                    f"the gateway is saturated ({self.inflight} requests in flight, "
                    f"{self.waiting} queued); retry later",
                    1.0,
                )
            self.waiting += 1
            try:
                await asyncio.wait_for(self._sem.acquire(), self.queue_timeout_s)
            except TimeoutError:
                raise saturated(
                    f"no upstream slot freed within {self.queue_timeout_s:g}s; retry later",
                    self.queue_timeout_s / 2,
                ) from None
            finally:
                self.waiting -= 1
        else:
            await self._sem.acquire()
        self.inflight += 1

    def release(self) -> None:
        self.inflight -= 1
        self._sem.release()


def once(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` guarded to run at most once (a slot is released exactly once)."""
    done = False

    def run() -> None:
        nonlocal done
        if not done:
            done = True
            fn()

    return run
