"""The gateway as the PD proxy of a real prefill/decode pair: two reference workers whose
LMCache 0.5.6 PD backends move the KV over NIXL (UCX, host memory), configured like the
operator renders a PDPair on platform cpu (``pd_role`` sender/receiver, ``pd_proxy_port`` =
the gateway's PULL socket). The decode's output through the gateway equals a single-instance
run of the same prompt, and the decoder reports the prompt as served from the transfer."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fakes import serving
from realstack import BIN, FACTS, SEED, Procs, base_env, free_port

from kvpool.gateway.app import build_app
from kvpool.gateway.config import GatewayEnv, parse_config
from kvpool.gateway.state import build_state
from kvpool.protocol.domain import domain_fingerprint, instance_id

pytestmark = pytest.mark.timeout(600)


def _config(name: str, role: str, lines: list[str]) -> str:
    return "\n".join([
        "chunk_size: 256", "enable_pd: true", "local_cpu: false", "nixl_backends: [UCX]",
        "pd_buffer_device: cpu", "pd_buffer_size: 67108864", f"pd_role: {role}",
        "pre_caching_hash_algorithm: builtin", "transfer_channel: nixl", "use_layerwise: false",
        f"lmcache_instance_id: {instance_id(name, domain_fingerprint(FACTS))}", *lines, "",
    ])  # fmt: skip


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[dict[str, Any]]:
    if importlib.util.find_spec("nixl") is None:
        pytest.skip("NIXL is not installed (make install installs it)")
    procs = Procs(tmp_path)
    proxy_port, init_port, alloc_port = free_port(), free_port(), free_port()
    configs = {
        "prefill": _config("pre-0", "sender", [
            "pd_proxy_host: 127.0.0.1", f"pd_proxy_port: {proxy_port}", "save_unfull_chunk: true",
        ]),
        "decode": _config("dec-0", "receiver", [
            "pd_peer_host: 127.0.0.1", f"pd_peer_init_port: [{init_port}]",
            f"pd_peer_alloc_port: [{alloc_port}]",
        ]),
    }  # fmt: skip
    urls = {}
    try:
        for role, text in configs.items():
            path = tmp_path / f"{role}.yaml"
            path.write_text(text)
            port = free_port()
            procs.start(
                role,
                [str(BIN / "kvpool-worker"), "serve", "--engine", "reference", "--platform", "cpu",
                 "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "2048",
                 "--block-size", "16", "--kv-dtype", "float32", "--num-kv-blocks", "256"],
                {**base_env(), "LMCACHE_CONFIG_FILE": str(path),
                 "LMCACHE_PD_PEER_HOST": "127.0.0.1"},
            )  # fmt: skip
            urls[role] = f"http://127.0.0.1:{port}"
        for role, url in urls.items():
            procs.wait_ready(role, url)
        yield {"urls": urls, "proxy_port": proxy_port, "init": init_port, "alloc": alloc_port}
    finally:
        procs.close()


async def test_pd_through_the_gateway_equals_a_single_instance_run(pair: dict[str, Any]) -> None:
    raw = {
        "model": "kvpool/reference-tiny",
        "chunkSize": 256,
        "controllerUrl": "http://127.0.0.1:1",  # no controller: prefill goes by load
        "pdPairs": [{
            "name": "pd", "mode": "push", "proxyPort": pair["proxy_port"],
            "prefill": [{"name": "pre-0", "url": pair["urls"]["prefill"]}],
            "decode": [{"name": "dec-0", "url": pair["urls"]["decode"], "host": "127.0.0.1",
                        "initPorts": [pair["init"]], "allocPorts": [pair["alloc"]]}],
        }],
        "limits": {"pdTransferTimeoutSeconds": 60},
    }  # fmt: skip
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
