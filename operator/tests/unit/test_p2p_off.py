"""P2PGroup ``p2p: false``: instances that share the domain's controller and index but never
pull KV from each other. Nothing P2P is rendered (keys, ports, env), the gateway credits no
peer hits, and the rules that exist only because of P2P do not apply."""

from __future__ import annotations

from typing import Any

import yaml
from op_builders import p2p, plain_p2p, pool

from kvpool.operator.api import P2PGroup
from kvpool.operator.derive.defaults import member_defaults
from kvpool.operator.render import lmcache_configs, render, render_domain
from kvpool.operator.validation import errors, validate_domain, warnings

P2P_KEYS = {"enable_p2p", "p2p_host", "p2p_init_ports", "p2p_lookup_ports", "transfer_channel"}


def off(**spec: Any) -> P2PGroup:
    """The base group (ascend, TP 2, delay pull + HostStaging) with P2P off."""
    return p2p(p2p=False, **spec)


def plain_off(**spec: Any) -> P2PGroup:
    """The base group without transfer settings, P2P off."""
    return plain_p2p(p2p=False, **spec)


def _container(objects: list[dict[str, Any]], name: str) -> dict[str, Any]:
    (sts,) = [o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"] == name]
    container: dict[str, Any] = sts["spec"]["template"]["spec"]["containers"][0]
    return container


def test_no_p2p_key_port_or_host_env_is_rendered() -> None:
    group = plain_off()
    cfg = lmcache_configs(pool(), group)["grp-0"]
    assert not set(cfg) & P2P_KEYS
    assert not any(k.startswith(("p2p_", "nixl")) for k in cfg)
    assert cfg["enable_controller"] is True and cfg["lmcache_worker_ports"] == [20001, 20002]
    assert cfg["extra_config"] == {
        "worker_socket_recv_timeout_ms": 3000,
        "full_sync_startup_delay_s": 0.5,  # spec.controller.fullSync defaults
        "full_sync_status_poll_interval_s": 0.5,
    }
    container = _container(render(pool(), group), "grp-0")
    assert [p["name"] for p in container["ports"]] == ["http", "wrk-0", "wrk-1"]
    assert "LMCACHE_P2P_HOST" not in {e["name"] for e in container["env"]}
    with_p2p = _container(render(pool(), p2p()), "grp-0")
    assert "LMCACHE_P2P_HOST" in {e["name"] for e in with_p2p["env"]}


def test_the_gateway_group_says_p2p_false() -> None:
    objects = render_domain(pool(), [plain_off(), p2p("peers", ports={"base": 21000})])
    (cm,) = [
        o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "pool-gateway"
    ]
    groups = {g["name"]: g for g in yaml.safe_load(cm["data"]["gateway.yaml"])["p2pGroups"]}
    assert groups["grp"]["p2p"] is False
    assert "p2p" not in groups["peers"]  # the gateway's default: members pull from peers


def test_p2p_only_rules_skip_a_group_without_p2p() -> None:
    """The disk tier (rule 4), async loading and channels (rule 5), P2P buffers (rule 7),
    layerwise (rule 8) and the MLA eager pull (rule 10) are about P2P pulls."""
    the_pool = pool(tiers={"cpu": {"size": "16Gi"}, "disk": {"path": "/kv", "size": "10Gi"}})
    spec: dict[str, Any] = {
        "engine": {"platform": "cpu"},
        "tensorParallelSize": 1,
        "useLayerwise": True,
        "cachePolicy": "LRU",
    }
    assert validate_domain(the_pool, [plain_off(**spec)]) == []
    with_p2p = plain_p2p(**spec)
    assert {p.rule for p in errors(validate_domain(the_pool, [with_p2p]))} >= {4, 5, 8}


def test_transfer_settings_of_a_group_without_p2p_are_reported_unused() -> None:
    problems = validate_domain(pool(), [off()])
    (problem,) = warnings(problems)
    assert problem.code == "transfer.unused"
    assert problem.path == "P2PGroup/grp: spec.transfer"
    assert "with p2p: false nothing is pulled" in problem.message
    assert errors(problems) == []  # delay pull without NPU etc. would be P2P problems
    assert [d.field for d in member_defaults(off())] == ["spec.engine.acceleratorCount"]


def test_explicit_ports_without_p2p_need_only_worker_ports() -> None:
    ports = {"instances": [{"http": 8010, "workerPorts": [9000]}]}
    group = plain_off(tensorParallelSize=1, replicas=1, ports=ports)
    assert validate_domain(pool(), [group]) == []
    assert lmcache_configs(pool(), group)["grp-0"]["lmcache_worker_ports"] == [9000]
    stray = {"instances": [{"http": 8010, "workerPorts": [9000], "initPorts": [9001]}]}
    (problem,) = validate_domain(pool(), [plain_off(tensorParallelSize=1, replicas=1, ports=stray)])
    assert problem.code == "ports.explicit-p2p"
    assert problem.fix == "remove initPorts and lookupPorts from ports.instances, or set p2p: true"
    with_p2p = plain_p2p(tensorParallelSize=1, replicas=1, ports=ports, enableAsyncLoading=True)
    lengths = [p for p in validate_domain(pool(), [with_p2p]) if p.code == "ports.explicit-length"]
    assert sorted(p.path.rsplit(".", 1)[1] for p in lengths) == ["initPorts", "lookupPorts"]
