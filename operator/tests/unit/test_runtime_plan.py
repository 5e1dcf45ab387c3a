"""The runtime's pure decisions: child diff and prune, readiness, drift, admission, settings."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from op_builders import demo_docs
from pydantic import ValidationError

from kvpool.operator.derive import names
from kvpool.operator.runtime import admission, drift, plan
from kvpool.operator.runtime.settings import OperatorSettings

Obj = dict[str, Any]


def planned(children: list[Obj] | None = None, pods: list[Obj] | None = None) -> plan.Plan:
    pool, *members = demo_docs()
    observed = plan.Observed("default", "demo", pool, members, children or [], pods or [])
    return plan.plan_domain(observed, "2026-01-01T00:00:00Z", lambda child, owner: None)


def test_subset_ignores_server_defaults_but_not_changed_values() -> None:
    want = {"spec": {"ports": [{"port": 1}]}, "metadata": {"labels": {"a": "b"}}}
    have = {
        "spec": {"ports": [{"port": 1, "protocol": "TCP"}]},
        "metadata": {"labels": {"a": "b"}, "uid": "u"},
    }
    assert plan.subset(want, have)
    assert not plan.subset(
        want, {"spec": {"ports": [{"port": 2}]}, "metadata": {"labels": {"a": "b"}}}
    )
    assert not plan.subset({"l": [1, 2]}, {"l": [1]})


def test_a_fresh_domain_creates_everything_and_a_converged_one_writes_nothing() -> None:
    first = planned()
    assert first.create and not first.patch and not first.delete
    converged = planned(first.create)
    assert not converged.create and not converged.patch and not converged.delete


def test_changed_children_are_patched_and_unrendered_ones_pruned() -> None:
    children = copy.deepcopy(planned().create)
    children[0]["data"] = {"stale": "1"}
    stray = copy.deepcopy(children[1])
    stray["metadata"]["name"] = "demo-old-member"
    result = planned([*children, stray])
    assert [c["metadata"]["name"] for c, _ in result.patch] == [children[0]["metadata"]["name"]]
    assert [o["metadata"]["name"] for o in result.delete] == ["demo-old-member"]


def test_a_configmap_key_no_longer_rendered_is_removed_by_its_patch() -> None:
    """A merge patch keeps keys it does not name: an instance scaled away would leave its
    LMCache config in the member's ConfigMap (a real API server does the same)."""
    children = planned().create
    lmcache = next(c for c in children if c["metadata"]["name"] == "demo-p2p-lmcache")
    stale = {**lmcache, "data": {**lmcache["data"], "demo-p2p-9.yaml": "old: 1\n"}}
    rest = [c for c in children if c is not lmcache]
    (current, patch), *_ = planned([*rest, stale]).patch
    assert current["metadata"]["name"] == "demo-p2p-lmcache"
    assert patch["data"]["demo-p2p-9.yaml"] is None
    assert patch["data"]["demo-p2p-0.yaml"] == lmcache["data"]["demo-p2p-0.yaml"]


def test_invalid_domain_writes_no_child_and_reports_each_resource() -> None:
    pool, p2p, pd = demo_docs()
    pool["spec"]["tiers"] = {"disk": {"path": "/kv", "size": "1Gi"}}
    observed = plan.Observed("default", "demo", pool, [p2p, pd], [], [])
    result = plan.plan_domain(observed, "2026-01-01T00:00:00Z", lambda c, o: None)
    assert not result.create and "KVCachePool/demo" in result.invalid
    assert [e[2] for e in result.events] == ["InvalidSpec"]
    # The same problems on the next pass: no second Event.
    pool["status"] = next(st for body, st in result.statuses if body is pool)
    again = plan.plan_domain(observed, "2026-01-01T00:00:05Z", lambda c, o: None)
    assert again.events == []


def test_ready_instances_need_the_current_generation() -> None:
    sts = {
        "kind": "StatefulSet",
        "metadata": {"name": "i", "generation": 2},
        "spec": {"replicas": 1},
    }
    sts["status"] = {"readyReplicas": 1, "observedGeneration": 1}
    assert plan.ready_instances([sts]) == set()
    sts["status"]["observedGeneration"] = 2
    assert plan.ready_instances([sts]) == {"i"}


def test_drift_names_pods_behind_the_templates() -> None:
    desired = planned().create
    template = next(o for o in desired if o["metadata"]["name"] == "demo-p2p-0")["spec"]["template"]
    pod = {
        "metadata": {"name": "demo-p2p-0-0", **copy.deepcopy(template["metadata"])},
        "spec": copy.deepcopy(template["spec"]),
    }
    assert drift.observe([pod], desired).seed == []
    pod["metadata"]["annotations"][names.ANNOTATION_FINGERPRINT] = "000000000000"
    pod["spec"]["containers"][0]["env"][0]["value"] = "99"
    found = drift.observe([pod], desired)
    assert len(found.seed) == 2 and all("demo-p2p-0-0" in m for m in found.seed)
    assert found.stale == ["demo-p2p-0-0"] and found.only("demo-p2p").seed == found.seed


def test_admission_refuses_only_what_the_change_introduces() -> None:
    pool, p2p, _ = demo_docs()
    bad = copy.deepcopy(p2p)
    bad["spec"]["ports"] = {"base": 70000}
    assert admission.review("CREATE", p2p, None, pool, []).allowed
    refused = admission.review("CREATE", bad, None, pool, [])
    assert not refused.allowed and "spec.ports.base" in refused.message()
    assert admission.review("UPDATE", p2p, bad, pool, [bad]).allowed
    assert not admission.review("DELETE", None, pool, pool, [p2p]).allowed
    assert admission.review("CREATE", p2p, None, None, []).warnings


def test_settings_reject_unknown_modes_and_read_flags() -> None:
    with pytest.raises(ValidationError):
        OperatorSettings(webhook_mode="sometimes")  # type: ignore[arg-type]
    s = OperatorSettings(
        _cli_parse_args=["--namespace", "a", "--namespace", "b", "--health-port", "0"]
    )
    assert s.namespace == ["a", "b"] and s.health_port == 0 and not s.clusterwide
