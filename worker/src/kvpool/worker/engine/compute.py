"""One daemon compute thread that the engine's asyncio loop hands blocking work to.

Why this module exists: model steps and LMCache calls block for milliseconds to seconds and
must run off the event loop, one at a time (the paged caches are not locked). The obvious
``asyncio.to_thread`` uses the loop's default executor, whose worker threads are joined at
loop shutdown and interpreter exit; LMCache 0.5.6's close can hang (a Redis tier), which
would turn a bounded SIGTERM drain into a hang. A daemon thread with a job queue gives the
same one-at-a-time semantics, keeps submission order, and never blocks process exit.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

_Job = tuple[Callable[[], Any], asyncio.AbstractEventLoop, "asyncio.Future[Any]"]


def _resolve(fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if fut.cancelled():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


_live: weakref.WeakSet[ComputeThread] = weakref.WeakSet()


@atexit.register
def _stop_at_exit() -> None:
    """Engines that were never shut down: let their threads leave before the interpreter
    tears down (bounded, so a hung job cannot hold the exit)."""
    threads = list(_live)
    for compute in threads:
        compute.stop()
    for compute in threads:
        compute._thread.join(timeout=2.0)


class ComputeThread:
    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._busy_since: float | None = None  # monotonic start of the running job
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()
        _live.add(self)

    async def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the compute thread after every earlier job; cancelling the await
        drops the result (the job itself cannot be interrupted)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self._jobs.put((fn, loop, fut))
        return await fut

    def stop(self) -> None:
        """Let the thread exit after the jobs already queued."""
        self._jobs.put(None)

    async def join(self, timeout_s: float) -> bool:
        """Wait (without blocking the loop) up to ``timeout_s`` for the thread to exit after
        stop(); True if it did. A thread that ran torch ops and is still alive when the
        interpreter exits can abort the process ("terminate called without an active
        exception"), so shutdown joins it when it can."""
        deadline = time.monotonic() + timeout_s
        while self._thread.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def busy_s(self) -> float:
        """Seconds the running job has taken so far; 0.0 when idle."""
        since = self._busy_since
        return 0.0 if since is None else time.monotonic() - since

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, loop, fut = job
            result: Any = None
            error: BaseException | None = None
            self._busy_since = time.monotonic()
            try:
                result = fn()
            except BaseException as exc:  # handed to the awaiting coroutine
                error = exc
            self._busy_since = None
            try:
                loop.call_soon_threadsafe(_resolve, fut, result, error)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                logger.debug("compute job finished after its event loop closed")
