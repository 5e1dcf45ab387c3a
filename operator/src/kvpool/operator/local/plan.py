"""Plan a locally runnable copy of a rendered cache domain: pure, no processes, no sockets.

Why this module exists: ``kvpool-operator up`` starts processes; what it starts is decided
here. From the operator's rendered objects it extracts each workload (command line, env,
mounted files), maps every cluster-provided address and port to loopback and local ports, and
checks independently that the rewrite changed nothing else. The rewrites are exactly what a
cluster provides and a laptop lacks:

- Service and StatefulSet-pod DNS names, and the address of a service the pool names
  (its Redis), -> ``127.0.0.1``; bind address ``0.0.0.0`` -> ``127.0.0.1``; a ZMQ wildcard
  bind (``tcp://*:PORT``, vLLM's KV-event endpoints) stays a wildcard bind on the local port
  (``*`` means bind to vLLM, any address means connect; the worker binds it on its own
  ``--host``, 127.0.0.1 here);
- container ports -> local ports (one map for the whole domain, so every reference to a port,
  in flags, JSON flags, env and mounted YAML, moves together);
- ConfigMap mounts -> local files, and the env that points at them;
- ``valueFrom: fieldRef status.podIP`` -> ``127.0.0.1`` (and the pod's name and namespace);
- a Deployment of several replicas runs one process per replica, each binding its own local
  ports; a Service in front of them gets local ports of its own, where ``up`` proxies each
  connection to a replica its selector matches (:func:`balanced_services`).

This module reads the rendered objects into :class:`Workload` s and builds the
:class:`ClusterMap`; :mod:`kvpool.operator.local.rewrite` applies the map to one workload
and checks the result.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvpool.operator.api.pool import KVCachePool
from kvpool.operator.derive.names import LABEL_COMPONENT
from kvpool.protocol.domain import CONTROLLER_ROLE_LABEL

LOOPBACK = "127.0.0.1"
BIND_ANY = "0.0.0.0"
ZMQ_WILDCARD = "*"
Obj = dict[str, Any]
_ADDR = re.compile(
    r"^(?P<scheme>[a-z][a-z0-9+.-]*://)?(?P<host>[^/:\s]+)(?::(?P<port>\d+))?(?P<rest>/.*)?$"
)
#: Labels a pod sets on itself at run time (the controller replica holding the Lease labels
#: its pod ``leader``): a Service selecting one still fronts the workload whose template lacks it.
RUNTIME_LABELS = frozenset({CONTROLLER_ROLE_LABEL})


class StackError(RuntimeError):
    """The domain cannot be run locally; the message says why and what to look at."""


Allocate = Callable[[], int]


# --------------------------------------------------------------------------- extract
@dataclass
class Workload:
    """One container of a rendered Deployment or StatefulSet, as the pod would run it."""

    name: str
    component: str
    argv: list[str]
    env: dict[str, str]
    field_env: dict[str, str]  # env name -> fieldRef fieldPath (filled by the kubelet)
    ports: dict[str, int]  # container port name -> number
    files: dict[str, str]  # mounted path -> content (ConfigMap items)
    readiness: tuple[str, int] | None  # HTTP GET path, port
    cpu: str | None = None
    secret_env: dict[str, tuple[str, str]] = field(default_factory=dict)  # -> (secret, key)
    labels: dict[str, str] = field(default_factory=dict)  # the workload's metadata labels
    dirs: dict[str, str] = field(default_factory=dict)  # emptyDir mount path -> volume name
    replicas: int = 1  # a Deployment's pods (one process each under ``up``)
    namespace: str = ""

    @property
    def simulated(self) -> bool:
        """A worker of kvpool's simulated engine (``kvpool-worker serve --engine sim``)."""
        return ("--engine", "sim") in itertools.pairwise(self.argv)


def by_kind(objects: Sequence[Obj], kind: str) -> list[Obj]:
    return [o for o in objects if o.get("kind") == kind]


def workloads(objects: Sequence[Obj]) -> dict[str, Workload]:
    """Every Deployment/StatefulSet (first container) keyed by name."""
    configmaps = {o["metadata"]["name"]: o.get("data", {}) for o in by_kind(objects, "ConfigMap")}
    out: dict[str, Workload] = {}
    for obj in by_kind(objects, "Deployment") + by_kind(objects, "StatefulSet"):
        name = obj["metadata"]["name"]
        labels = dict(obj["metadata"].get("labels", {}))
        w = workload_of(name, labels, obj["spec"]["template"]["spec"], configmaps)
        w.namespace = str(obj["metadata"].get("namespace", ""))
        if obj["kind"] == "Deployment":
            w.replicas = int(obj["spec"].get("replicas", 1))
        out[name] = w
    return out


def replica_name(workload: str, index: int) -> str:
    """The process (and pod) name of one replica of a Deployment of several."""
    return f"{workload}-{index}"


