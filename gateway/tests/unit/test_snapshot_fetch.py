"""The snapshot fetch the gateway's index client and the controller's standby share
(:func:`kvpool.protocol.snapshot_fetch.fetch_snapshot`), against a real ROUTER on 127.0.0.1."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from kvpool.protocol import deltas as dl
from kvpool.protocol.snapshot_fetch import fetch_snapshot

SNAP = dl.Snapshot("e1", 7, [], [dl.LocationEntry("a", 0, "LocalCPUBackend", [1, 2])], term=2)


async def test_a_snapshot_comes_back_and_each_dealer_is_closed() -> None:
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    requests: list[list[bytes]] = []

    async def serve() -> None:
        while True:
            frames = await router.recv_multipart()
            requests.append(frames[1:])
            await router.send_multipart([frames[0], b"", dl.encode(SNAP)])

    server = asyncio.create_task(serve())
    try:
        dealers = [ctx.socket(zmq.DEALER) for _ in range(2)]
        for dealer in dealers:
            got = await fetch_snapshot(dealer, f"tcp://127.0.0.1:{port}", 5.0)
            assert got == SNAP
            assert dealer.closed
        assert requests == [[b"", dl.SNAPSHOT_REQUEST]] * 2
    finally:
        server.cancel()
        router.close(linger=0)
        ctx.term()


async def test_no_reply_times_out_and_still_closes_the_dealer() -> None:
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)  # bound, never answers
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    try:
        with pytest.raises(TimeoutError):
            await fetch_snapshot(dealer, f"tcp://127.0.0.1:{port}", 0.2)
        assert dealer.closed
    finally:
        router.close(linger=0)
        ctx.term()
