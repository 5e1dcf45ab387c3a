"""Live figures in status: the operator reads each domain's controller and gateway on an
interval and writes ``status.live`` of the pool and its members, FiguresCurrent, and the
INSTANCES and HIT columns of ``kubectl get kvcachepools``.

What answers the operator:

- the controller is the real one (kvpool-controller's FastAPI app and ControllerService, served
  by uvicorn on 127.0.0.1, as in test_finalizers.py): the figures are what its registry, index
  and fingerprint check hold after real RegisterMsg / admit messages, so /v1/stats is tested
  end to end with the status it becomes;
- the gateway is a fake HTTP server: only two of its answers are read (``/metrics`` and
  ``/readyz``), it serves the exposition of the gateway's own GatewayMetrics (the real metric
  names) and a ``/readyz`` body of the gateway's shape. A real gateway would need its config,
  instances to probe and requests routed through them to move its counters; the counters here
  are moved directly, so the expected ratio is exact;
- for the failure cases, both are fake HTTP servers that accept a connection and never answer
  (what a hung or partitioned process does): only the HTTP behaviour matters there.

The emulator (kvpool-operator cluster's API server) serves the three kinds with the generated
CRDs' printer columns, so the Table the test reads is what kubectl prints.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from apiserver import ApiServer
from harness import Client, OperatorThread, eventually, example
from test_finalizers import controller
from test_kubectl_get import _table
from test_reconcile import P2PGS, PDPS, POOLS, STS, condition, one

from kvpool.controller.server import ControllerServer
from kvpool.gateway.metrics import GatewayMetrics
from kvpool.protocol import lmcache_wire as p

__all__ = ["controller"]  # the real controller's fixture, shared with test_finalizers.py

INTERVAL = 0.3


class FakeHttp:
    """A gateway (or a controller) on 127.0.0.1: GatewayMetrics' exposition at /metrics, a
    /readyz body, and ``hang``: accept every request and never answer."""

    def __init__(self) -> None:
        self.metrics = GatewayMetrics()
        self.readyz: dict[str, Any] = {"status": "ready", "instances": {}}
        self.hang = False
        self.requests: Counter[str] = Counter()
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests[request.path] += 1
        if self.hang:
            await asyncio.Event().wait()
        if request.path == "/metrics":
            return web.Response(body=self.metrics.render(), content_type="text/plain")
        if request.path == "/readyz":
            return web.json_response(self.readyz)
        return web.json_response({}, status=404)

    async def __aenter__(self) -> FakeHttp:
        app = web.Application()
        app.router.add_route("GET", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()


@pytest.fixture
async def gateway() -> AsyncIterator[FakeHttp]:
    async with FakeHttp() as fake:
        yield fake


@pytest.fixture
async def hung() -> AsyncIterator[FakeHttp]:
    async with FakeHttp() as fake:
        fake.hang = True
        yield fake


def live(apiserver: ApiServer, resource: str, name: str) -> dict[str, Any]:
    return dict(one(apiserver, resource, name).get("status", {}).get("live") or {})


def figures_settings(controller_url: str, gateway_url: str, timeout: float) -> dict[str, Any]:
    return {
        "controller_url": controller_url,
        "gateway_url": gateway_url,
        "figures_interval": INTERVAL,
        "figures_timeout": timeout,
    }


async def apply_demo(client: Client) -> None:
    for doc in example("cpu-demo"):
        await client.create(doc)


class TestFromTheRealController:
    @pytest.fixture
    def settings_overrides(
        self, controller: tuple[str, ControllerServer], gateway: FakeHttp
    ) -> dict[str, Any]:
        return figures_settings(controller[0], gateway.url, 2.0)

    async def test_registered_instances_tiers_hits_frozen_and_refused_reach_status_and_columns(
        self,
        apiserver: ApiServer,
        client: Client,
        operator: OperatorThread,
        controller: tuple[str, ControllerServer],
        gateway: FakeHttp,
    ) -> None:
        svc = controller[1].service
        await apply_demo(client)
        ids = await eventually(
            lambda: [
                i["lmcacheInstanceId"]
                for i in one(apiserver, P2PGS, "demo-p2p")["status"]["instances"]
            ]
        )
        fingerprint = ids[0].split("~")[1]
        svc.settings.fingerprint = fingerprint  # the rendered controller's --fingerprint
        await eventually(lambda: live(apiserver, POOLS, "demo").get("instances") == "0/2")
        assert live(apiserver, POOLS, "demo")["hit"] in ("-", "idle")  # nothing routed yet

        svc.handle_request(p.RegisterMsg(ids[0], 0, "10.0.0.1", 7000, "peer"))
        svc.index.admit(ids[0], 0, "LocalCPUBackend", [11, 12, 13])
        # demo-p2p-1 left on another seed: refused, and so shown on its member
        refused = p.RegisterMsg("demo-p2p-1~0123456789ab", 0, "10.0.0.2", 7000, "peer")
        assert isinstance(svc.handle_request(refused), p.ErrorMsg)
        gateway.metrics.prompt_tokens.labels("demo-p2p-0").inc(1000)
        gateway.metrics.predicted_hit_tokens.labels("demo-p2p-0").inc(768)
        gateway.readyz["instances"] = {"demo-p2p-0": {"ready": True, "frozen": True}}

        pool = await eventually(
            lambda: (lv := live(apiserver, POOLS, "demo")).get("hit") == "76.8%" and lv,
            what="the pool's live figures",
        )
        assert pool["instances"] == "1/2" and pool["workersRegistered"] == 1
        assert pool["chunks"] == 3
        budget = one(apiserver, POOLS, "demo")["status"]["memoryBudget"]["P2PGroup/demo-p2p"]
        assert pool["tiers"] == {
            "LocalCPUBackend": {"chunkLocations": 3, "bytes": 3 * budget["chunkBytesPerRank"]}
        }
        assert (pool["hitTokens"], pool["promptTokens"], pool["hitRatio"]) == (768, 1000, 0.768)
        assert pool["refusedRegistrations"] == 1
        assert pool["refused"][0]["instanceId"] == "demo-p2p-1~0123456789ab"
        assert pool["instancesFrozen"] == 1
        member = await eventually(lambda: live(apiserver, P2PGS, "demo-p2p").get("frozen"))
        assert member == ["demo-p2p-0"]
        group = live(apiserver, P2PGS, "demo-p2p")
        assert (group["instancesRegistered"], group["instancesRefused"]) == (1, 1)
        assert group["refused"] == ["demo-p2p-1"]
        assert live(apiserver, PDPS, "demo-pd")["instancesFrozen"] == 0
        current = condition(one(apiserver, POOLS, "demo"), "FiguresCurrent")
        assert (current["status"], current["reason"]) == ("True", "Read")

        table = await _table(str(apiserver.servers[0].url), "kvcachepools")
        assert table["columns"] == [
            "Name", "Ready", "Domain", "Seed", "Members", "Instances", "Hit", "Age"
        ]  # fmt: skip
        assert table["demo"][5:7] == ["1/2", "76.8%"]

    async def test_the_operator_reads_each_domain_at_most_once_per_interval(
        self,
        apiserver: ApiServer,
        client: Client,
        operator: OperatorThread,
        gateway: FakeHttp,
    ) -> None:
        await apply_demo(client)
        await eventually(lambda: live(apiserver, POOLS, "demo").get("instances"))
        before, started = gateway.requests["/metrics"], time.monotonic()
        await asyncio.sleep(2.0)
        rounds = gateway.requests["/metrics"] - before
        assert 1 <= rounds <= (time.monotonic() - started) / INTERVAL + 1, rounds
        assert abs(gateway.requests["/readyz"] - gateway.requests["/metrics"]) <= 1


class TestADeadController:
    @pytest.fixture
    def settings_overrides(self, hung: FakeHttp) -> dict[str, Any]:
        return figures_settings(hung.url, hung.url, 0.5)

    async def test_is_a_reason_in_status_and_its_figures_are_left_out(
        self,
        apiserver: ApiServer,
        client: Client,
        operator: OperatorThread,
        hung: FakeHttp,
    ) -> None:
        await apply_demo(client)
        current = await eventually(
            lambda: condition(one(apiserver, POOLS, "demo"), "FiguresCurrent"), timeout=15
        )
        assert (current["status"], current["reason"]) == ("False", "Unavailable")
        assert "no answer within 0.5 s" in current["message"]
        assert "never answered" in current["message"]
        figures = live(apiserver, POOLS, "demo")
        assert (figures["instances"], figures["hit"]) == ("?/2", "?")
        assert "tiers" not in figures and "instancesFrozen" not in figures
        # The gateway answers again; the (fake) controller answers /v1/stats with a 404.
        hung.hang = False
        current = await eventually(
            lambda: (c := condition(one(apiserver, POOLS, "demo"), "FiguresCurrent"))["reason"]
            == "ControllerUnavailable"
            and c,
            timeout=10,
        )
        assert "/v1/stats: HTTP 404" in current["message"]
        assert live(apiserver, POOLS, "demo")["hit"] in ("-", "idle")


class TestAHungController:
    @pytest.fixture
    def settings_overrides(self, hung: FakeHttp) -> dict[str, Any]:
        return figures_settings(hung.url, hung.url, 60.0)  # every read hangs throughout

    async def test_never_stalls_a_reconcile(
        self,
        apiserver: ApiServer,
        client: Client,
        operator: OperatorThread,
        hung: FakeHttp,
    ) -> None:
        await apply_demo(client)
        await eventually(lambda: hung.requests["/v1/stats"] >= 1, what="a hanging read")
        await eventually(lambda: len(apiserver.live(STS)) == 4)
        await client.patch("P2PGroup", "demo-p2p", {"spec": {"replicas": 3}})
        await eventually(
            lambda: "demo-p2p-2" in {o["metadata"]["name"] for o in apiserver.live(STS)}
        )
        assert "live" not in one(apiserver, P2PGS, "demo-p2p")["status"]  # no read finished
        # one round at a time: the hanging round is not joined by more
        assert hung.requests["/v1/stats"] == 1


async def test_figures_are_off_unless_an_interval_is_set(
    apiserver: ApiServer, client: Client, operator: OperatorThread
) -> None:
    await apply_demo(client)
    await eventually(lambda: one(apiserver, POOLS, "demo").get("status", {}).get("conditions"))
    await asyncio.sleep(0.5)
    assert "live" not in one(apiserver, POOLS, "demo")["status"]
    types = {c["type"] for c in one(apiserver, POOLS, "demo")["status"]["conditions"]}
    assert "FiguresCurrent" not in types
