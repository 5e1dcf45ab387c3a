"""Each HTTP router mounted alone on a bare app, and the orchestration table's coverage."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import APIRouter, FastAPI

from kvpool.controller import routes_kvpool, routes_lmcache, routes_ops
from kvpool.controller.orchestration import OPERATIONS, handle_orchestration
from kvpool.controller.server import ControllerServer
from kvpool.controller.settings import ControllerSettings
from kvpool.protocol import lmcache_wire as p


@pytest.fixture
async def server() -> AsyncIterator[ControllerServer]:
    srv = ControllerServer(ControllerSettings(host="127.0.0.1", monitor_ports={"pull": 0}))
    yield srv
    await srv.close()


def _client(server: ControllerServer, router: APIRouter) -> httpx.AsyncClient:
    app = FastAPI()
    app.state.server = server
    app.include_router(router)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


def test_the_table_answers_every_orchestration_message_once() -> None:
    assert sorted(op.msg.__name__ for op in OPERATIONS) == sorted(
        m.__name__ for m in p.ORCH_REQUESTS
    )
    assert len({op.path for op in OPERATIONS}) == len(OPERATIONS)


async def test_lmcache_router_alone(server: ControllerServer) -> None:
    svc = server.service
    svc.register("a", 0, "10.0.0.1", 7000, "peer-a")
    svc.register("a", 1, "10.0.0.1", 7001, "peer-a1")
    async with _client(server, routes_lmcache.router()) as c:
        r = await c.post("/query_instance", json={"ip": "10.0.0.1"})
        assert r.status_code == 200 and r.json()["res"] == "a"
        r = await c.post("/query_worker_info", json={"instance_id": "a", "worker_ids": [1]})
        [info] = r.json()["worker_infos"]
        assert (info["worker_id"], info["port"]) == (1, 7001)
        assert (await c.post("/lookup", json={"tokens": [1, 2]})).json()["layout_info"] == {}
        r = await c.post("/pin", json={"instance_id": "ghost", "location": "L", "tokens": [1]})
        assert r.status_code == 500 and "ghost" in r.json()["detail"]
        assert (await c.post("/clear", json={"instance_id": "a"})).status_code == 422


async def test_lmcache_router_refuses_tokens_it_cannot_hash() -> None:
    # vLLM's NONE_HASH needs the domain's PYTHONHASHSEED; without it tokens cannot be hashed
    settings = ControllerSettings(monitor_ports={"pull": 0}, vllm=True, hash_seed=None)
    server = ControllerServer(settings)
    assert settings.tokens_lookup_error is not None
    async with _client(server, routes_lmcache.router()) as c:
        r = await c.post("/lookup", json={"tokens": [1, 2]})
        assert r.status_code == 400 and "PYTHONHASHSEED" in r.json()["detail"]
    await server.close()


async def test_zmq_and_http_share_the_operation(server: ControllerServer) -> None:
    reply = await handle_orchestration(server.service, p.QueryInstMsg("e1", "nowhere"))
    assert isinstance(reply, p.QueryInstRetMsg) and reply.event_id == "e1"
    assert server.service.event_status("e1") == "finished"
    failed = await handle_orchestration(server.service, p.ClearMsg("e2", "ghost", "L"))
    assert isinstance(failed, p.ErrorMsg) and "ghost" in failed.error
    assert server.service.event_status("e2") == "failed"


async def test_kvpool_router_alone(server: ControllerServer) -> None:
    svc = server.service
    svc.register("a", 0, "10.0.0.1", 7000, "peer-a")
    svc.index.admit("a", 0, "LocalCPUBackend", [11, 12])
    async with _client(server, routes_kvpool.router) as c:
        r = await c.post("/v1/prefix_lookup", json={"hashes": [11, 12, 13]})
        assert r.json()["instances"]["a"]["hit_chunks"] == 2
        r = await c.post("/v1/deregister", json={"instance_id": "a"})
        assert r.json() == {"instance_id": "a", "deregistered": 1}
        assert (await c.post("/v1/prefix_lookup", json={"hashes": [11]})).json()["instances"] == {}


async def test_ops_router_alone(server: ControllerServer) -> None:
    async with _client(server, routes_ops.router) as c:
        assert (await c.get("/")).json()["service"] == "kvpool-controller"
        assert "kvpool_controller_workers" in (await c.get("/metrics")).text
        assert (await c.get("/healthz")).json() == {"status": "ok"}
        r = await c.get("/readyz")
        assert r.status_code == 503 and r.json()["ready"] is False


async def test_stats_names_registered_instances_tiers_and_refusals() -> None:
    settings = ControllerSettings(
        host="127.0.0.1", monitor_ports={"pull": 0}, fingerprint="0123456789ab"
    )
    server = ControllerServer(settings)
    svc = server.service
    svc.register("a~0123456789ab", 0, "10.0.0.1", 7000, None)
    svc.register("a~0123456789ab", 1, "10.0.0.1", 7001, None)
    assert svc.register("b~ffffffffffff", 0, "10.0.0.2", 7000, None) is not None
    svc.index.admit("a~0123456789ab", 0, "LocalCPUBackend", [11, 12])
    svc.index.admit("a~0123456789ab", 1, "LocalCPUBackend", [11, 12])
    svc.index.admit("a~0123456789ab", 0, "LocalDiskBackend", [13])
    async with _client(server, routes_kvpool.router) as c:
        body = (await c.get("/v1/stats")).json()
    assert body["instances"] == {"a~0123456789ab": 2}
    assert body["chunks"] == 3
    assert body["chunk_locations"] == {"LocalCPUBackend": 4, "LocalDiskBackend": 1}
    assert body["refusals"] == {"fingerprint": 1, "unknown_instance": 0}
    assert list(body["refused"]) == ["b~ffffffffffff"]
    assert "0123456789ab" in body["refused"]["b~ffffffffffff"]
    await server.close()
