"""The index client's own logic: snapshot at start, deltas applied, a gap → snapshot and
replay, a new controller epoch → resync, controller gone → not usable. The controller side is
scripted (a ZMQ PUB, a ROUTER answering snapshots, an HTTP ``GET /`` with the epoch), with
kvpool.protocol's real wire types, because the test must produce a gap on cue; the real
controller feeds the replica in tests/integration/test_real_workers.py."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import zmq
import zmq.asyncio
from fakes import serving
from fastapi import FastAPI

from kvpool.gateway.index_client import IndexClient
from kvpool.gateway.metrics import GatewayMetrics
from kvpool.protocol import deltas as dl

pytestmark = pytest.mark.timeout(30)


@dataclass
class FakeController:
    epoch: str = "e1"
    seq: int = -1
    keys: dict[str, list[int]] = field(default_factory=dict)  # instance id -> keys
    snapshots: int = 0
    up: bool = True


def snapshot_of(c: FakeController) -> Any:
    return dl.Snapshot(
        c.epoch,
        c.seq,
        [dl.WorkerEntry(iid, 0, "127.0.0.1:1", None) for iid in c.keys],
        [dl.LocationEntry(iid, 0, "LocalCPUBackend", keys) for iid, keys in c.keys.items()],
    )


@contextlib.asynccontextmanager
async def controller(c: FakeController) -> AsyncIterator[tuple[IndexClient, Any]]:
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
    router = ctx.socket(zmq.ROUTER)
    snap_port = router.bind_to_random_port("tcp://127.0.0.1")

    async def answer() -> None:
        while True:
            frames = await router.recv_multipart()
            c.snapshots += 1
            await router.send_multipart([frames[0], b"", dl.encode(snapshot_of(c))])

    app = FastAPI()

    @app.get("/")
    async def root() -> dict[str, str]:
        if not c.up:
            raise RuntimeError("down")
        return {"epoch": c.epoch}

    def publish(op: Any, iid: str, keys: list[int], *, skip: bool = False) -> None:
        c.seq += 1
        if op is dl.DeltaOp.ADMIT:
            c.keys.setdefault(iid, []).extend(keys)
        if not skip:
            delta = dl.Delta(c.seq, op, iid, 0, "LocalCPUBackend", keys)
            pub.send_multipart([dl.TOPIC, dl.encode(dl.DeltaBatch(c.epoch, [delta]))])

    task = asyncio.create_task(answer())
    async with serving(app) as url, httpx.AsyncClient() as http:
        client = IndexClient(
            url, f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{snap_port}", http,
            GatewayMetrics(), poll_interval_s=0.1,
        )  # fmt: skip
        run = asyncio.create_task(client.run())
        try:
            yield client, publish
        finally:
            run.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await run
            client.close()
            task.cancel()
            pub.close(0)
            router.close(0)
            ctx.destroy(0)


async def until(cond: Any, timeout_s: float = 5.0) -> None:
    end = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < end, "condition never held"
        await asyncio.sleep(0.02)


async def test_snapshot_deltas_gap_and_new_epoch() -> None:
    c = FakeController(keys={"a~fp": [1, 2]}, seq=0)
    async with controller(c) as (client, publish):
        await until(lambda: client.in_sync)
        assert (await client.prefix_hits([1, 2, 3]))["a"].hit_chunks == 2
        await asyncio.sleep(0.3)  # the SUB socket has joined
        publish(dl.DeltaOp.ADMIT, "b~fp", [1])
        await until(lambda: client.replica.seq == c.seq)
        hits = await client.prefix_hits([1, 2])
        assert hits["b"].hit_chunks == 1 and hits["a"].hit_chunks == 2
        before = c.snapshots
        publish(dl.DeltaOp.ADMIT, "b~fp", [2], skip=True)  # lost on the wire: a gap
        publish(dl.DeltaOp.ADMIT, "c~fp", [1])
        await until(lambda: c.snapshots > before and client.in_sync and client.replica.seq == c.seq)
        assert (await client.prefix_hits([1, 2]))["b"].hit_chunks == 2  # recovered by snapshot
        assert client.replica.gaps >= 1
        # the controller restarts: a new epoch, an empty index
        c.epoch, c.seq, c.keys = "e2", 0, {"c~fp": [9]}
        await until(lambda: client.in_sync and client.replica.epoch == "e2")
        assert await client.prefix_hits([1, 2]) == {}
        assert (await client.prefix_hits([9]))["c"].hit_chunks == 1
        # the controller goes away: lookups say "unknown" so routing falls back
        c.up = False
        await until(lambda: not client.usable)
        assert await client.prefix_hits([9]) is None


async def test_a_delta_lost_at_the_end_of_a_burst_is_recovered_by_the_quiet_resync(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kvpool.gateway.index_client as ic

    monkeypatch.setattr(ic, "QUIET_RESYNC_S", 0.3)
    c = FakeController(keys={"a~fp": [1]}, seq=0)
    async with controller(c) as (client, publish):
        await until(lambda: client.in_sync)
        publish(dl.DeltaOp.ADMIT, "a~fp", [2], skip=True)  # the last delta is lost; none follows
        await until(lambda: client.replica.seq == c.seq)
        assert (await client.prefix_hits([1, 2]))["a"].hit_chunks == 2
