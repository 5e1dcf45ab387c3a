"""What the StatefulSet and Deployment controllers and the scheduler decide: pure.

Why: the operator creates StatefulSets (one per worker instance) and Deployments (controller,
gateway, the operator itself through the chart); a cluster turns them into pods, rolls them
when their template changes and reports their readiness back in their status, which the
operator's reconcile reads (``readyReplicas``). Given a workload and its pods, these functions
say which pods to create and delete and what the workload's status is; the controller loop
(``controllers.py``) only reads, calls them and writes.

Kept from Kubernetes: StatefulSet pods named ``<name>-<ordinal>`` with ``hostname`` and
``subdomain`` (their DNS name under the headless Service), created in order, the highest
ordinal removed first on scale-down, one outdated pod replaced at a time once the updated
ones are Ready; Deployment pods ``<name>-<template hash>-<random>`` with ``pod-template-hash``.
Changed for one machine (README): a Deployment always rolls like ``strategy: Recreate`` (every
pod of a workload binds the same local ports, so old and new cannot run side by side), no
ReplicaSets or ControllerRevisions are created, and the rolling update does not wait for an
outdated pod that is not Ready.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.operator.cluster.selectors import selector_matcher, selector_string

Obj = Mapping[str, Any]
NODE = "kvpool-local"
REVISION_LABEL = "controller-revision-hash"
TEMPLATE_HASH_LABEL = "pod-template-hash"
POD_NAME_LABEL = "statefulset.kubernetes.io/pod-name"


@dataclass
class Actions:
    """Pods to create (full bodies) and to delete (names), and the workload's new status."""

    create: list[dict[str, Any]] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)


def template_hash(template: Obj) -> str:
    """A stable short hash of a pod template (the revision of its pods)."""
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def is_ready(pod: Obj) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def terminating(pod: Obj) -> bool:
    return bool(pod["metadata"].get("deletionTimestamp"))


def owned_by(pod: Obj, owner: Obj) -> bool:
    uid = owner["metadata"].get("uid")
    return any(
        r.get("uid") == uid and r.get("controller")
        for r in pod["metadata"].get("ownerReferences") or []
    )


