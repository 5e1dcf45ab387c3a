"""Replica slots and Service proxies of ``kvpool-operator cluster``'s kubelet.

Why: one machine is one network namespace, so the pods of a namespace share a map of local
ports (``local.plan.cluster_map``) and two pods binding the same container port cannot run
together. A Deployment of several replicas (the controller's and the gateway's two, by default)
must run them all, as ``kvpool-operator up`` does: each pod takes a replica slot for its
lifetime (the lowest one no live pod of its Deployment holds), binds that slot's own local
ports (``ClusterMap.for_replica``), and frees the slot when its process has stopped. The
addresses of a Service in front of such a Deployment are then listeners here that send each
new connection to a pod that is Ready, not terminating, and whose labels (as they are now: the
controller replica holding the Lease labels its pod ``leader``) match the Service's selector,
which is an EndpointSlice's rule and kube-proxy's job. Which Services and ports is decided by
``local.balance.balanced_services``, the bytes are moved by ``local.services.forward``, both
shared with ``up``; this module only keeps the listeners of a cluster that changes while it
runs. Everything is on the kubelet's asyncio loop, on 127.0.0.1. Where a Service port is
reached by name (the ``*.svc`` HTTP proxy, the API server's services proxy, webhook calls) and
what the state file says of each pod are answered here too, from the kubelet's pods.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvpool.operator.cluster import workloads
from kvpool.operator.cluster.store import Res, Store
from kvpool.operator.local.balance import Balanced
from kvpool.operator.local.plan import LOOPBACK
from kvpool.operator.local.services import forward
from kvpool.operator.local.stack import LocalStack

log = logging.getLogger(__name__)
PODS = Res("", "v1", "pods")
SERVICES = Res("", "v1", "services")
Key = tuple[str, int]  # (namespace, local port a Service's proxy listens on)
#: (namespace, Service, container port) -> the local ports of its eligible pods now
Eligible = Callable[[str, Balanced, int], list[int]]


class Replica(Protocol):
    """What the kubelet knows of a pod it runs (``kubelet.PodRun``)."""

    namespace: str
    name: str
    deployment: str | None  # the Deployment of several replicas whose slot it holds
    slot: int | None
    stopping: bool
    ports: dict[int, int]  # container port -> the local port it binds
    container: workloads.Container


def free_slot(held: Collection[int], slots: int) -> int | None:
    """The lowest of ``slots`` replica slots no live pod holds, None when every one is held
    (the pod waits for a replica that is stopping to let its slot go)."""
    return next((i for i in range(slots) if i not in held), None)


def owner_deployment(pod: Mapping[str, object]) -> str | None:
    """The Deployment that controls a pod (this cluster creates them without ReplicaSets)."""
    meta = pod.get("metadata")
    refs = meta.get("ownerReferences") if isinstance(meta, Mapping) else None
    for ref in refs if isinstance(refs, list) else []:
        if ref.get("controller") and ref.get("kind") == "Deployment":
            return str(ref["name"])
    return None


@dataclass
class ServiceProxies:
    """The listening proxies of every Service in front of several replicas, per namespace."""

    eligible: Eligible
    balanced: dict[Key, Balanced] = field(default_factory=dict)
    servers: dict[Key, asyncio.Server] = field(default_factory=dict)
    _refused: set[Key] = field(default_factory=set)
    _rr: itertools.count[int] = field(default_factory=itertools.count)

    async def sync(self, wanted: Mapping[str, Iterable[Balanced]]) -> None:
        """Listen for every port of ``wanted`` (namespace -> its balanced Services) and stop
        listening elsewhere. A port another process still binds (the one pod of the
        Deployment before it was scaled up) is tried again on the next call."""
        want = {
            (ns, port): b for ns, services in wanted.items() for b in services for port in b.listen
        }
        for key in set(self.servers) - set(want):
            server = self.servers.pop(key)
            server.close()
            log.info(
                "Service %s/%s: proxy on port %d closed", key[0], self.balanced[key].service, key[1]
            )
        self.balanced = want
        for key, service in want.items():
            if key in self.servers:
                continue
            try:
                self.servers[key] = await asyncio.start_server(
                    functools.partial(self._connection, key), LOOPBACK, key[1]
                )
            except OSError as exc:
                if key not in self._refused:
                    log.warning(
                        "Service %s/%s: port %d is held (%s); its proxy starts once it is free",
                        key[0], service.service, key[1], exc.strerror,
                    )  # fmt: skip
                self._refused.add(key)
                continue
            self._refused.discard(key)
            log.info("Service %s/%s: proxy on port %d", key[0], service.service, key[1])

    def current(self, namespace: str) -> list[Balanced]:
        """The balanced Services of ``namespace`` the proxies serve now."""
        out: list[Balanced] = []
        for (ns, _port), service in self.balanced.items():
            if ns == namespace and service not in out:
                out.append(service)
        return out

    def held(self, namespace: str) -> dict[int, str]:
        """The local ports the proxies of ``namespace`` listen on, each with its Service."""
        return {
            port: self.balanced[(ns, port)].service for ns, port in self.servers if ns == namespace
        }

    def front(self, namespace: str, workload: str) -> dict[int, int]:
        """Container port -> the local port of a proxy listening in front of ``workload``."""
        return {
            service.listen[port]: port
            for (ns, port), service in self.balanced.items()
            if ns == namespace and service.workload == workload and (ns, port) in self.servers
        }

    def addresses(self) -> dict[str, dict[str, dict[str, int]]]:
        """Per namespace, per proxied Service: container port -> the local port its proxy
        listens on (the cluster's state file: where a client outside reaches the Service)."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        for (ns, port), service in self.balanced.items():
            if (ns, port) in self.servers:
                ports = out.setdefault(ns, {}).setdefault(service.service, {})
                ports[str(service.listen[port])] = port
        return out

    async def _connection(
        self, key: Key, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        service = self.balanced.get(key)
        targets = self.eligible(key[0], service, service.listen[key[1]]) if service else []
        await forward(reader, writer, targets, next(self._rr))

    async def close(self) -> None:
        for server in self.servers.values():
            server.close()
        for server in self.servers.values():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 2.0)
        self.servers.clear()


def eligible(
    store: Store, runs: Iterable[Replica], ns: str, service: Balanced, port: int
) -> list[int]:
    """The local ``port`` of every pod a Service's proxy may send a connection to now: of its
    Deployment, running, Ready, not terminating, its labels matching the selector."""
    out = []
    for run in sorted(runs, key=lambda r: r.name):
        if (
            run.namespace != ns
            or run.deployment != service.workload
            or run.stopping
            or run.container.pid is None
            or not run.container.ready
            or port not in run.ports
        ):
            continue
        pod = store.find(PODS, ns, run.name)
        if pod is None or pod["metadata"].get("deletionTimestamp"):
            continue
        if service.selector.items() <= (pod["metadata"].get("labels") or {}).items():
            out.append(run.ports[port])
    return out


def backend(
    store: Store, runs: Iterable[Replica], ns: str, service: str, port: str
) -> tuple[str, int] | None:
    """Where the cluster's service proxy (``*.svc`` HTTP names), the API server's services
    proxy and its webhook calls reach a Service port (by name or number; "" = the first): the
    local port of a running pod its selector matches, a Ready one first (a replica of several
    only when Ready, as its Service's proxy)."""
    svc = store.find(SERVICES, ns, service)
    if svc is None:
        return None
    ports = (svc.get("spec") or {}).get("ports") or []
    sp = next((p for p in ports if port in ("", str(p.get("name")), str(p["port"]))), None)
    if sp is None:
        return None
    target = sp.get("targetPort", sp["port"])
    selector = (svc.get("spec") or {}).get("selector") or {}
    candidates = []
    for run in runs:
        pod = store.find(PODS, run.namespace, run.name)
        if run.namespace != ns or pod is None or run.container.pid is None:
            continue
        if run.slot is not None and not run.container.ready:
            continue
        if selector and selector.items() <= (pod["metadata"].get("labels") or {}).items():
            candidates.append((not run.container.ready, run, pod))
    for _not_ready, run, pod in sorted(candidates, key=lambda c: c[0]):
        named = pod["spec"]["containers"][0].get("ports", [])
        number = (
            target
            if isinstance(target, int)
            else next((int(p["containerPort"]) for p in named if p.get("name") == target), None)
        )
        local = run.ports.get(int(number)) if number is not None else None
        if local is not None:
            return LOOPBACK, local
    return None


def describe(
    store: Store,
    runs: Iterable[Replica],
    stacks: Mapping[str, LocalStack],
    proxies: ServiceProxies,
) -> dict[str, Any]:
    """What runs where (the cluster's state file): per namespace, each pod's owner, process id,
    local ports, readiness, replica slot, its ports as its Service's proxy serves them (a
    replica of several) and its log."""
    out: dict[str, Any] = {}
    for run in runs:
        stack = stacks.get(run.namespace)
        proc = stack.running.get(run.name) if stack else None
        pod = store.find(PODS, run.namespace, run.name) or {}
        refs = pod.get("metadata", {}).get("ownerReferences") or []
        owner = next((r["name"] for r in refs if r.get("controller")), run.name)
        front = proxies.front(run.namespace, run.deployment) if run.deployment else {}
        rendered = stack.rendered.get(run.name) if stack else None
        named = rendered.ports if rendered is not None else {}
        out.setdefault(run.namespace, {})[run.name] = {
            "owner": owner,
            "pid": proc.proc.pid if proc else None,
            "ports": dict(proc.workload.ports) if proc else {},
            "ready": run.container.ready,
            "replica": run.slot,
            "service_ports": {n: front[c] for n, c in named.items() if c in front},
            "log": str(proc.log) if proc else None,
        }
    return out