def workload_of(
    name: str, labels: Mapping[str, str], pod: Obj, configmaps: Mapping[str, Mapping[str, str]]
) -> Workload:
    """The first container of a pod spec as the pod would run it (``configmaps``: the data of
    every ConfigMap its volumes may name). Also what ``kvpool-operator cluster``'s kubelet
    runs for each pod."""
    (container,) = pod["containers"]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    env: dict[str, str] = {}
    field_env: dict[str, str] = {}
    secret_env: dict[str, tuple[str, str]] = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = str(item["value"])
        elif "secretKeyRef" in item.get("valueFrom", {}):
            ref = item["valueFrom"]["secretKeyRef"]
            secret_env[item["name"]] = (str(ref["name"]), str(ref.get("key", "")))
        else:
            ref = item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
            if ref is None:
                raise StackError(f"{name}: env {item['name']}: unsupported")
            field_env[item["name"]] = ref
    files: dict[str, str] = {}
    dirs: dict[str, str] = {}
    for mount in container.get("volumeMounts", []):
        volume = volumes.get(mount["name"], {})
        if "emptyDir" in volume:
            dirs[mount["mountPath"].rstrip("/")] = mount["name"]
            continue
        source = volume.get("configMap")
        if source is None:
            continue
        if source["name"] not in configmaps:
            raise StackError(
                f"{name}: ConfigMap {source['name']} (volume {mount['name']}) does not exist"
            )
        data = configmaps[source["name"]]
        items = source.get("items") or [{"key": k, "path": k} for k in sorted(data)]
        for it in items:
            files[f"{mount['mountPath'].rstrip('/')}/{it['path']}"] = data[it["key"]]
    ports = {
        p.get("name", str(p["containerPort"])): int(p["containerPort"])
        for p in container.get("ports", [])
    }
    probe = container.get("readinessProbe", {}).get("httpGet")
    readiness = None
    if probe:
        port = probe["port"]
        readiness = (str(probe.get("path", "/")), int(ports.get(str(port), port)))
    return Workload(
        name=name,
        component=labels.get(LABEL_COMPONENT, "?"),
        argv=[str(a) for a in container["command"] + container.get("args", [])],
        env=env,
        field_env=field_env,
        ports=ports,
        files=files,
        readiness=readiness,
        cpu=container.get("resources", {}).get("requests", {}).get("cpu"),
        secret_env=secret_env,
        labels=dict(labels),
        dirs=dirs,
    )


# --------------------------------------------------------------------------- the cluster map
@dataclass(frozen=True)
class ClusterMap:
    """What the cluster provides: DNS names, Service port → container port, and our ports.

    ``ports`` is where a container port is reached (through its Service, or the pod's DNS
    name); for a Deployment of several replicas that is the Service's proxy, and each replica
    binds its own ports (``replicas``). ``own`` is the map of the replica being localized:
    the ports it binds. ``own_ports`` is what bare port numbers and bind addresses in a pod's
    spec mean: its own ports, over the domain's (a bare number naming another workload's port,
    a PD decoder's in the gateway's config, is still that workload's).
    """

    hosts: frozenset[str]
    service_ports: Mapping[tuple[str, int], int]  # (dns host, service port) -> container port
    ports: Mapping[int, int]  # container port -> local port
    external: Mapping[tuple[str, int], int] = field(default_factory=dict)  # named service -> port
    #: workload -> per replica: container port -> that replica's local port
    replicas: Mapping[str, tuple[Mapping[int, int], ...]] = field(default_factory=dict)
    own: Mapping[int, int] | None = None

    @property
    def own_ports(self) -> Mapping[int, int]:
        return self.ports if self.own is None else {**self.ports, **self.own}

    def for_replica(self, workload: str, index: int) -> ClusterMap:
        """The map replica ``index`` of ``workload`` is localized with."""
        return replace(self, own=self.replicas[workload][index])


@dataclass(frozen=True)
class NamedService:
    """A service the pool names but the operator does not run (e.g. the Redis of a tier)."""

    kind: str  # "redis"
    host: str
    port: int
    named_by: str  # the field that names it

    @property
    def key(self) -> tuple[str, int]:
        return (self.host, self.port)


def named_services(pool: KVCachePool) -> list[NamedService]:
    """Every external service the pool's tiers and controller name, each address once."""
    urls: list[tuple[str, str]] = []
    remote = pool.spec.tiers.remote
    if remote is not None and remote.redis is not None:
        urls.append(("spec.tiers.remote.redis.url", remote.redis.url))
    persistence = pool.spec.controller.persistence
    if persistence.mode == "redis" and persistence.redis_url:
        urls.append(("spec.controller.persistence.redisUrl", persistence.redis_url))
    out: dict[tuple[str, int], NamedService] = {}
    for where, url in urls:
        parts = split_address(url)
        if parts is None or parts[0] not in ("redis://", "valkey://"):
            raise StackError(
                f"{where}: {url!r}: only redis:// and valkey:// URLs can be run locally"
            )
        service = NamedService("redis", parts[1], parts[2] or 6379, where)
        out.setdefault(service.key, service)
    return list(out.values())


