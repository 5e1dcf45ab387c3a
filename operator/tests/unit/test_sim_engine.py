"""engine.sim (kvpool's simulated engine): the API, its rules, its render and what status says.

Each failing case asserts the field path and the message a person would read; the render
cases pin the worker command line the simulated worker parses (e2e/tests/test_render_parsers.py
runs it through the worker's own parser and start checks).
"""

from __future__ import annotations

from typing import Any

import pytest
from op_builders import merge, p2p, pd, plain_p2p, pool
from pydantic import ValidationError

from kvpool.operator.api import KVCachePool, P2PGroup
from kvpool.operator.derive.defaults import member_defaults
from kvpool.operator.derive.sizing import member_memory_budget
from kvpool.operator.render import render, render_domain
from kvpool.operator.status import member_status
from kvpool.operator.validation import errors, validate_domain, warnings
from kvpool.operator.validation.problems import Problem
from kvpool.protocol.simcore.profile import bundled_profiles

PROFILE = "h100-llama-3.1-8b-vllm"
LLAMA = {"name": "llama", "numLayers": 32, "numKvHeads": 8, "headDim": 128}
T0 = "2026-01-01T00:00:00Z"


def sim_pool(**spec: Any) -> KVCachePool:
    return pool(**merge({"model": LLAMA, "blockSize": 16}, spec))


def sim_group(sim: dict[str, Any] | None = None, **spec: Any) -> P2PGroup:
    engine = {"platform": "cpu", "sim": {"profile": PROFILE, **(sim or {})}}
    base: dict[str, Any] = {"tensorParallelSize": 1, "engine": engine, "p2p": False}
    return plain_p2p(**merge(base, spec))


def reference_group(name: str = "grp", **spec: Any) -> P2PGroup:
    """The reference engine (platform cpu, no sim), P2P off."""
    base: dict[str, Any] = {"tensorParallelSize": 1, "engine": {"platform": "cpu"}, "p2p": False}
    return plain_p2p(name, **merge(base, spec))


def _codes(problems: list[Problem]) -> list[str]:
    return sorted(p.code for p in problems)


def _one(problems: list[Problem], code: str) -> Problem:
    (found,) = [p for p in problems if p.code == code]
    return found


