"""The controller manager and scheduler of ``kvpool-operator cluster``: in-process, level-driven.

Why: what the operator creates is StatefulSets and Deployments; a cluster's controllers turn
them into pods, roll them, and report ``readyReplicas`` back, and its scheduler binds each pod
to a node. Here one loop does that for every workload after any change in the store (and once
a second): it reads the workloads and pods, asks the pure ``workloads`` module what to create,
delete and report, and writes through the store like any API client would (garbage collection
of pods whose workload is gone is the store's). The one node, ``kvpool-local``, is created at
start and reported Ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

from kvpool.operator.cluster import workloads
from kvpool.operator.cluster.store import Obj, Res, Store, StoreError, now_stamp

log = logging.getLogger(__name__)
PODS = Res("", "v1", "pods")
NODES = Res("", "v1", "nodes")
STATEFULSETS = Res("apps", "v1", "statefulsets")
DEPLOYMENTS = Res("apps", "v1", "deployments")
WATCHED = {PODS, STATEFULSETS, DEPLOYMENTS}


def node_object(cpus: int, memory_bytes: int) -> Obj:
    """The one node: this machine, Ready."""
    now = now_stamp()
    capacity = {"cpu": str(cpus), "memory": f"{memory_bytes // 1024}Ki", "pods": "110"}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": workloads.NODE,
            "labels": {
                "kubernetes.io/hostname": workloads.NODE,
                "kubernetes.io/os": "linux",
                "node-role.kubernetes.io/control-plane": "",
            },
        },
        "spec": {},
        "status": {
            "capacity": capacity,
            "allocatable": capacity,
            "addresses": [
                {"type": "InternalIP", "address": "127.0.0.1"},
                {"type": "Hostname", "address": workloads.NODE},
            ],
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "kubelet is posting ready status",
                    "lastHeartbeatTime": now,
                    "lastTransitionTime": now,
                }
            ],
            "nodeInfo": {
                "kubeletVersion": "v1.32.0-kvpool",
                "operatingSystem": "linux",
                "architecture": "amd64",
                "containerRuntimeVersion": "kvpool://process",
            },
        },
    }


@dataclass
class ControllerManager:
    """StatefulSet and Deployment controllers and the scheduler, over one store."""

    store: Store
    dirty: asyncio.Event = field(default_factory=asyncio.Event)

    def start(self, cpus: int, memory_bytes: int) -> None:
        node = self.store.create(NODES, None, node_object(cpus, memory_bytes))
        self.store.replace(
            NODES, node, {**node, "status": node_object(cpus, memory_bytes)["status"]}, status=True
        )
        self.store.listeners.append(self._changed)

    def _changed(self, res: Res, _etype: str, _obj: Obj) -> None:
        if res in WATCHED:
            self.dirty.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Reconcile after every change (and every second) until ``stop``."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.dirty.wait(), 1.0)
            self.dirty.clear()
            try:
                self.sync()
            except Exception:  # a bug must not stop the cluster: log it, try again
                log.exception("controller pass failed")

    def sync(self) -> None:
        """One pass over every workload, then bind unscheduled pods."""
        pods = self.store.list(PODS)
        for res, decide in (
            (STATEFULSETS, workloads.statefulset),
            (DEPLOYMENTS, workloads.deployment),
        ):
            for obj in self.store.list(res):
                if obj["metadata"].get("deletionTimestamp"):
                    continue
                ns = obj["metadata"]["namespace"]
                actions = decide(obj, [p for p in pods if p["metadata"]["namespace"] == ns])
                for name in actions.delete:
                    with contextlib.suppress(StoreError):
                        self.store.delete(PODS, ns, name)
                for pod in actions.create:
                    with contextlib.suppress(StoreError):
                        self.store.create(PODS, ns, pod)
                self._report(res, obj, actions.status)
        for pod in self.store.list(PODS):
            if not (pod.get("spec") or {}).get("nodeName") and not pod["metadata"].get(
                "deletionTimestamp"
            ):
                self._bind(pod)

    def _report(self, res: Res, obj: Obj, status: dict[str, object]) -> None:
        status = workloads.with_times(obj.get("status"), dict(status), now_stamp())
        if workloads.same_status(obj.get("status"), status):
            return
        with contextlib.suppress(StoreError):
            self.store.replace(res, obj, {**obj, "status": status}, status=True)

    def _bind(self, pod: Obj) -> None:
        """The scheduler: every pod goes to the one node."""
        new = {**pod, "spec": {**pod["spec"], "nodeName": workloads.NODE}}
        now = now_stamp()
        new["status"] = {
            **(pod.get("status") or {}),
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "True", "lastTransitionTime": now}],
        }
        with contextlib.suppress(StoreError):
            bound = self.store.replace(PODS, pod, new)
            self.store.replace(PODS, bound, {**bound, "status": new["status"]}, status=True)
