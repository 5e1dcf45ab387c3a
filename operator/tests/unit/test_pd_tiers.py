"""PD members run without the pool's disk and remote tiers (``platform.carries_pool_tiers``).

Why: LMCache 0.5.6 runs the PD roles with ``local_cpu`` off, and its disk and remote backends
need the local CPU tier as their buffer: a PD instance rendered with the pool's Mooncake tier
failed at start ('SafeLocalCPUBackend' object has no attribute 'config') and every store of its
prefill raised ``local_cpu_backend is required for get_allocator_backend`` (the chaos suite's
reference domain). The render leaves both tiers off PD instances (their LMCache config, the
disk volume, the Mooncake buffer in the memory budget) and keeps them on the pool's P2P groups;
a pool whose tiers no member carries gets a warning whose fix removes it.
"""

from __future__ import annotations

from typing import Any

from op_builders import pd, plain_p2p, pool

from kvpool.operator.api import KVCachePool, P2PGroup, PDPair
from kvpool.operator.render import lmcache_configs, render
from kvpool.operator.validation import memory_budgets, validate_domain
from kvpool.operator.validation.problems import apply_patches

MOONCAKE = {"mooncake": {"segmentSize": "256Mi", "localBufferSize": "128Mi"}}
DISK = {"path": "/kv", "size": "10Gi"}


def _cpu_pd() -> PDPair:
    return pd(
        prefill={"tensorParallelSize": 1, "engine": {"platform": "cpu"}},
        decode={"tensorParallelSize": 1, "engine": {"platform": "cpu"}},
        transfer={"mode": "push", "bufferSize": "128Mi"},
    )


def _cpu_p2p() -> P2PGroup:
    return plain_p2p(
        tensorParallelSize=1,
        engine={"platform": "cpu"},
        enableAsyncLoading=True,
        ports={"base": 20000},
    )


def _volumes(objects: list[dict[str, Any]]) -> set[str]:
    return {
        v["name"]
        for o in objects
        if o["kind"] in ("Deployment", "StatefulSet")
        for v in o["spec"]["template"]["spec"].get("volumes", [])
    }


def test_pd_instances_get_no_remote_tier_and_p2p_instances_keep_it() -> None:
    the_pool = pool(tiers={"cpu": {"size": "512Mi"}, "remote": MOONCAKE})
    group, pair = _cpu_p2p(), _cpu_pd()
    assert [p for p in validate_domain(the_pool, [group, pair]) if p.severity == "error"] == []
    for name, cfg in lmcache_configs(the_pool, group).items():
        assert cfg["remote_url"].startswith("mooncakestore://"), name
        assert cfg["local_cpu"] is True
    pd_configs = lmcache_configs(the_pool, pair)
    assert len(pd_configs) == 2
    for name, cfg in pd_configs.items():
        assert cfg["local_cpu"] is False, name
        assert not {"remote_url", "remote_serde", "local_disk"} & cfg.keys(), (name, cfg)
        assert "local_hostname" not in cfg.get("extra_config", {}), name  # Mooncake's keys
    budgets = memory_budgets(the_pool, [group, pair])
    assert "Mooncake buffer" in budgets["P2PGroup/grp"].formula
    assert "Mooncake buffer" not in budgets["PDPair/pair"].formula


def test_pd_only_pool_with_tiers_renders_none_and_warns_with_a_fix_that_works() -> None:
    doc = pool(tiers={"cpu": {"size": "1Gi"}, "disk": DISK, "remote": MOONCAKE}).model_dump(
        by_alias=True, exclude_none=True
    )
    the_pool = KVCachePool.model_validate(doc)
    pair = _cpu_pd()
    for cfg in lmcache_configs(the_pool, pair).values():
        assert not {"remote_url", "local_disk", "max_local_disk_size"} & cfg.keys(), cfg
    assert "kv-disk" not in _volumes(render(the_pool, pair))
    problems = validate_domain(the_pool, [pair])
    assert [p for p in problems if p.severity == "error"] == []
    warned = [p for p in problems if p.code == "pd.tiers"]
    assert sorted(p.path for p in warned) == [
        "KVCachePool/pool: spec.tiers.disk",
        "KVCachePool/pool: spec.tiers.remote",
    ]
    assert all("PD instances run without" in p.message for p in warned)
    for problem in warned:
        doc = apply_patches(doc, problem.patch)
    fixed = KVCachePool.model_validate(doc)
    assert [p for p in validate_domain(fixed, [pair]) if p.code == "pd.tiers"] == []


def test_a_pool_with_a_p2p_group_is_not_warned() -> None:
    the_pool = pool(tiers={"cpu": {"size": "512Mi"}, "remote": MOONCAKE})
    problems = validate_domain(the_pool, [_cpu_p2p(), _cpu_pd()])
    assert [p for p in problems if p.code == "pd.tiers"] == []
