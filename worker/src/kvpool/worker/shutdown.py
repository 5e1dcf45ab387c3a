"""SIGTERM for a worker: stop being ready, drain in-flight requests, shut the engine down, exit
within a deadline no matter what hangs.

Why this module exists: Kubernetes sends SIGTERM and, after the grace period, SIGKILL. A
worker killed mid-request loses the client's answer; a worker that never exits holds its pod
slot and its NPUs. LMCache 0.5.6 makes the second likely: it leaves non-daemon threads behind
and its close can block on a Redis tier, so a plain interpreter exit waits forever. The
sequence here is bounded at every step, and a watchdog thread ends the process with
``os._exit`` when the deadline passes, even if the event loop itself is stuck.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvpool.worker.server import WorkerRuntime

logger = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_DEADLINE = 3  # the watchdog ended the process: something overran the deadline
ENGINE_MARGIN_S = 0.5  # kept back from the engine's share to stop the HTTP server


@dataclass(frozen=True)
class ShutdownPolicy:
    unready_delay_s: float = 0.0
    drain_timeout_s: float = 20.0
    shutdown_deadline_s: float = 30.0


def hard_exit(code: int) -> None:
    """Flush what we can and leave now (non-daemon threads cannot hold us)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


class GracefulShutdown:
    """Runs the SIGTERM sequence once; a second SIGINT exits at once."""

    def __init__(
        self,
        runtime: WorkerRuntime,
        policy: ShutdownPolicy,
        stop_server: Callable[[], None],
        *,
        exit_fn: Callable[[int], None] = hard_exit,
    ) -> None:
        self.runtime = runtime
        self.policy = policy
        self._stop_server = stop_server
        self._exit = exit_fn
        self._began: float | None = None
        self._task: asyncio.Task[None] | None = None
        self._watchdog: threading.Timer | None = None
        self.done = asyncio.Event()

    @property
    def started(self) -> bool:
        return self._began is not None

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.on_signal, sig)

    def on_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if self.started:
            if sig == signal.SIGINT:
                logger.warning("second %s: exiting now without draining", name)
                self._exit(EXIT_DEADLINE)
            return
        logger.info(
            "%s: draining (%d in flight, drain timeout %.1fs, exit deadline %.1fs)",
            name,
            self.runtime.inflight,
            self.policy.drain_timeout_s,
            self.policy.shutdown_deadline_s,
        )
        self.begin()

    def begin(self) -> None:
        if self.started:
            return
        self._began = time.monotonic()
        self._watchdog = threading.Timer(self.policy.shutdown_deadline_s, self._deadline_passed)
        self._watchdog.daemon = True
        self._watchdog.start()
        self._task = asyncio.get_running_loop().create_task(self.run(), name="kvpool-shutdown")

    def _deadline_passed(self) -> None:
        logger.error(
            "shutdown deadline of %.1fs passed (engine or LMCache threads hung); exiting now",
            self.policy.shutdown_deadline_s,
        )
        self._exit(EXIT_DEADLINE)

    def remaining(self) -> float:
        began = self._began if self._began is not None else time.monotonic()
        return self.policy.shutdown_deadline_s - (time.monotonic() - began)

    async def run(self) -> None:
        rt = self.runtime
        rt.begin_drain()
        try:
            if self.policy.unready_delay_s > 0:
                await asyncio.sleep(min(self.policy.unready_delay_s, self.remaining()))
            drain_for = min(self.policy.drain_timeout_s, self.remaining() - ENGINE_MARGIN_S)
            if await rt.wait_idle(drain_for):
                logger.info("drained: no request in flight")
            else:
                logger.warning(
                    "drain timeout: %d request(s) still in flight are aborted", rt.inflight
                )
            engine_for = max(self.remaining() - ENGINE_MARGIN_S, 0.1)
            if rt.started:
                try:
                    await asyncio.wait_for(rt.engine.shutdown(engine_for), engine_for + 0.2)
                    logger.info("engine %s shut down (stores flushed)", rt.engine.model_name)
                except TimeoutError:
                    logger.error("engine shutdown overran %.1fs; leaving it behind", engine_for)
                except Exception:
                    logger.exception("engine shutdown failed")
        finally:
            self._stop_server()
            self.done.set()

    def cancel_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