def pod_for(
    owner: Obj, name: str | None, labels: Mapping[str, str], **spec_extra: Any
) -> dict[str, Any]:
    """A pod of ``owner``'s template: its labels plus ``labels``, a controller reference."""
    template = owner["spec"]["template"]
    meta = template.get("metadata") or {}
    pod_meta: dict[str, Any] = {
        "namespace": owner["metadata"]["namespace"],
        "labels": {**(meta.get("labels") or {}), **labels},
        "ownerReferences": [
            {
                "apiVersion": owner.get("apiVersion", "apps/v1"),
                "kind": owner["kind"],
                "name": owner["metadata"]["name"],
                "uid": owner["metadata"]["uid"],
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ],
    }
    if name is None:
        pod_meta["generateName"] = f"{owner['metadata']['name']}-{labels[TEMPLATE_HASH_LABEL]}-"
    else:
        pod_meta["name"] = name
    if meta.get("annotations"):
        pod_meta["annotations"] = dict(meta["annotations"])
    spec = {**json.loads(json.dumps(template.get("spec") or {})), **spec_extra}
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": pod_meta, "spec": spec}


def _pods_of(owner: Obj, pods: Sequence[Obj]) -> list[Obj]:
    match = selector_matcher(owner["spec"].get("selector"))
    return [p for p in pods if owned_by(p, owner) and match(p["metadata"].get("labels") or {})]


def statefulset(sts: Obj, pods: Sequence[Obj]) -> Actions:
    """Create missing ordinals (in order), remove ordinals past ``replicas`` (highest first),
    replace one outdated pod at a time once every updated pod is Ready."""
    name = sts["metadata"]["name"]
    replicas = int(sts["spec"].get("replicas", 1))
    revision = f"{name}-{template_hash(sts['spec']['template'])}"
    parallel = sts["spec"].get("podManagementPolicy") == "Parallel"
    mine = {p["metadata"]["name"]: p for p in _pods_of(sts, pods)}
    out = Actions()
    for ordinal in range(replicas):
        pod_name = f"{name}-{ordinal}"
        if pod_name in mine:
            continue
        earlier = [mine.get(f"{name}-{i}") for i in range(ordinal)]
        if not parallel and not all(p is not None and is_ready(p) for p in earlier):
            break
        labels = {REVISION_LABEL: revision, POD_NAME_LABEL: pod_name}
        extra = {"hostname": pod_name}
        if sts["spec"].get("serviceName"):
            extra["subdomain"] = sts["spec"]["serviceName"]
        out.create.append(pod_for(sts, pod_name, labels, **extra))
    extra_pods = sorted(
        (n for n in mine if _ordinal(n, name) >= replicas), key=lambda n: -_ordinal(n, name)
    )
    out.delete += [n for n in extra_pods if not terminating(mine[n])]
    live = [p for n, p in mine.items() if _ordinal(n, name) < replicas and not terminating(p)]
    outdated = [
        p for p in live if (p["metadata"].get("labels") or {}).get(REVISION_LABEL) != revision
    ]
    updated = [p for p in live if p not in outdated]
    if outdated and all(is_ready(p) for p in updated):
        worst = max(outdated, key=lambda p: _ordinal(p["metadata"]["name"], name))
        out.delete.append(worst["metadata"]["name"])
    current = [p for p in mine.values() if not terminating(p)]
    ready = sum(1 for p in current if is_ready(p))
    n_updated = len([p for p in current if p not in outdated])
    out.status = {
        "observedGeneration": sts["metadata"].get("generation", 1),
        "replicas": len(current),
        "readyReplicas": ready,
        "availableReplicas": ready,
        "currentReplicas": n_updated,
        "updatedReplicas": n_updated,
        "currentRevision": revision,
        "updateRevision": revision,
        "collisionCount": 0,
    }
    return out


def _ordinal(pod_name: str, sts_name: str) -> int:
    tail = pod_name[len(sts_name) + 1 :]
    return int(tail) if tail.isdigit() else -1


def deployment(deploy: Obj, pods: Sequence[Obj]) -> Actions:
    """Recreate on a template change (old pods first, then new ones), scale to ``replicas``."""
    replicas = int(deploy["spec"].get("replicas", 1))
    current_hash = template_hash(deploy["spec"]["template"])
    mine = _pods_of(deploy, pods)
    old = [
        p
        for p in mine
        if (p["metadata"].get("labels") or {}).get(TEMPLATE_HASH_LABEL) != current_hash
    ]
    new = [p for p in mine if p not in old and not terminating(p)]
    out = Actions()
    out.delete += [p["metadata"]["name"] for p in old if not terminating(p)]
    if not old:
        for _ in range(replicas - len(new)):
            out.create.append(pod_for(deploy, None, {TEMPLATE_HASH_LABEL: current_hash}))
        surplus = sorted(new, key=lambda p: (is_ready(p), p["metadata"]["name"]))
        out.delete += [p["metadata"]["name"] for p in surplus[: max(0, len(new) - replicas)]]
    ready = sum(1 for p in new if is_ready(p))
    available = ready >= replicas
    out.status = {
        "observedGeneration": deploy["metadata"].get("generation", 1),
        "replicas": len([p for p in mine if not terminating(p)]),
        "updatedReplicas": len(new),
        "readyReplicas": ready,
        "availableReplicas": ready,
        "unavailableReplicas": max(0, replicas - ready),
        "selector": selector_string(deploy["spec"].get("selector")),
        "conditions": [
            {
                "type": "Available",
                "status": "True" if available else "False",
                "reason": "MinimumReplicasAvailable" if available else "MinimumReplicasUnavailable",
                "message": "Deployment has minimum availability."
                if available
                else "Deployment does not have minimum availability.",
            },
            {
                "type": "Progressing",
                "status": "True",
                "reason": "NewReplicaSetAvailable"
                if available and not old
                else "ReplicaSetUpdated",
                "message": f'Deployment "{deploy["metadata"]["name"]}" is progressing.',
            },
        ],
    }
    return out


def same_status(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> bool:
    """Whether writing ``new`` would change nothing (condition times aside)."""

    def strip(s: Mapping[str, Any] | None) -> Any:
        s = dict(s or {})
        s["conditions"] = [
            {k: v for k, v in c.items() if k not in ("lastTransitionTime", "lastUpdateTime")}
            for c in s.get("conditions") or []
        ]
        return s

    return bool(strip(old) == strip(new))


def with_times(old: Mapping[str, Any] | None, new: dict[str, Any], now: str) -> dict[str, Any]:
    """``new`` with each condition's lastTransitionTime kept while its status is unchanged."""
    before = {c.get("type"): c for c in (old or {}).get("conditions") or []}
    for cond in new.get("conditions") or []:
        prev = before.get(cond["type"])
        keep = prev is not None and prev.get("status") == cond["status"]
        cond["lastTransitionTime"] = prev.get("lastTransitionTime", now) if keep and prev else now
        cond["lastUpdateTime"] = now if not keep else (prev or {}).get("lastUpdateTime", now)
    return new


# -- pod status (what the kubelet reports) -------------------------------------------------------
@dataclass
class Container:
    """What the kubelet knows about a pod's one container."""

    name: str
    image: str
    state: str  # "running", "waiting" or "terminated"
    reason: str = ""  # waiting/terminated reason (CrashLoopBackOff, CreateContainerConfigError)
    message: str = ""
    ready: bool = False
    restarts: int = 0
    pid: int | None = None
    started_at: str = ""
    last_exit: int | None = None  # exit code of the previous run
    finished_at: str = ""


def pod_status(c: Container, old: Mapping[str, Any] | None, now: str) -> dict[str, Any]:
    """A pod's status from its container: phase, the four conditions (transition times kept
    while unchanged), the container status, the pod IP (every pod is 127.0.0.1 here)."""
    phase = "Running" if c.state == "running" or c.restarts else "Pending"
    state: dict[str, Any]
    if c.state == "running":
        state = {"running": {"startedAt": c.started_at}}
    elif c.state == "terminated":
        state = {
            "terminated": {
                "exitCode": c.last_exit or 0,
                "reason": c.reason or "Error",
                "finishedAt": c.finished_at,
            }
        }
    else:
        state = {
            "waiting": {
                "reason": c.reason or "ContainerCreating",
                **({"message": c.message} if c.message else {}),
            }
        }
    status: dict[str, Any] = {
        "name": c.name,
        "image": c.image,
        "imageID": "",
        "ready": c.ready,
        "started": c.state == "running",
        "restartCount": c.restarts,
        "state": state,
    }
    if c.pid is not None:
        status["containerID"] = f"kvpool://{c.pid}"
    if c.last_exit is not None:
        status["lastState"] = {
            "terminated": {
                "exitCode": c.last_exit,
                "reason": "Completed" if c.last_exit == 0 else "Error",
                "finishedAt": c.finished_at,
            }
        }
    flags = {
        "PodScheduled": True,
        "Initialized": True,
        "ContainersReady": c.ready,
        "Ready": c.ready,
    }
    before = {x.get("type"): x for x in (old or {}).get("conditions") or []}
    conditions = []
    for kind, ok in flags.items():
        value = "True" if ok else "False"
        prev = before.get(kind)
        since = prev.get("lastTransitionTime", now) if prev and prev.get("status") == value else now
        conditions.append(
            {"type": kind, "status": value, "lastProbeTime": None, "lastTransitionTime": since}
        )
    return {
        "phase": phase,
        "conditions": conditions,
        "hostIP": "127.0.0.1",
        "hostIPs": [{"ip": "127.0.0.1"}],
        "podIP": "127.0.0.1",
        "podIPs": [{"ip": "127.0.0.1"}],
        "startTime": (old or {}).get("startTime") or now,
        "containerStatuses": [status],
        "qosClass": "Burstable",
    }