def _command(objects: list[dict[str, Any]], name: str) -> list[str]:
    (sts,) = [o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"] == name]
    command: list[str] = sts["spec"]["template"]["spec"]["containers"][0]["command"]
    return command


# API ------------------------------------------------------------------------------------------


def test_profile_must_be_bundled_and_the_error_names_the_choices() -> None:
    with pytest.raises(ValidationError) as raised:
        sim_group({"profile": "a100-nothing"})
    message = str(raised.value)
    assert "unknown profile 'a100-nothing'" in message
    for name in bundled_profiles():
        assert name in message


def test_speedup_and_limits_are_bounded_and_named_like_the_crd() -> None:
    with pytest.raises(ValidationError, match="speedup"):
        sim_group({"speedup": 0})
    with pytest.raises(ValidationError, match="maxNumSeqs"):
        sim_group({"maxNumSeqs": 0})
    group = sim_group({"deviceKVGiB": 8, "maxNumBatchedTokens": 2048})
    assert group.spec.engine.sim is not None
    assert group.spec.engine.sim.device_kv_gib == 8.0
    dumped = group.model_dump(by_alias=True)
    assert dumped["spec"]["p2p"] is False
    assert dumped["spec"]["engine"]["sim"]["deviceKVGiB"] == 8.0


# rules ----------------------------------------------------------------------------------------


def test_sim_fleet_without_p2p_is_clean() -> None:
    assert validate_domain(sim_pool(), [sim_group()]) == []


def test_sim_runs_on_cpus() -> None:
    group = sim_group(engine={"platform": "cuda"})
    problem = _one(validate_domain(sim_pool(), [group]), "sim.platform")
    assert problem.path == "P2PGroup/grp: spec.engine.platform"
    assert problem.message == (
        f"a sim engine runs on CPUs, not cuda: the profile {PROFILE} names the simulated chip"
    )
    assert problem.fix == "set engine.platform: cpu"


def test_no_remote_tier_in_a_pool_with_sim_members() -> None:
    the_pool = sim_pool(tiers={"remote": {"redis": {"url": "redis://r:6379"}}})
    problem = _one(validate_domain(the_pool, [sim_group()]), "sim.remote")
    assert problem.path == "KVCachePool/pool: spec.tiers.remote"
    assert "models local tiers and P2P, not a remote store" in problem.message
    assert problem.fix == "remove tiers.remote or use the reference engine (remove engine.sim)"


def test_pd_transfers_are_not_simulated() -> None:
    cpu = {"tensorParallelSize": 1, "engine": {"platform": "cpu"}}
    sim = {"tensorParallelSize": 1, "engine": {"platform": "cpu", "sim": {"profile": PROFILE}}}
    pair = pd(prefill=cpu, decode=sim, transfer={"mode": "push"})
    problem = _one(validate_domain(sim_pool(), [pair]), "sim.pd")
    assert problem.path == "PDPair/pair: spec.decode.engine.sim"
    assert problem.message == "PD transfers are not simulated"
    assert problem.fix.startswith("remove decode.engine.sim")


def test_sim_is_one_tp_rank_no_mla_no_layerwise_no_blending() -> None:
    the_pool = sim_pool(model={"mla": True, "numKvHeads": 1})
    group = sim_group(
        tensorParallelSize=2,
        useLayerwise=True,
        engine={"lmcacheOverrides": {"enable_blending": True}},
    )
    problems = validate_domain(the_pool, [group])
    assert _codes(errors(problems)) == [
        "sim.blending",
        "sim.layerwise",
        "sim.mla",
        "sim.tp",
    ]
    assert _one(problems, "sim.tp").path == "P2PGroup/grp: spec.tensorParallelSize"
    assert "counted twice" in _one(problems, "sim.mla").message


def test_simulated_device_holds_one_longest_request() -> None:
    # 32 layers x 2 x 8 heads x 128 x 2 B = 128 KiB per token: 1 GiB holds 8192 tokens.
    group = sim_group({"deviceKVGiB": 1}, engine={"maxModelLen": 16384})
    problem = _one(validate_domain(sim_pool(), [group]), "sim.device")
    assert problem.path == "P2PGroup/grp: spec.engine.sim.deviceKVGiB"
    assert "hold 512 blocks of 16 tokens, fewer than the 1024" in problem.message
    assert problem.fix == "set engine.sim.deviceKVGiB: 2, or lower spec.engine.maxModelLen"
    fixed = sim_group({"deviceKVGiB": 2}, engine={"maxModelLen": 16384})
    assert validate_domain(sim_pool(), [fixed]) == []


def test_sim_counts_kv_bytes_in_any_dtype_the_reference_engine_refuses() -> None:
    the_pool = sim_pool(model={"kvDtype": "float8_e4m3fn"})
    assert validate_domain(the_pool, [sim_group()]) == []
    assert _codes(validate_domain(the_pool, [reference_group()])) == ["kv-dtype.reference"]


def test_owned_sim_flags_are_refused_in_engine_args_but_vllm_may_set_its_own() -> None:
    group = sim_group(engine={"args": ["--max-num-seqs=4", "--sim-speedup=2"]})
    problems = [p for p in validate_domain(sim_pool(), [group]) if p.rule == 1]
    fixes = sorted(p.fix for p in problems)
    assert fixes == [
        "remove --max-num-seqs from spec.engine.args; set it through engine.sim.maxNumSeqs",
        "remove --sim-speedup from spec.engine.args; set it through engine.sim.speedup",
    ]
    vllm = p2p(engine={"args": ["--max-num-seqs=128"]})
    assert [p for p in validate_domain(pool(), [vllm]) if p.rule == 1] == []


# render ---------------------------------------------------------------------------------------


def test_sim_worker_command_carries_profile_shape_and_the_set_limits() -> None:
    limits = {"speedup": 4, "deviceKVGiB": 20, "maxNumSeqs": 64, "maxNumBatchedTokens": 4096}
    command = _command(render(sim_pool(), sim_group(limits)), "grp-0")
    assert command[:4] == ["kvpool-worker", "serve", "--engine", "sim"]
    flags = dict(zip(command[2::2], command[3::2], strict=False))
    assert flags["--sim-profile"] == PROFILE
    assert flags["--sim-speedup"] == "4.0"
    assert (flags["--num-layers"], flags["--num-kv-heads"], flags["--head-dim"]) == (
        "32",
        "8",
        "128",
    )
    assert flags["--sim-device-kv-gib"] == "20.0"
    assert (flags["--max-num-seqs"], flags["--max-num-batched-tokens"]) == ("64", "4096")
    default = _command(render(sim_pool(), sim_group()), "grp-0")
    assert "--max-num-seqs" not in default and "--sim-device-kv-gib" not in default


def test_sim_pod_requests_no_accelerator_and_no_lmcache_host_memory() -> None:
    group = sim_group(engine={"resources": {"requests": {"memory": "256Mi", "cpu": "100m"}}})
    (sts,) = [o for o in render(sim_pool(), group) if o["kind"] == "StatefulSet"][:1]
    container = sts["spec"]["template"]["spec"]["containers"][0]
    # a reference worker of the same pool requests 256Mi + 16Gi (its CPU tier, pinned)
    assert container["resources"] == {"requests": {"cpu": "100m", "memory": "256Mi"}}
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    reference = reference_group(engine={"resources": {"requests": {"memory": "256Mi"}}})
    (ref,) = [o for o in render(sim_pool(), reference) if o["kind"] == "StatefulSet"][:1]
    ref_memory = ref["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]
    assert ref_memory["memory"] == "16640Mi"


def test_sim_memory_budget_and_defaults_say_what_is_simulated() -> None:
    budget = member_memory_budget(sim_pool(), sim_group(replicas=16))
    assert budget.total_bytes == 0 and budget.per_instance_bytes == 0
    assert budget.formula == (
        "16 instances x TP 1 = 16 workers x (0: sim, its tiers are simulated and allocate no "
        "host memory) = 0"
    )
    filled = [str(d) for d in member_defaults(sim_group({"maxNumSeqs": 8}))]
    assert filled == [
        f"P2PGroup/grp: spec.engine.sim.deviceKVGiB = 57 (default; the profile {PROFILE}'s "
        "GiB of device KV)",
        f"P2PGroup/grp: spec.engine.sim.maxNumBatchedTokens = 8192 (default; the profile "
        f"{PROFILE}'s tokens per engine step)",
    ]
    status = member_status(sim_pool(), sim_group(), [], set(), T0)
    assert any("deviceKVGiB = 57" in line for line in status.defaults)


def test_no_node_memory_warning_for_simulated_tiers() -> None:
    the_pool = sim_pool(nodeAllocatableMemory="8Gi", tiers={"cpu": {"size": "64Gi"}})
    assert warnings(validate_domain(the_pool, [sim_group()])) == []
    assert _codes(warnings(validate_domain(the_pool, [reference_group()]))) == ["budget.node:p2p"]


def test_a_reference_and_a_sim_group_share_one_domain_and_one_hashing() -> None:
    members: list[Any] = [sim_group(), reference_group("ref", ports={"base": 21000})]
    assert validate_domain(sim_pool(), members) == []
    objects = render_domain(sim_pool(), members)
    (controller,) = [
        o
        for o in objects
        if o["kind"] == "Deployment" and o["metadata"]["name"] == "pool-controller"
    ]
    assert "--vllm" not in controller["spec"]["template"]["spec"]["containers"][0]["command"]
