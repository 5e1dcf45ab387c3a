"""Every rule of the cache-domain contract (DESIGN.md 1-10): one passing and failing cases each.

Each failing case asserts the rule number, the field path and the message a person would read.
"""

from __future__ import annotations

from op_builders import p2p, pd, pool

from kvpool.operator.api import KVCachePool, P2PGroup, PDPair
from kvpool.operator.validation import errors, memory_budgets, validate_domain, warnings
from kvpool.operator.validation.problems import Problem


def _problems(the_pool: KVCachePool, *members: P2PGroup | PDPair, rule: int) -> list[Problem]:
    return [p for p in validate_domain(the_pool, list(members)) if p.rule == rule]


def _one(problems: list[Problem]) -> Problem:
    assert len(problems) == 1, problems
    return problems[0]


def test_base_domain_is_clean() -> None:
    assert validate_domain(pool(), [p2p(), pd()]) == []


# rule 1: one seed, one fingerprint ------------------------------------------------------------


def test_rule1_passes_with_matching_block_size() -> None:
    assert _problems(pool(blockSize=64), p2p(engine={"blockSize": 64}), rule=1) == []


def test_rule1_rejects_member_block_size_differing_from_pool() -> None:
    problem = _one(_problems(pool(), p2p(engine={"blockSize": 16}), rule=1))
    assert problem.path == "P2PGroup/grp: spec.engine.blockSize"
    assert "part of the domain fingerprint" in problem.message
    assert "128" in problem.fix


def test_rule1_rejects_out_of_range_seed() -> None:
    problem = _one(_problems(pool(hashSeed="4294967296"), rule=1))
    assert problem.path == "KVCachePool/pool: spec.hashSeed"
    assert "out of range" in problem.message


def test_rule1_rejects_domain_flags_in_engine_args_and_foreign_pool() -> None:
    problems = _problems(
        pool(), p2p(engine={"args": ["--block-size=16"]}, poolRef={"name": "other"}), rule=1
    )
    messages = sorted(p.message for p in problems)
    assert messages[0] == (
        "--block-size is set by kvpool on every worker (derived from the pool and member spec)"
    )
    assert messages[1] == "names pool 'other', not 'pool'"


# rule 2: per-rank port lists, no collisions ---------------------------------------------------


def test_rule2_passes_with_explicit_lists_of_tp_length() -> None:
    ports = {
        "instances": [
            {
                "http": 8010,
                "workerPorts": [9950, 9951],
                "initPorts": [9960, 9961],
                "lookupPorts": [9962, 9963],
            },
            {
                "http": 8011,
                "workerPorts": [9970, 9971],
                "initPorts": [9980, 9981],
                "lookupPorts": [9982, 9983],
            },
        ]
    }
    assert _problems(pool(), p2p(ports=ports), rule=2) == []


def test_rule2_rejects_list_length_differing_from_tp() -> None:
    ports = {
        "instances": [
            {
                "http": 8010,
                "workerPorts": [9950],
                "initPorts": [9960, 9961],
                "lookupPorts": [9962, 9963],
            },
            {
                "http": 8011,
                "workerPorts": [9970, 9971],
                "initPorts": [9980, 9981],
                "lookupPorts": [9982, 9983],
            },
        ]
    }
    problem = _one(_problems(pool(), p2p(ports=ports), rule=2))
    assert problem.path == "P2PGroup/grp: spec.ports.instances[0].workerPorts"
    assert (
        problem.message == "has 1 ports but tensorParallelSize is 2: LMCache indexes it by TP rank"
    )


def test_rule2_rejects_reused_ports() -> None:
    same = {
        "http": 8010,
        "workerPorts": [9950, 9951],
        "initPorts": [9960, 9961],
        "lookupPorts": [9962, 9963],
    }
    problem = _one(_problems(pool(), p2p(ports={"instances": [same, same]}), rule=2))
    assert problem.message.startswith("ports [8010, 9950, 9951")
    assert problem.message.endswith("are used more than once")


def test_rule2_rejects_overlapping_host_network_ranges() -> None:
    a = p2p("a", hostNetwork=True, ports={"base": 20000})
    b = pd("b", hostNetwork=True, ports={"base": 20010})
    problem = _one(_problems(pool(), a, b, rule=2))
    assert problem.path == "PDPair/b: spec.ports.base"
    assert "overlaps P2PGroup/a's 20000-20019" in problem.message
    assert problem.fix.startswith("set ports.base: 20020")
    assert _problems(pool(), a, pd("b", hostNetwork=True, ports={"base": 20020}), rule=2) == []


