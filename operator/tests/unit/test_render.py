"""Pure render: golden output per example, valid Kubernetes objects, the domain contract held.

Goldens live in operator/tests/golden/<example>.yaml. After an intended change, regenerate
them with ``KVPOOL_UPDATE_GOLDEN=1 ../.venv/bin/python -m pytest tests/unit/test_render.py``
(from operator/) and review the diff. No API server can run here, so every rendered object is
checked with kubernetes-validate --strict against the official Kubernetes schemas.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from op_builders import EXAMPLES, p2p, pd, pool

from kvpool.operator.loader import load_text
from kvpool.operator.render import lmcache_configs, render, render_domain
from kvpool.operator.render.fingerprint import pool_fingerprint
from kvpool.operator.render.k8s import rollout_hash
from kvpool.operator.yamlfmt import dump_all

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
EXAMPLE_FILES = sorted(EXAMPLES.glob("*.yaml"))


#: What the runtime adds to a render (the token it generates once, its own namespace), fixed.
RUNTIME_INPUTS: dict[str, Any] = {
    "api_token": "golden-token",
    "operator_namespace": "kvpool-system",
}


def _render_file(path: Path) -> list[dict[str, Any]]:
    loaded = load_text(path.read_text(), path.name)
    domains = loaded.domains()
    assert not loaded.errors, loaded.errors
    return [o for d in domains for o in render_domain(d.pool, d.members, **RUNTIME_INPUTS)]


def _pods(objects: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [
        (o["metadata"]["name"], o["spec"]["template"])
        for o in objects
        if o["kind"] in ("Deployment", "StatefulSet")
    ]


def _env(template: dict[str, Any]) -> dict[str, str]:
    container = template["spec"]["containers"][0]
    return {e["name"]: e.get("value", "<ref>") for e in container["env"]}


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=[p.stem for p in EXAMPLE_FILES])
def test_render_matches_golden(path: Path) -> None:
    text = dump_all(_render_file(path))
    golden = GOLDEN / f"{path.stem}.yaml"
    if os.environ.get("KVPOOL_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert golden.exists(), f"no golden for {path.name}: run with KVPOOL_UPDATE_GOLDEN=1"
    assert text == golden.read_text(), f"{path.name} renders differently than its golden"


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=[p.stem for p in EXAMPLE_FILES])
def test_every_rendered_object_is_valid_kubernetes(path: Path) -> None:
    objects = _render_file(path)
    assert len(objects) >= 8
    for obj in objects:
        kubernetes_validate.validate(obj, "1.33", strict=True)


def test_render_is_deterministic() -> None:
    assert render(pool(), p2p()) == render(pool(), p2p())


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=[p.stem for p in EXAMPLE_FILES])
def test_every_pod_of_the_domain_has_one_seed_and_the_fingerprint(path: Path) -> None:
    objects = _render_file(path)
    seeds, prints, rollouts = set(), set(), set()
    for name, template in _pods(objects):
        env = _env(template)
        seeds.add(env["PYTHONHASHSEED"])
        prints.add(env["KVPOOL_DOMAIN_FINGERPRINT"])
        rollouts.add(template["metadata"]["annotations"]["kvpool.io/domain-rollout-hash"])
        if template["metadata"]["labels"]["kvpool.io/component"] == "worker":
            assert env["LMCACHE_TRACK_USAGE"] == "false", name
            assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
            assert env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
            assert env["LMCACHE_CONFIG_FILE"] == "/etc/kvpool/lmcache/lmcache.yaml"
    assert len(seeds) == len(prints) == len(rollouts) == 1


def test_rollout_hash_follows_domain_settings() -> None:
    base = rollout_hash(pool())
    assert rollout_hash(pool(chunkSize=512)) != base
    assert rollout_hash(pool(hashSeed="7")) != base
    assert rollout_hash(pool(controller={"ports": {"pull": 1234}})) != base
    assert rollout_hash(pool(gateway={"replicas": 3})) == base


def test_a_member_only_config_change_restarts_its_pods() -> None:
    """LMCache reads its YAML once at start: a change to a member's transfer settings (not
    the domain's) must still change the pod template, or running pods keep the old config."""

    def template_annotations(**transfer: Any) -> list[dict[str, str]]:
        objs = render(pool(), p2p(transfer=transfer))
        return [
            o["spec"]["template"]["metadata"]["annotations"]
            for o in objs
            if o["kind"] == "StatefulSet"
        ]

    before, after = template_annotations(), template_annotations(pullPendingTTLSeconds=90)
    assert len(before) == len(after) == 2
    for a, b in zip(before, after, strict=True):
        assert a["kvpool.io/config-hash"] != b["kvpool.io/config-hash"]
        assert a["kvpool.io/domain-rollout-hash"] == b["kvpool.io/domain-rollout-hash"]


