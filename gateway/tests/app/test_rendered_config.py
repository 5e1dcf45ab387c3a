"""The operator's render and the gateway are one contract: the gateway Deployment rendered
for examples/cpu-demo.yaml (its command line, env and mounted gateway.yaml) is accepted as is
and the gateway starts on it.

Only the cluster-provided parts are changed, as a pod would see them: the ConfigMap mount
becomes a file, and the gateway's listen ports (HTTP and the PD proxy port) become free local
ports so tests never bind fixed ones. The instances' cluster DNS names stay: they do not
resolve here, so the gateway starts with no instance ready and the controller down, which is
what /readyz must say.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fakes import bound_socket, serving

from kvpool.gateway.app import build_app
from kvpool.gateway.cli import build_parser, settings_from_args
from kvpool.gateway.config import ConfigError, GatewayEnv, parse_config
from kvpool.gateway.state import build_state
from kvpool.operator.loader import load_text
from kvpool.operator.render import render_domain

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
pytestmark = pytest.mark.timeout(60)


def rendered(example: str, text: str | None = None) -> tuple[list[str], list[dict[str, Any]], str]:
    """The gateway's command, env and gateway.yaml rendered for ``example`` (or ``text``)."""
    loaded = load_text(text if text is not None else (EXAMPLES / example).read_text(), example)
    assert not loaded.errors
    (domain,) = loaded.domains()
    objects = render_domain(domain.pool, domain.members)
    deploy = next(
        o
        for o in objects
        if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-gateway")
    )
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    cm = next(
        o
        for o in objects
        if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-gateway")
    )
    return container["command"], container.get("env", []), cm["data"]["gateway.yaml"]


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_every_rendered_gateway_config_is_accepted(example: str, tmp_path: Path) -> None:
    argv, env, text = rendered(example)
    assert argv[:2] == ["kvpool-gateway", "serve"]
    mount = argv[argv.index("--config") + 1]
    assert mount == "/etc/kvpool/gateway/gateway.yaml"
    local = tmp_path / "gateway.yaml"
    local.write_text(text)
    config, options = settings_from_args([*argv[1 : argv.index("--config") + 1], str(local)])
    assert options.host == "0.0.0.0"
    assert config.controller_pub_url and config.controller_snapshot_url
    names = {e["name"] for e in env}
    assert "PYTHONHASHSEED" in names  # the domain's seed, for LMCache-exact hashes
    raw = yaml.safe_load(text)
    assert parse_config(raw).model_dump(by_alias=True, exclude_unset=True).keys() == raw.keys()


def test_unknown_or_bad_keys_are_refused_naming_the_key() -> None:
    _, _, text = rendered("cpu-demo.yaml")
    raw = yaml.safe_load(text)
    with pytest.raises(ConfigError, match="routingg: Extra inputs are not permitted"):
        parse_config({**raw, "routingg": {}})
    with pytest.raises(ConfigError, match=r"routing\.policy"):
        parse_config({**raw, "routing": {"policy": "random"}})
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve"])  # --config is required


async def test_gateway_starts_on_the_rendered_cpu_demo_config(tmp_path: Path) -> None:
    _, env, text = rendered("cpu-demo.yaml")
    raw = yaml.safe_load(text)
    for pair in raw["pdPairs"]:  # listen ports -> free local ports
        s = bound_socket()
        pair["proxyPort"] = s.getsockname()[1]
        s.close()
    local = tmp_path / "gateway.yaml"
    local.write_text(yaml.safe_dump(raw))
    config, _ = settings_from_args(["serve", "--config", str(local), "--host", "127.0.0.1"])
    secret = next((e for e in env if e["name"] == "KVPOOL_GATEWAY_AUTH_TOKEN"), None)
    assert secret is None  # cpu-demo has no authSecretRef
    seed = next(e["value"] for e in env if e["name"] == "PYTHONHASHSEED")
    state = build_state(config, GatewayEnv(PYTHONHASHSEED=seed), pd_bind_host="127.0.0.1")
    async with serving(build_app(state)) as url, httpx.AsyncClient(base_url=url, timeout=10) as c:
        ready = await c.get("/readyz")
        body = ready.json()
        assert ready.status_code == 503 and body["status"] == "unavailable"
        assert set(body["instances"]) == {
            "demo-p2p-0",
            "demo-p2p-1",
            "demo-pd-prefill-0",
            "demo-pd-decode-0",
        }
        assert body["pd_pairs"] == ["demo-pd"]
        models = (await c.get("/v1/models")).json()
        assert models["data"][0]["id"] == "kvpool/reference-tiny"
        r = await c.post("/v1/completions", json={"prompt": [1, 2, 3]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_instance_available"
        await asyncio.sleep(0)


def test_the_rendered_pd_bypass_ratio_is_accepted() -> None:
    """spec.gateway.pd.bypassMinCachedRatio reaches the PD pair's gateway.yaml entry, which the
    gateway accepts (the PD bypass; a live key, so under pdPairs)."""
    docs = [d for d in yaml.safe_load_all((EXAMPLES / "cpu-demo.yaml").read_text()) if d]
    pool = next(d for d in docs if d["kind"] == "KVCachePool")
    pool["spec"].setdefault("gateway", {})["pd"] = {"bypassMinCachedRatio": 0.5}
    _, _, text = rendered("cpu-demo.yaml", yaml.safe_dump_all(docs))
    config = parse_config(yaml.safe_load(text))
    assert [p.bypass_min_cached_ratio for p in config.pd_pairs] == [0.5]
