"""The operator process's probes and Prometheus metrics, served while it reconciles."""

from __future__ import annotations

import socket

import aiohttp
import pytest
from apiserver import ApiServer
from harness import Client, OperatorThread, eventually, example
from test_reconcile import P2PGS, observed


def _free() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


HEALTH, METRICS = _free(), _free()


@pytest.mark.parametrize("settings_overrides", [{"health_port": HEALTH, "metrics_port": METRICS}])
async def test_healthz_readyz_and_reconcile_metrics(
    apiserver: ApiServer, client: Client, operator: OperatorThread
) -> None:
    for doc in example("cpu-demo"):
        await client.create(doc)
    await eventually(lambda: observed(apiserver, P2PGS, "demo-p2p"))
    async with aiohttp.ClientSession() as http:
        for path in ("/healthz", "/readyz"):
            async with http.get(f"http://127.0.0.1:{HEALTH}{path}") as r:
                assert r.status == 200, path
        async with http.get(f"http://127.0.0.1:{METRICS}/metrics") as r:
            text = await r.text()
    assert 'kvpool_operator_reconciles_total{kind="domain",result="ok"}' in text
    assert "kvpool_operator_reconcile_duration_seconds_bucket" in text
