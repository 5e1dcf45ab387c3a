"""Scale to zero, the memory each worker pod requests, and the defaults kvpool reports."""

from __future__ import annotations

import kubernetes_validate
from op_builders import POOL, merge, p2p, pd, pool

from kvpool.operator.api import KVCachePool
from kvpool.operator.derive.defaults import domain_defaults
from kvpool.operator.render import render, render_domain
from kvpool.operator.status import member_status, pool_status
from kvpool.operator.validation import errors, validate_domain

T0 = "2026-01-01T00:00:00Z"


def _ready(status: object) -> tuple[str, str, str]:
    cond = next(c for c in status.conditions if c.type == "Ready")  # type: ignore[attr-defined]
    return cond.status, cond.reason, cond.message


def test_replicas_zero_is_valid_renders_no_workers_and_ready_says_why() -> None:
    the_pool, group = pool(), p2p(replicas=0)
    assert errors(validate_domain(the_pool, [group])) == []
    objects = render(the_pool, group)
    assert not [o for o in objects if o["kind"] == "StatefulSet"]
    for obj in render_domain(the_pool, [group]):
        kubernetes_validate.validate(obj, "1.33", strict=True)
    status, reason, message = _ready(member_status(the_pool, group, [], set(), T0))
    assert (status, reason) == ("True", "ScaledToZero")
    assert "replicas: 0" in message
    assert _ready(pool_status(the_pool, [group], [], set(), T0))[1] == "ScaledToZero"


def test_pd_pair_with_one_side_at_zero_is_not_ready_and_warns() -> None:
    the_pool, pair = pool(), pd(prefill={"replicas": 0})
    problems = validate_domain(the_pool, [pair])
    assert not errors(problems)
    status = member_status(the_pool, pair, problems, {"pair-decode-0"}, T0)
    ready, reason, message = _ready(status)
    assert (ready, reason) == ("False", "PairIncomplete")
    assert "spec.prefill.replicas" in message
    assert any("prefill is scaled to zero" in w for w in status.warnings)


def test_worker_pods_request_lmcache_host_memory_plus_the_engine() -> None:
    """8Gi staging + 16Gi CPU cache per rank x TP 2 = 48Gi, plus the engine's 3Gi request."""
    group = p2p(engine={"resources": {"requests": {"memory": "3Gi"}, "limits": {"memory": "4Gi"}}})
    sts = next(o for o in render(pool(), group) if o["kind"] == "StatefulSet")
    resources = sts["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources["requests"]["memory"] == "51Gi"
    assert resources["limits"]["memory"] == "52Gi"
    budget = member_status(pool(), group, [], set(), T0).memory_budget
    assert budget is not None and budget.pod_memory_request_bytes == 51 * 2**30


def test_pd_pods_request_their_side_s_pinned_memory() -> None:
    pair = pd(transfer={"mode": "cpu-offload-pull-delay", "cpuBufferSize": "4Gi"})
    memory = {
        o["metadata"]["name"]: o["spec"]["template"]["spec"]["containers"][0]["resources"]
        .get("requests", {})
        .get("memory")
        for o in render(pool(), pair)
        if o["kind"] == "StatefulSet"
    }
    assert memory == {"pair-prefill-0": "8Gi", "pair-decode-0": None}


def test_status_warns_when_a_pod_exceeds_a_node() -> None:
    the_pool = pool(nodeAllocatableMemory="32Gi")
    group = p2p()
    problems = validate_domain(the_pool, [group])
    status = member_status(the_pool, group, problems, set(), T0)
    assert any("can never be scheduled" in w for w in status.warnings)
    assert pool_status(the_pool, [group], problems, set(), T0).warnings == status.warnings


def test_defaults_are_reported() -> None:
    doc = merge(POOL, {})
    del doc["spec"]["tiers"]
    the_pool = KVCachePool.model_validate(doc)
    filled = [str(d) for d in domain_defaults(the_pool, [p2p(), pd(transfer={"mode": "push"})])]
    assert (
        "KVCachePool/pool: spec.tiers.cpu.size = 5Gi (default; max_local_cpu_size per TP rank)"
        in filled
    )
    assert any(d.startswith("P2PGroup/grp: spec.transfer.hostStaging.bytes = 8Gi") for d in filled)
    assert any(d.startswith("P2PGroup/grp: spec.transfer.npuBufferSize = 128Mi") for d in filled)
    assert any(d.startswith("PDPair/pair: spec.transfer.bufferSize = 128Mi") for d in filled)
    assert any(d.startswith("PDPair/pair: spec.transfer.bufferDevice = npu") for d in filled)
    assert any(d.startswith("P2PGroup/grp: spec.engine.acceleratorCount = 2") for d in filled)
    given = pd(transfer={"mode": "push", "bufferSize": "256Mi", "bufferDevice": "npu"})
    assert not [d for d in domain_defaults(pool(), [given]) if d.field.startswith("spec.transfer")]
