"""The local control plane's StatefulSet and Deployment controllers and pod status: pure.

What the operator reads back (``readyReplicas``) and what ``kubectl get pods`` shows come from
these decisions; the e2e suite watches them happen with real processes.
"""

from __future__ import annotations

from typing import Any

from kvpool.operator.cluster import workloads

TEMPLATE = {
    "metadata": {"labels": {"app": "x"}},
    "spec": {"containers": [{"name": "c", "command": ["run"]}]},
}


def _sts(replicas: int = 2, template: dict[str, Any] = TEMPLATE) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": "w", "namespace": "ns", "uid": "u1", "generation": 3},
        "spec": {
            "replicas": replicas,
            "serviceName": "w",
            "selector": {"matchLabels": {"app": "x"}},
            "template": template,
        },
    }


def _materialise(pods: list[dict[str, Any]], ready: bool = True) -> list[dict[str, Any]]:
    out = []
    for p in pods:
        status = "True" if ready else "False"
        out.append(
            {
                **p,
                "metadata": {**p["metadata"], "uid": p["metadata"].get("name", "g")},
                "status": {"conditions": [{"type": "Ready", "status": status}]},
            }
        )
    return out


def test_statefulset_creates_ordinals_in_order_then_reports_ready() -> None:
    sts = _sts()
    first = workloads.statefulset(sts, [])
    assert [p["metadata"]["name"] for p in first.create] == ["w-0"]  # w-1 waits for w-0
    pod = first.create[0]
    assert pod["spec"]["hostname"] == "w-0" and pod["spec"]["subdomain"] == "w"
    assert pod["metadata"]["ownerReferences"][0]["uid"] == "u1"
    assert pod["metadata"]["labels"]["app"] == "x"
    second = workloads.statefulset(sts, _materialise(first.create))
    assert [p["metadata"]["name"] for p in second.create] == ["w-1"]
    both = _materialise(first.create + second.create)
    done = workloads.statefulset(sts, both)
    assert done.create == [] and done.delete == []
    assert done.status["readyReplicas"] == 2 and done.status["observedGeneration"] == 3


def test_statefulset_scales_down_from_the_top_and_rolls_one_pod_at_a_time() -> None:
    pods = _materialise(workloads.statefulset(_sts(1), []).create)
    pods += _materialise(workloads.statefulset(_sts(2), pods).create)
    assert workloads.statefulset(_sts(1), pods).delete == ["w-1"]
    changed = {**TEMPLATE, "metadata": {"labels": {"app": "x", "v": "2"}}}
    roll = workloads.statefulset(_sts(2, changed), pods)
    assert roll.delete == ["w-1"]  # the highest outdated ordinal first, one at a time
    assert roll.status["updatedReplicas"] == 0


def _deploy(template: dict[str, Any] = TEMPLATE, replicas: int = 1) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d", "namespace": "ns", "uid": "u2", "generation": 1},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": "x"}},
            "template": template,
        },
    }


def test_deployment_recreates_old_pods_before_new_ones() -> None:
    first = workloads.deployment(_deploy(), [])
    (pod,) = first.create
    assert pod["metadata"]["generateName"].startswith("d-")
    pods = _materialise([{**pod, "metadata": {**pod["metadata"], "name": "d-abc-1"}}])
    assert workloads.deployment(_deploy(), pods).status["availableReplicas"] == 1
    changed = {**TEMPLATE, "metadata": {"labels": {"app": "x", "v": "2"}}}
    roll = workloads.deployment(_deploy(changed), pods)
    assert roll.delete == ["d-abc-1"] and roll.create == []  # old pods go first
    gone = [{**pods[0], "metadata": {**pods[0]["metadata"], "deletionTimestamp": "now"}}]
    assert workloads.deployment(_deploy(changed), gone).create == []  # still terminating
    assert len(workloads.deployment(_deploy(changed), []).create) == 1


def test_pod_status_reports_running_crashloop_and_config_errors() -> None:
    running = workloads.Container(
        "c",
        "img",
        "running",
        ready=True,
        restarts=1,
        pid=42,
        started_at="t0",
        last_exit=137,
        finished_at="t-1",
    )
    status = workloads.pod_status(running, None, "t1")
    assert status["phase"] == "Running" and status["podIP"] == "127.0.0.1"
    (cs,) = status["containerStatuses"]
    assert cs["ready"] and cs["restartCount"] == 1 and cs["containerID"] == "kvpool://42"
    assert cs["lastState"]["terminated"]["exitCode"] == 137
    ready = {c["type"]: c for c in status["conditions"]}["Ready"]
    assert ready["status"] == "True" and ready["lastTransitionTime"] == "t1"
    again = workloads.pod_status(running, status, "t2")
    assert {c["type"]: c for c in again["conditions"]}["Ready"]["lastTransitionTime"] == "t1"
    waiting = workloads.Container(
        "c", "img", "waiting", reason="CreateContainerConfigError", message="no Secret"
    )
    status = workloads.pod_status(waiting, None, "t1")
    assert status["phase"] == "Pending"
    assert status["containerStatuses"][0]["state"]["waiting"]["reason"] == (
        "CreateContainerConfigError"
    )