def test_rule2_rejects_range_beyond_65535() -> None:
    problem = _one(_problems(pool(), p2p(replicas=64, ports={"base": 65000}), rule=2))
    assert "beyond 65535" in problem.message


# rule 3: unique instance ids -----------------------------------------------------------------


def test_rule3_passes_with_distinct_names() -> None:
    assert _problems(pool(), p2p("grp"), pd("pair"), rule=3) == []


def test_rule3_rejects_colliding_instance_ids() -> None:
    problem = _one(_problems(pool(), p2p("pair-prefill"), pd("pair"), rule=3))
    assert "instance 'pair-prefill-0' has the name 'pair-prefill-0', also rendered for" in (
        problem.message
    )
    assert "lmcache_instance_id / lmcache_rpc_port) would collide" in problem.message
    assert problem.fix == "rename PDPair/pair (e.g. to pair-r2)"


def test_rule3_rejects_a_member_service_that_collides_with_an_instance() -> None:
    """P2PGroup grp renders instance grp-0; a PDPair named grp-0 renders Service grp-0."""
    problem = _one(_problems(pool(), p2p("grp"), pd("grp-0"), rule=3))
    assert problem.path == "PDPair/grp-0: metadata.name"
    assert "its Service 'grp-0'" in problem.message


def test_rule3_rejects_a_member_named_like_the_pools_own_objects() -> None:
    problem = _one(_problems(pool(), p2p("pool-controller"), rule=3))
    assert "also rendered for KVCachePool/pool" in problem.message


# rule 4: P2P xor local disk ------------------------------------------------------------------


def test_rule4_passes_disk_without_p2p() -> None:
    assert _problems(pool(tiers={"disk": {"path": "/kv", "size": "100Gi"}}), pd(), rule=4) == []


def test_rule4_rejects_disk_with_p2p() -> None:
    the_pool = pool(tiers={"disk": {"path": "/kv", "size": "100Gi"}})
    problem = _one(_problems(the_pool, p2p(), rule=4))
    assert problem.path == "KVCachePool/pool: spec.tiers.disk"
    assert "P2PGroup(s) grp join this pool" in problem.message


# rule 5: delay pull, HostStaging, channels, cache_policy -------------------------------------


def test_rule5_passes_eager_cpu_pull_with_staging() -> None:
    group = p2p(transfer={"delayPull": False, "useNPU": False})
    assert _problems(pool(), group, rule=5) == []


def test_rule5_rejects_delay_pull_without_npu() -> None:
    problem = _one(_problems(pool(), p2p(transfer={"useNPU": False}), rule=5))
    assert problem.path == "P2PGroup/grp: spec.transfer.delayPull"
    assert problem.message.startswith("delay pull needs useNPU: LMCache-Ascend would silently")


def test_rule5_rejects_host_staging_on_hixl() -> None:
    problem = _one(_problems(pool(), p2p(transfer={"channel": "hixl"}), rule=5))
    assert problem.message == "HostStaging needs transfer channel hccl, not hixl (HIXL has none)"


def test_rule5_rejects_cache_policy_without_async_loading() -> None:
    problem = _one(_problems(pool(), p2p(cachePolicy="LFU"), rule=5))
    assert problem.path == "P2PGroup/grp: spec.cachePolicy"
    assert "needs enableAsyncLoading" in problem.message
    assert _problems(pool(), p2p(cachePolicy="LFU", enableAsyncLoading=True), rule=5) == []


def test_rule5_rejects_upstream_p2p_without_async_loading() -> None:
    plain = {
        "pullMode": False,
        "delayPull": False,
        "useNPU": False,
        "hostStaging": {"enabled": False},
    }
    problem = _one(_problems(pool(), p2p(engine={"platform": "cpu"}, transfer=plain), rule=5))
    assert problem.path == "P2PGroup/grp: spec.enableAsyncLoading"
    assert "only finds peer KV through async lookups" in problem.message
    group = p2p(engine={"platform": "cpu"}, transfer=plain, enableAsyncLoading=True)
    assert _problems(pool(), group, rule=5) == []


