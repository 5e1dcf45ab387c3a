"""Finalizers against the emulated API server and the real controller's HTTP API.

Deleting a member deregisters its instances from the pool's controller (kvpool-controller's
FastAPI app, served by uvicorn on 127.0.0.1) before its workers are pruned; deleting a pool
waits for its members. The emulator does no garbage collection (see test_reconcile.py), so
"workers gone" is the operator's own prune, which a cluster's GC would duplicate.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import uvicorn
from apiserver import ApiServer
from harness import Client, OperatorThread, eventually, example
from test_reconcile import CMS, DEPLOY, EVENTS, P2PGS, POOLS, STS, condition, observed, one

from kvpool.controller.api import create_app
from kvpool.controller.server import ControllerServer
from kvpool.controller.settings import ControllerSettings
from kvpool.protocol import lmcache_wire as p


@pytest.fixture
async def controller() -> AsyncIterator[tuple[str, ControllerServer]]:
    server = ControllerServer(ControllerSettings(host="127.0.0.1", monitor_ports={"pull": 0}))
    config = uvicorn.Config(
        create_app(server), host="127.0.0.1", port=0, log_level="warning", lifespan="off"
    )
    web = uvicorn.Server(config)
    task = asyncio.create_task(web.serve())
    await eventually(lambda: web.started, what="controller HTTP API")
    port = web.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", server
    web.should_exit = True
    await task
    await server.close()


@pytest.fixture
def settings_overrides(controller: tuple[str, ControllerServer]) -> dict[str, Any]:
    return {"controller_url": controller[0]}


async def test_member_delete_deregisters_instances_before_its_workers_go(
    apiserver: ApiServer,
    client: Client,
    operator: OperatorThread,
    controller: tuple[str, ControllerServer],
) -> None:
    svc = controller[1].service
    pool, p2p, pd = example("cpu-demo")
    for doc in (pool, p2p, pd):
        await client.create(doc)
    await eventually(lambda: observed(apiserver, P2PGS, "demo-p2p"))
    ids = [i["lmcacheInstanceId"] for i in one(apiserver, P2PGS, "demo-p2p")["status"]["instances"]]
    for n, iid in enumerate(ids):
        svc.handle_request(p.RegisterMsg(iid, 0, "10.0.0.1", 7000 + n, "peer"))
    svc.handle_request(p.RegisterMsg("demo-pd-prefill-0~x", 0, "10.0.0.2", 7000, "peer"))
    assert "kvpool.io/finalizer" in one(apiserver, P2PGS, "demo-p2p")["metadata"]["finalizers"]
    await client.delete("P2PGroup", "demo-p2p")
    await eventually(lambda: not apiserver.live(P2PGS))
    assert svc.registry.instances() == ["demo-pd-prefill-0~x"]
    assert not [o for o in apiserver.live(STS) if o["metadata"]["name"].startswith("demo-p2p")]
    assert "demo-p2p" not in one(apiserver, CMS, "demo-gateway")["data"]["gateway.yaml"]
    assert not [e for e in apiserver.live(EVENTS) if e["reason"] == "DeregisterFailed"]


async def test_pool_delete_waits_for_its_members(
    apiserver: ApiServer, client: Client, operator: OperatorThread
) -> None:
    pool, p2p, _ = example("cpu-demo")
    for doc in (pool, p2p):
        await client.create(doc)
    await eventually(lambda: observed(apiserver, P2PGS, "demo-p2p"))
    await client.delete("KVCachePool", "demo")
    await eventually(
        lambda: condition(one(apiserver, POOLS, "demo"), "Ready")["reason"] == "DeletionBlocked"
    )
    assert "P2PGroup/demo-p2p" in condition(one(apiserver, POOLS, "demo"), "Ready")["message"]
    await eventually(
        lambda: [e for e in apiserver.live(EVENTS) if e["reason"] == "DeletionBlocked"]
    )
    assert apiserver.live(DEPLOY)
    await client.delete("P2PGroup", "demo-p2p")
    await eventually(lambda: not apiserver.live(POOLS), timeout=10)
    assert apiserver.live(DEPLOY) == [] and apiserver.live(STS) == []