def test_p2p_instance_ids_ports_and_ascend_keys() -> None:
    the_pool = pool()
    fp = pool_fingerprint(the_pool)
    configs = lmcache_configs(the_pool, p2p())
    first, second = configs["grp-0"], configs["grp-1"]
    assert first["lmcache_instance_id"] == f"grp-0~{fp}"
    assert first["lmcache_worker_ports"] == [20001, 20002]
    assert first["p2p_init_ports"] == [20003, 20004]
    assert first["p2p_lookup_ports"] == [20005, 20006]
    assert second["lmcache_worker_ports"] == [20011, 20012]
    ports0 = {
        p for k in ("lmcache_worker_ports", "p2p_init_ports", "p2p_lookup_ports") for p in first[k]
    }
    ports1 = {
        p for k in ("lmcache_worker_ports", "p2p_init_ports", "p2p_lookup_ports") for p in second[k]
    }
    assert not ports0 & ports1
    assert first["p2p_delay_pull"] is True and first["p2p_use_npu"] is True
    assert "p2p_pull_pending_ttl" not in first
    assert first["extra_config"]["p2p_pull_pending_ttl"] == 60.0
    assert first["extra_config"]["use_host_staging"] is True
    assert first["extra_config"]["os_staging_bytes"] == 8 * 2**30
    assert first["max_local_cpu_size"] == 16.0
    assert first["transfer_channel"] == "hccl"
    assert first["controller_pull_url"] == "pool-controller.ns.svc:8300"


def test_cpu_p2p_uses_nixl_ucx_and_no_ascend_keys() -> None:
    cfg = lmcache_configs(pool(), p2p(engine={"platform": "cpu"}, transfer={}))["grp-0"]
    assert cfg["transfer_channel"] == "nixl"
    assert cfg["nixl_backends"] == ["UCX"]
    assert not any(k.startswith("p2p_use") or k.startswith("p2p_pull") for k in cfg)


def test_full_sync_timing_comes_from_the_pool_spec() -> None:
    """spec.controller.fullSync reaches every registered instance's extra_config (0.5 s and
    0.5 s by default; LMCache's own 5 s and 5 s when a spec names them), and a change rolls the
    workers like any other config change."""
    default = lmcache_configs(pool(), p2p())["grp-0"]["extra_config"]
    assert default["full_sync_startup_delay_s"] == 0.5
    assert default["full_sync_status_poll_interval_s"] == 0.5
    lmcache_defaults = {"startupDelaySeconds": 5, "statusPollIntervalSeconds": 5}
    slow = pool(controller={"fullSync": lmcache_defaults})
    extra = lmcache_configs(slow, p2p())["grp-0"]["extra_config"]
    assert extra["full_sync_startup_delay_s"] == 5
    assert extra["full_sync_status_poll_interval_s"] == 5
    hashes = [
        o["spec"]["template"]["metadata"]["annotations"]["kvpool.io/config-hash"]
        for spec in (pool(), slow)
        for o in render(spec, p2p())
        if o["kind"] == "StatefulSet"
    ]
    assert len(set(hashes)) == len(hashes) == 4
    with pytest.raises(ValueError, match="statusPollIntervalSeconds"):
        pool(controller={"fullSync": {"statusPollIntervalSeconds": 0}})


def test_pd_sender_and_receiver_keys() -> None:
    configs = lmcache_configs(pool(), pd(transfer={"mode": "cpu-offload-pull-delay"}))
    sender, receiver = configs["pair-prefill-0"], configs["pair-decode-0"]
    assert sender["pd_role"] == "sender" and sender["save_unfull_chunk"] is True
    assert sender["pd_pull_mode"] is True and sender["pd_delay_pull"] is True
    assert sender["pd_use_cpu_offload"] is True
    assert sender["pd_pull_done_port"] == [30001, 30002]
    assert sender["pd_proxy_host"] == "pool-gateway.ns.svc"
    assert receiver["pd_role"] == "receiver"
    assert receiver["pd_peer_init_port"] == [30011, 30012]
    assert receiver["pd_peer_alloc_port"] == [30013, 30014]
    assert "enable_p2p" not in sender and "enable_p2p" not in receiver


def test_pd_push_mode_has_no_pull_keys() -> None:
    sender = lmcache_configs(pool(), pd(transfer={"mode": "push"}))["pair-prefill-0"]
    assert sender["pd_pull_mode"] is False
    assert "pd_pull_done_port" not in sender


def test_worker_pod_requests_accelerators_and_host_network() -> None:
    objects = render(pool(), p2p(hostNetwork=True))
    sts = next(o for o in objects if o["kind"] == "StatefulSet")
    spec = sts["spec"]["template"]["spec"]
    assert spec["hostNetwork"] is True
    assert spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    limits = spec["containers"][0]["resources"]["limits"]
    assert limits["huawei.com/ascend-1980"] == "2"
    command = spec["containers"][0]["command"]
    assert command[:4] == ["kvpool-worker", "serve", "--engine", "vllm"]
    assert command[command.index("--lmcache-rpc-port") + 1] == "grp-0"


def test_mooncake_tier_renders_master_metadata_and_store() -> None:
    the_pool = pool(tiers={"remote": {"mooncake": {"segmentSize": "32Gi"}}})
    objects = render_domain(the_pool, [p2p(engine={"platform": "cuda"}, transfer={})])
    names = {o["metadata"]["name"] for o in objects if o["kind"] == "Deployment"}
    assert {"pool-mooncake-master", "pool-mooncake-metadata", "pool-mooncake-store"} <= names
    cfg = lmcache_configs(the_pool, p2p(engine={"platform": "cuda"}, transfer={}))["grp-0"]
    assert cfg["remote_url"] == "mooncakestore://pool-mooncake-master.ns.svc:50051/"
    assert cfg["extra_config"]["global_segment_size"] == 0
    assert cfg["extra_config"]["metadata_server"].endswith(":8080/metadata")