def test_rule5_rejects_ascend_options_and_pull_modes_elsewhere() -> None:
    group = p2p(
        enableAsyncLoading=True,
        engine={"platform": "cuda"},
        transfer={"delayPull": False, "useNPU": False, "hostStaging": {"enabled": False}},
    )
    problem = _one(_problems(pool(), group, rule=5))
    assert problem.path == "P2PGroup/grp: spec.transfer.pullMode"
    pair = pd(prefill={"engine": {"platform": "cpu"}}, decode={"engine": {"platform": "cpu"}})
    problem = _one(_problems(pool(), pair, rule=5))
    assert problem.message.startswith("mode pull-delay needs LMCache-Ascend")
    nixl_on_ascend = _problems(pool(), pd(transfer={"channel": "nixl"}), rule=5)
    assert _one(nixl_on_ascend).message == "channel nixl is not available on platform ascend"


# rule 6: p2p_pull_pending_ttl only in extra_config; overrides checked -----------------------


def test_rule6_passes_with_spec_field() -> None:
    assert _problems(pool(), p2p(transfer={"pullPendingTTLSeconds": 30}), rule=6) == []


def test_rule6_rejects_top_level_pull_pending_ttl_override() -> None:
    group = p2p(engine={"lmcacheOverrides": {"p2p_pull_pending_ttl": 30}})
    problem = _one(_problems(pool(), group, rule=6))
    assert problem.path == "P2PGroup/grp: spec.engine.lmcacheOverrides.p2p_pull_pending_ttl"
    assert "only from extra_config" in problem.message


def test_overrides_reject_managed_unknown_and_foreign_keys() -> None:
    group = p2p(
        enableAsyncLoading=True,
        engine={
            "platform": "cuda",
            "lmcacheOverrides": {
                "chunk_size": 512,
                "chunk_sise": 1,
                "store_async": True,
                "remote_serde": "cachegen",
            },
        },
        transfer={
            "pullMode": False,
            "delayPull": False,
            "useNPU": False,
            "hostStaging": {"enabled": False},
        },
    )
    messages = sorted(p.message for p in validate_domain(pool(), [group]))
    assert messages == [
        "chunk_sise is not a key of the pinned LMCache (0.5.6); LMCache would ignore it silently",
        "chunk_size is derived by kvpool from the pool and member spec",
        "remote_serde is derived by kvpool from the pool and member spec",
        "store_async is an LMCache-Ascend key; LMCache on cuda ignores it",
    ]


# rule 7: buffers hold a chunk; staging and memory warnings ----------------------------------


def test_rule7_passes_with_buffers_of_one_chunk() -> None:
    # Qwen3-8B-like, TP 2: 36 layers x 2 x 4 heads x 128 x 2 B = 73728 B/token; 18 MiB/chunk.
    assert _problems(pool(), pd(transfer={"bufferSize": 18874368}), rule=7) == []


def test_rule7_rejects_buffer_smaller_than_a_chunk() -> None:
    problem = _one(_problems(pool(), pd(transfer={"bufferSize": 18874367}), rule=7))
    assert problem.path == "PDPair/pair: spec.transfer.bufferSize"
    assert problem.message.endswith("256 tokens x 73728 B/token/rank = 18Mi")
    assert problem.fix == "set it to at least 18Mi (18874368 bytes)"


def test_rule7_checks_the_pd_buffer_against_the_smaller_tp_side() -> None:
    """Prefill TP 1 holds all 8 KV heads per rank: a chunk is 36 MiB there, 18 MiB at TP 2."""
    mixed = {"prefill": {"tensorParallelSize": 1}, "transfer": {"bufferSize": 18874368}}
    problem = _one(_problems(pool(), pd(**mixed), rule=7))
    assert problem.path == "PDPair/pair: spec.transfer.bufferSize"
    assert problem.fix == "set it to at least 36Mi (37748736 bytes)"
    ok = {"prefill": {"tensorParallelSize": 1}, "transfer": {"bufferSize": 37748736}}
    assert _problems(pool(), pd(**ok), rule=7) == []


