"""How far the controller trails, from inside: the event loop's lateness and the PULL backlog;
and refusal reasons exported at 0 before the first refusal (an alert needs the series).

A real ControllerServer on 127.0.0.1 (random ports) fed by a real ZMQ PUSH socket; each test is
bounded by its own deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import zmq
import zmq.asyncio

from kvpool.controller.metrics import Metrics
from kvpool.controller.server import ControllerServer
from kvpool.controller.settings import ControllerSettings


def _sample(text: str, line_start: str) -> float:
    for line in text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{line_start} not exported:\n{text}")


def test_refusal_reasons_are_exported_before_the_first_refusal() -> None:
    text = Metrics().render().decode()
    assert _sample(text, 'kvpool_controller_refusals_total{reason="fingerprint"}') == 0.0
    assert _sample(text, "kvpool_controller_backlog_seconds_total") == 0.0


async def test_loop_lag_observes_how_late_a_tick_ran() -> None:
    metrics = Metrics()
    task = asyncio.create_task(metrics.watch_loop_lag(tick_s=0.01))
    try:
        await asyncio.sleep(0.05)
        time.sleep(0.2)  # the loop is blocked: the pending tick wakes ~0.2 s late
        await asyncio.sleep(0.05)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    text = metrics.render().decode()
    assert _sample(text, "kvpool_controller_loop_lag_seconds_count") >= 2
    assert _sample(text, "kvpool_controller_loop_lag_seconds_sum") >= 0.15
    assert _sample(text, 'kvpool_controller_loop_lag_seconds_bucket{le="0.1"}') >= 1


async def test_a_backlog_on_the_pull_socket_is_counted_until_it_drains() -> None:
    """One frame per drain pass (drain_batch 1) and 300 queued: every pass but the last ends
    with messages waiting, so the backlog time grows; once drained it stops growing."""
    settings = ControllerSettings(  # type: ignore[call-arg]
        host="127.0.0.1", monitor_ports={"pull": 0}, drain_batch=1
    )
    server = ControllerServer(settings)
    port = server.bind()["pull"]
    ctx = zmq.asyncio.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    n = 300
    try:
        for _ in range(n):
            await push.send(b"not msgpack")  # decoded and refused: bad_input counts each
        serve = asyncio.create_task(server.serve())
        metrics = server.service.metrics
        deadline = time.monotonic() + 30
        while sum(metrics.bad_input.values()) < n:
            assert time.monotonic() < deadline, metrics.bad_input
            await asyncio.sleep(0.01)
        behind = metrics.backlog_seconds
        assert behind > 0
        await asyncio.sleep(0.2)
        assert metrics.backlog_seconds == behind  # drained: nothing is waiting any more
        serve.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await serve
    finally:
        push.close(linger=0)
        ctx.term()
        await server.close()
