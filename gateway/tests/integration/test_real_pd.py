"""The gateway as the PD proxy of a real prefill/decode pair: two reference workers whose
LMCache 0.5.6 PD backends move the KV over NIXL (UCX, host memory), configured like the
operator renders a PDPair on platform cpu (``pd_role`` sender/receiver, ``pd_proxy_port`` =
the gateway's PULL socket). The decode's output through the gateway equals a single-instance
run of the same prompt, and the decoder reports the prompt as served from the transfer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fakes import serving
from realstack import SEED, Procs, pd_gateway_config, start_pd_pair

from kvpool.gateway.app import build_app
from kvpool.gateway.config import GatewayEnv, parse_config
from kvpool.gateway.state import build_state

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[dict[str, Any]]:
    procs = Procs(tmp_path)
    try:
        yield start_pd_pair(procs, tmp_path)
    finally:
        procs.close()


async def test_pd_through_the_gateway_equals_a_single_instance_run(pair: dict[str, Any]) -> None:
    raw = pd_gateway_config(pair)
    state = build_state(
        parse_config(raw), GatewayEnv(PYTHONHASHSEED=SEED), pd_bind_host="127.0.0.1"
    )
    prompt = "The old river keeps its stones, and the keeper keeps the river. " * 25
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0}
    async with httpx.AsyncClient(timeout=120) as direct:
        single = (await direct.post(f"{pair['urls']['decode']}/v1/completions", json=body)).json()
    async with serving(build_app(state)) as url, httpx.AsyncClient(base_url=url, timeout=120) as c:
        r = await c.post("/v1/completions", json={**body, "prompt": prompt + " Again."})
        assert r.status_code == 200, r.text
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.headers["x-kvpool-instance"] == "pre-0,dec-0"
        out = r.json()
        # a prompt shorter than one chunk is transferred too (the sender saves unfull chunks)
        short = {"prompt": "The old river.", "max_tokens": 4, "temperature": 0}
        async with httpx.AsyncClient(timeout=120) as direct:
            alone = await direct.post(f"{pair['urls']['decode']}/v1/completions", json=short)
        r = await c.post("/v1/completions", json=short)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        metrics = (await c.get("/metrics")).text
    assert out["choices"][0]["text"] == single["choices"][0]["text"]
    assert out["usage"]["completion_tokens"] == 6
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256
    assert 'kvpool_gateway_pd_requests_total{outcome="transferred",pair="pd"} 3.0' in metrics