def template_ports(obj: Obj) -> dict[str, int]:
    (container, *_) = obj["spec"]["template"]["spec"]["containers"]
    return {
        p.get("name", str(p["containerPort"])): int(p["containerPort"])
        for p in container.get("ports", [])
    }


def cluster_map(
    objects: Sequence[Obj],
    allocate: Allocate,
    services: Sequence[NamedService] = (),
    known: Mapping[int, int] | None = None,
    known_replicas: Mapping[str, Sequence[Mapping[int, int]]] | None = None,
) -> ClusterMap:
    """DNS names of every Service (and StatefulSet pod), a local port per container port, and
    one per named service; ``known``: container ports already mapped (kept as they are: the
    cluster's kubelet maps a namespace's ports once, as its pods come and go);
    ``known_replicas``: the replica port maps of Deployments already handed out (kept, and
    kept fronted by their Service's proxy while they are, even scaled to one replica: the
    cluster's kubelet keeps a pod's ports for its lifetime)."""
    pods = {
        o["metadata"]["name"]: o
        for o in by_kind(objects, "Deployment") + by_kind(objects, "StatefulSet")
    }
    ports_of = {name: template_ports(o) for name, o in pods.items()}
    container_ports: dict[int, str] = {}
    for name, ports in ports_of.items():
        for number in ports.values():
            if number in container_ports:
                raise StackError(
                    f"container port {number} is used by {container_ports[number]} and {name}; "
                    "the local stack needs distinct ports across the domain"
                )
            container_ports[number] = name
    local: dict[int, int] = {p: q for p, q in (known or {}).items() if p in container_ports}
    kept = {n: list(maps) for n, maps in (known_replicas or {}).items() if n in pods}
    taken = set((known or {}).values()) | {
        p for maps in kept.values() for m in maps for p in m.values()
    }

    def fresh() -> int:
        while True:
            port = allocate()
            if port not in taken:
                taken.add(port)
                return port

    for number in sorted(set(container_ports) - set(local)):
        local[number] = fresh()
    external = {service.key: fresh() for service in services}
    replicas: dict[str, tuple[Mapping[int, int], ...]] = {}
    for name, o in pods.items():
        count = int(o["spec"].get("replicas", 1)) if o["kind"] == "Deployment" else 0
        if count > 1 or name in kept:
            numbers = ports_of[name].values()  # a kept map gains a port the template added
            maps = [{n: m.get(n) or fresh() for n in numbers} for m in kept.get(name, [])]
            maps += [
                {number: fresh() for number in ports_of[name].values()}
                for _ in range(count - len(maps))
            ]
            replicas[name] = tuple(maps)
    hosts: set[str] = set()
    service_ports: dict[tuple[str, int], int] = {}
    for svc in by_kind(objects, "Service"):
        meta, spec = svc["metadata"], svc["spec"]
        selector = spec.get("selector", {})
        targets = [ports_of[n] for n, o in pods.items() if selects(selector, o)]
        names = [f"{meta['name']}.{meta['namespace']}.svc"]
        for sts in by_kind(objects, "StatefulSet"):
            if sts["spec"].get("serviceName") == meta["name"]:
                names += [
                    f"{sts['metadata']['name']}-{i}.{meta['name']}.{meta['namespace']}.svc"
                    for i in range(int(sts["spec"].get("replicas", 1)))
                ]
        names += [f"{n}.cluster.local" for n in names]
        hosts.update(names)
        for sp in spec.get("ports", []):
            target = sp.get("targetPort", sp["port"])
            target_port: int | None = target if isinstance(target, int) else None
            if target_port is None and len(targets) == 1:
                target_port = targets[0].get(str(target))
            if target_port is None:
                continue  # a named port over several workloads: not addressed by one number
            for host in names:
                service_ports[(host, int(sp["port"]))] = target_port
    return ClusterMap(frozenset(hosts), service_ports, local, external, replicas)


def selects(selector: Mapping[str, str], workload: Obj) -> bool:
    """Whether a Service's selector matches the workload's pods (labels its pods set on
    themselves at run time left out: the proxy checks those on each connection)."""
    static = {k: v for k, v in selector.items() if k not in RUNTIME_LABELS}
    labels: dict[str, str] = workload["spec"]["template"]["metadata"]["labels"]
    return static.items() <= labels.items()


# --------------------------------------------------------------------------- addresses
def split_address(value: str) -> tuple[str, str, int | None, str] | None:
    """``[scheme://]host[:port][/rest]`` as (scheme, host, port, rest); None if not an address."""
    m = _ADDR.match(value)
    if m is None:
        return None
    port = m.group("port")
    return (
        m.group("scheme") or "",
        m.group("host"),
        int(port) if port else None,
        m.group("rest") or "",
    )
