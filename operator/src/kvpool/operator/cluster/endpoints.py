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
runs. Everything is on the kubelet's asyncio loop, on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field

from kvpool.operator.local.balance import Balanced
from kvpool.operator.local.plan import LOOPBACK
from kvpool.operator.local.services import forward

log = logging.getLogger(__name__)
Key = tuple[str, int]  # (namespace, local port a Service's proxy listens on)
#: (namespace, Service, container port) -> the local ports of its eligible pods now
Eligible = Callable[[str, Balanced, int], list[int]]


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