def test_rule7_warns_on_small_staging_and_memory_over_allocatable() -> None:
    group = p2p(
        transfer={"hostStaging": {"expectedConcurrentRequests": 8, "expectedHitTokens": 32768}}
    )
    the_pool = pool(nodeAllocatableMemory="32Gi")
    problems = validate_domain(the_pool, [group])
    assert errors(problems) == []
    found = sorted(p.message for p in warnings(problems))
    assert found[0].startswith("8Gi holds less than 8 concurrent x 32768 hit tokens")
    assert found[1].startswith("each p2p pod requests 48Gi of memory (48Gi pinned by LMCache")


def test_memory_budget_matches_seed_manual_example() -> None:
    budget = memory_budgets(pool(), [p2p()])["P2PGroup/grp"]
    assert budget.workers == 4
    assert budget.total_bytes == 96 * 2**30
    assert (
        budget.formula == "2 instances x TP 2 = 4 workers x (8Gi staging + 16Gi CPU cache) = 96Gi"
    )


# rule 8: PD constraints ----------------------------------------------------------------------


def test_rule8_passes_matching_platforms() -> None:
    assert _problems(pool(), pd(), rule=8) == []


def test_rule8_rejects_layerwise_mixed_platforms_and_p2p_on_pd() -> None:
    assert _one(_problems(pool(), pd(useLayerwise=True), rule=8)).message == (
        "PD with use_layerwise raises ValueError in LMCache(-Ascend)"
    )
    mixed = pd(decode={"engine": {"platform": "cuda"}})
    assert (
        "prefill runs on ascend but decode on cuda"
        in _one(_problems(pool(), mixed, rule=8)).message
    )
    both = pd(prefill={"engine": {"lmcacheOverrides": {"enable_p2p": True}}})
    assert (
        _one(_problems(pool(), both, rule=8)).message
        == "PD and P2P on one instance is not supported"
    )


# rule 9: accelerators >= TP ------------------------------------------------------------------


def test_rule9_passes_default_count() -> None:
    assert _problems(pool(), p2p(), rule=9) == []


def test_rule9_rejects_fewer_accelerators_than_tp() -> None:
    problem = _one(_problems(pool(), p2p(engine={"acceleratorCount": 1}), rule=9))
    assert problem.path == "P2PGroup/grp: spec.engine.acceleratorCount"
    assert problem.message == "requests 1 accelerators but tensor parallel size is 2"


# rule 10: MLA + save_only_first_rank -> eager HostStaging CPU pull ---------------------------


def _mla_pool() -> KVCachePool:
    return pool(model={"mla": True, "numKvHeads": 1, "headDim": 576})


def test_rule10_passes_eager_staging_cpu_pull() -> None:
    group = p2p(saveOnlyFirstRank=True, transfer={"delayPull": False, "useNPU": False})
    assert _problems(_mla_pool(), group, rule=10) == []


def test_rule10_rejects_delay_pull_with_save_only_first_rank() -> None:
    problem = _one(_problems(_mla_pool(), p2p(saveOnlyFirstRank=True), rule=10))
    assert problem.path == "P2PGroup/grp: spec.transfer"
    assert problem.message.endswith("got delayPull=True, useNPU=True")


def test_rule10_warns_when_model_is_not_mla() -> None:
    problem = _one(_problems(pool(), p2p(saveOnlyFirstRank=True), rule=10))
    assert problem.severity == "warning"


def test_pool_checks_remote_tier_and_persistence() -> None:
    the_pool = pool(
        tiers={"remote": {"redis": {"url": "redis://r:6379"}, "mooncake": {"segmentSize": "1Gi"}}},
        controller={"persistence": {"mode": "redis"}},
    )
    messages = [p.message for p in validate_domain(the_pool, [])]
    assert messages == [
        "set exactly one remote tier (mooncake or redis)",
        "persistence mode redis needs a Redis URL",
    ]


def test_pool_checks_refuse_a_redis_url_outside_mode_redis() -> None:
    """The controller refuses --redis-url with --persistence full-sync or none: so does this."""
    for mode in ("full-sync", "none"):
        the_pool = pool(controller={"persistence": {"mode": mode, "redisUrl": "redis://r:6379"}})
        problem = _one(errors(validate_domain(the_pool, [])))
        assert problem.path.endswith("spec.controller.persistence.redisUrl"), problem
        assert f"persistence mode is {mode}" in problem.message
        assert "set mode: redis" in problem.fix
