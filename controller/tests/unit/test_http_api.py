"""The HTTP app in process (``httpx.ASGITransport``, no sockets bound): shapes and bad input."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from kvpool.controller.api import create_app
from kvpool.controller.server import ControllerServer
from kvpool.controller.settings import ControllerSettings
from kvpool.protocol import lmcache_wire as p


@pytest.fixture
async def client() -> AsyncIterator[tuple[httpx.AsyncClient, ControllerServer]]:
    server = ControllerServer(ControllerSettings(host="127.0.0.1", monitor_ports={"pull": 0}))
    transport = httpx.ASGITransport(app=create_app(server))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        yield c, server
    await server.close()


async def test_prefix_lookup_by_hashes_and_by_tokens(
    client: tuple[httpx.AsyncClient, ControllerServer],
) -> None:
    c, server = client
    svc = server.service
    svc.handle_request(p.RegisterMsg("a", 0, "10.0.0.1", 7000, "peer-a"))
    tokens = list(range(600))
    hashes = svc.token_hashes(tokens)
    ops = [p.KVOpEvent(p.OpType.ADMIT, h, i) for i, h in enumerate(hashes[:2])]
    svc.handle_push(p.BatchedKVOperationMsg("a", 0, "LocalCPUBackend", ops))
    by_hash = (await c.post("/v1/prefix_lookup", json={"hashes": hashes})).json()
    assert by_hash["chunks"] == 3
    inst = by_hash["instances"]["a"]
    assert inst["hit_chunks"] == 2 and inst["per_location"] == {"LocalCPUBackend": 2}
    assert inst["workers"] == [
        {
            "worker_id": 0,
            "url": "10.0.0.1:7000",
            "peer_init_url": "peer-a",
            "holds_first_chunk": True,
        }
    ]
    by_tokens = (await c.post("/v1/prefix_lookup", json={"tokens": tokens})).json()
    assert by_tokens == by_hash
    lookup = (await c.post("/lookup", json={"tokens": tokens})).json()
    assert lookup["layout_info"] == {"a": ["LocalCPUBackend", 512]}


@pytest.mark.parametrize("body", [{}, {"hashes": [1], "tokens": [1]}])
async def test_prefix_lookup_rejects_ambiguous_bodies(
    client: tuple[httpx.AsyncClient, ControllerServer], body: dict[str, list[int]]
) -> None:
    c, _ = client
    r = await c.post("/v1/prefix_lookup", json=body)
    assert r.status_code == 422
    assert "exactly one of 'hashes'" in r.text


async def test_control_on_unknown_instance_is_a_500_naming_it(
    client: tuple[httpx.AsyncClient, ControllerServer],
) -> None:
    c, _ = client
    r = await c.post("/clear", json={"instance_id": "ghost", "location": "LocalCPUBackend"})
    assert r.status_code == 500 and "ghost" in r.json()["detail"]
    assert (await c.post("/check_finish", json={"event_id": "nope"})).json() == {
        "status": "not_found"
    }


async def test_metrics_health_and_readiness(
    client: tuple[httpx.AsyncClient, ControllerServer],
) -> None:
    c, server = client
    server.service.handle_push(p.DeRegisterMsg("ghost", 0, "h", 1))
    text = (await c.get("/metrics")).text
    for name in (
        "kvpool_controller_workers",
        "kvpool_controller_messages_total",
        'kvpool_controller_bad_input_total{kind="unknown_worker"} 1.0',
        "kvpool_controller_purges_total",
        "kvpool_controller_refusals_total",
        "kvpool_controller_lookup_seconds_bucket",
    ):
        assert name in text, name
    assert (await c.get("/healthz")).json() == {"status": "ok"}
    assert (await c.get("/readyz")).status_code == 503  # loops not started


async def test_deregister_forgets_every_worker_of_an_instance(
    client: tuple[httpx.AsyncClient, ControllerServer],
) -> None:
    c, server = client
    svc = server.service
    for worker in (0, 1):
        svc.handle_request(p.RegisterMsg("inst~fp", worker, "10.0.0.1", 7000 + worker, "peer"))
    svc.handle_request(p.RegisterMsg("other~fp", 0, "10.0.0.2", 7000, "peer"))
    r = await c.post("/v1/deregister", json={"instance_id": "inst~fp"})
    assert r.json() == {"instance_id": "inst~fp", "deregistered": 2}
    assert svc.registry.instances() == ["other~fp"]
    again = await c.post("/v1/deregister", json={"instance_id": "inst~fp"})
    assert again.json()["deregistered"] == 0
    assert (await c.post("/v1/deregister", json={})).status_code == 422
