"""The server's loops in process: requests answered inside a push drain, the index sweep loop.

Real ZMQ sockets on 127.0.0.1 (the server binds random ports), no controller process: the
drain is called directly, so what is checked is the order of handling, not a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest
import zmq

from kvpool.controller.server import ControllerServer
from kvpool.controller.settings import ControllerSettings
from kvpool.protocol import lmcache_codec as codec
from kvpool.protocol import lmcache_wire as p

CPU = "LocalCPUBackend"


@pytest.fixture
async def server() -> AsyncIterator[ControllerServer]:
    srv = ControllerServer(
        ControllerSettings(host="127.0.0.1", monitor_ports={"pull": 0, "reply": 0})
    )
    srv.bind()
    yield srv
    await srv.close()


def _batch(keys: list[int], first_seq: int) -> bytes:
    ops = [p.KVOpEvent(p.OpType.ADMIT, k, first_seq + i) for i, k in enumerate(keys)]
    return codec.encode(p.BatchedKVOperationMsg("a", 0, CPU, ops))


def _wait_for_input(sock: zmq.Socket[bytes]) -> None:
    deadline = time.monotonic() + 10
    while not cast(int, sock.get(zmq.EVENTS)) & zmq.POLLIN:
        assert time.monotonic() < deadline, "frames never arrived"
        time.sleep(0.01)


async def test_a_lookup_is_answered_between_two_push_frames(server: ControllerServer) -> None:
    server.service.register("a", 0, "127.0.0.1", 1, "peer-a")
    ctx: zmq.Context[Any] = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{server.ports['pull']}")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 10_000)  # no answer inside the drain: Again, not a hang
    dealer.connect(f"tcp://127.0.0.1:{server.ports['reply']}")
    try:
        frames = 20
        for i in range(frames):  # the last batch is the only one holding key 10_000
            push.send(
                _batch(
                    [i * 10 + k for k in range(10)] + ([10_000] if i == frames - 1 else []), i * 11
                )
            )
        _wait_for_input(server._shadows["pull"])
        dealer.send_multipart([b"", codec.encode(p.BatchedP2PLookupMsg([10_000], "b", 0))])
        _wait_for_input(server._shadows["reply"])
        urgent = [("reply", server._shadows["reply"], server._on_request)]
        server._drain("pull", server._on_push, float("inf"), urgent)
        reply = codec.decode(dealer.recv_multipart()[-1])
        # answered after the first push frame, before the last batch was applied
        assert reply == p.BatchedP2PLookupRetMsg([("", "", 0, "")])
        deadline = time.monotonic() + 10
        while len(server.service.index) < frames * 10 + 1:  # the rest of the burst
            assert time.monotonic() < deadline
            server._drain("pull", server._on_push, float("inf"), urgent)
        assert server.service.index.worker_keys("a", 0, CPU).count(10_000) == 1
    finally:
        ctx.destroy(linger=0)


async def test_the_sweep_loop_clears_a_purged_worker(server: ControllerServer) -> None:
    svc = server.service
    svc.register("a", 0, "127.0.0.1", 1, "peer-a")
    svc.register("b", 0, "127.0.0.1", 2, "peer-b")
    svc.index.admit("a", 0, CPU, list(range(10_000)))
    svc.index.admit("b", 0, CPU, list(range(5_000)))
    assert svc.deregister("a", 0, "test")
    assert svc.index.sweep(0) == 10_000  # purged at once, nothing swept yet
    assert svc.index.prefix_hits([0, 1])["b"].hit_chunks == 2
    task = asyncio.create_task(server._sweep_loop())
    try:
        for _ in range(200):
            if svc.index.sweep(0) == 0:
                break
            await asyncio.sleep(0.01)
        assert svc.index.sweep(0) == 0
        assert svc.index.stats()["chunks"] == 5_000
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
