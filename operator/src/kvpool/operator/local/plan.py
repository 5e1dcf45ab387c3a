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
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from kvpool.operator.api.pool import KVCachePool
from kvpool.operator.derive.names import LABEL_COMPONENT, LABEL_POOL
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
        parts = _split(url)
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


# --------------------------------------------------------------------------- the rewrite
def _split(value: str) -> tuple[str, str, int | None, str] | None:
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


def _address(value: str, cmap: ClusterMap) -> str:
    parts = _split(value)
    if parts is None:
        return value
    scheme, host, port, rest = parts
    if host == ZMQ_WILDCARD:
        if port is None:
            return value
        return f"{scheme}{ZMQ_WILDCARD}:{cmap.own_ports.get(port, port)}{rest}"
    if port is not None and (host, port) in cmap.external:
        new_port: int | None = cmap.external[(host, port)]
    elif host == BIND_ANY:
        new_port = cmap.own_ports.get(port, port) if port is not None else None
    elif host in cmap.hosts:
        target = cmap.service_ports.get((host, port)) if port is not None else None
        new_port = cmap.ports.get(target) if target is not None else None
        if port is not None and new_port is None:
            raise StackError(f"{value!r}: port {port} is not a port of any Service of the domain")
    else:
        return value
    port_part = f":{new_port}" if port is not None else ""
    return f"{scheme}{LOOPBACK}{port_part}{rest}"


def _port(value: Any, cmap: ClusterMap) -> Any:
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return cmap.own_ports.get(value, value)
    if isinstance(value, str) and value.isdigit():
        return str(cmap.own_ports.get(int(value), int(value)))
    if isinstance(value, list):
        return [_port(v, cmap) for v in value]
    if isinstance(value, str) and value.startswith("{"):
        with contextlib.suppress(json.JSONDecodeError):
            return json.dumps({k: _port(v, cmap) for k, v in json.loads(value).items()})
    return value


def _by_key(key: str, value: Any, cmap: ClusterMap) -> Any:
    low = key.lower()
    if isinstance(value, dict):
        return {k: _by_key(k, v, cmap) for k, v in value.items()}
    if isinstance(value, list) and any(isinstance(v, dict | list) for v in value):
        return [_by_key(key, v, cmap) for v in value]
    if "port" in low:
        return _port(value, cmap)
    if isinstance(value, str) and value.startswith("{"):  # a JSON flag: by its own keys
        with contextlib.suppress(json.JSONDecodeError):
            data = json.loads(value)
            if isinstance(data, dict):
                new = _by_key(key, data, cmap)
                return value if new == data else json.dumps(new, separators=(",", ":"))
    if isinstance(value, str):  # only a cluster host (or 0.0.0.0) is ever rewritten
        return _address(value, cmap)
    return value


@dataclass
class LocalWorkload:
    """A workload as it runs here: argv, complete env, files to write."""

    name: str
    component: str
    argv: list[str]
    env: dict[str, str]
    files: dict[str, str]  # local path -> content
    file_map: dict[str, str]  # mounted path -> local path
    ports: dict[str, int]  # container port name -> local port
    readiness: tuple[str, int] | None  # path, local port
    dir_map: dict[str, str] = field(default_factory=dict)  # emptyDir mount path -> local dir


def _mount(value: str, file_map: Mapping[str, str], dir_map: Mapping[str, str]) -> str | None:
    """Where a mounted path (a ConfigMap file, or a path under an emptyDir) is here."""
    if value in file_map:
        return file_map[value]
    for mount, local in dir_map.items():
        if value == mount or value.startswith(mount + "/"):
            return local + value[len(mount) :]
    return None


#: What the pod's downward API gives a process here (``kvpool-operator up``: the pod IP, and
#: the pod's name and namespace from :func:`pod_fields`; ``kvpool-operator cluster``'s kubelet
#: adds the node...).
LOCAL_FIELDS = {"status.podIP": LOOPBACK}


def pod_fields(pod: str, namespace: str) -> dict[str, str]:
    """The downward API of one pod run here: its IP (loopback), name and namespace."""
    return {**LOCAL_FIELDS, "metadata.name": pod, "metadata.namespace": namespace}


def localize(
    w: Workload,
    cmap: ClusterMap,
    root: Path,
    secrets: Mapping[tuple[str, str], str] | None = None,
    fields: Mapping[str, str] = LOCAL_FIELDS,
) -> LocalWorkload:
    """Apply exactly the cluster-provided rewrites to one workload (``root``: where its files
    go; ``secrets``: the value of each (Secret, key) the pod reads, which a cluster holds;
    ``fields``: the value of each downward-API ``fieldRef``)."""
    file_map = {path: str(root / Path(path).name) for path in sorted(w.files)}
    dir_map = {path: str(root / "volumes" / volume) for path, volume in sorted(w.dirs.items())}

    def value_of(key: str, value: str) -> str:
        mounted = _mount(value, file_map, dir_map)
        return mounted if mounted is not None else str(_by_key(key, value, cmap))

    argv = list(w.argv)
    for i, arg in enumerate(argv):
        flag = argv[i - 1] if i else ""
        if _mount(arg, file_map, dir_map) is not None:
            argv[i] = str(_mount(arg, file_map, dir_map))  # a mounted path on the command line
        elif arg.startswith("-") and "=" in arg:  # --flag=value (gflags style)
            name, _, value = arg.partition("=")
            argv[i] = f"{name}={value_of(name, value)}"
        elif i and flag.startswith("--") and "=" not in flag and not arg.startswith("--"):
            argv[i] = _by_key(flag, arg, cmap)
    env = {k: value_of(k, v) for k, v in w.env.items()}
    for key, ref in w.field_env.items():
        if ref not in fields:
            raise StackError(f"{w.name}: env {key} comes from {ref}, which has no local value")
        env[key] = fields[ref]
    pod = {k: env[k] for k in w.field_env}
    env = {k: expand_env(v, pod) for k, v in env.items()}  # the kubelet's $(VAR)
    for key, secret in w.secret_env.items():
        if secrets is None or secret not in secrets:
            raise StackError(f"{w.name}: env {key} reads Secret {secret[0]}/{secret[1]}: no value")
        env[key] = secrets[secret]
    files: dict[str, str] = {}
    for path, text in w.files.items():
        data = yaml.safe_load(text)
        if not isinstance(data, dict):
            raise StackError(f"{w.name}: mounted {path} is not a YAML mapping")
        files[file_map[path]] = yaml.safe_dump(_by_key("", data, cmap), sort_keys=True)
    ready = (w.readiness[0], cmap.own_ports[w.readiness[1]]) if w.readiness else None
    ports = {n: cmap.own_ports[p] for n, p in w.ports.items()}
    return LocalWorkload(w.name, w.component, argv, env, files, file_map, ports, ready, dir_map)


_CLUSTER_NAME = re.compile(r"\b[a-z0-9][-a-z0-9.]*\.svc(?:\.cluster\.local)?\b")


def unresolved(lw: LocalWorkload) -> list[str]:
    """Cluster DNS names left in a localized workload (argv, env, mounted files): names no
    Service known to the map answered for. ``kvpool-operator cluster``'s kubelet waits for
    their Services rather than start a process that could never reach them."""
    text = "\n".join([*lw.argv, *lw.env.values(), *lw.files.values()])
    return sorted(set(_CLUSTER_NAME.findall(text)))


_ENV_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand_env(value: str, env: Mapping[str, str]) -> str:
    """``$(NAME)`` references to ``env`` replaced, the others left, as the kubelet does."""
    return _ENV_REF.sub(lambda m: env.get(m.group(1), m.group(0)), value)


def _changes(old: Any, new: Any, path: str) -> Iterator[tuple[str, Any, Any]]:
    if isinstance(old, dict) and isinstance(new, dict):
        if old.keys() != new.keys():
            yield path, sorted(old), sorted(new)
            return
        for k in old:
            yield from _changes(old[k], new[k], f"{path}.{k}")
    elif isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        for i, (a, b) in enumerate(zip(old, new, strict=True)):
            yield from _changes(a, b, f"{path}[{i}]")
    elif isinstance(old, str) and isinstance(new, str) and old.startswith("{") and old != new:
        try:
            yield from _changes(json.loads(old), json.loads(new), f"{path}<json>")
        except json.JSONDecodeError:
            yield path, old, new
    elif old != new:
        yield path, old, new


def _allowed(
    old: Any,
    new: Any,
    cmap: ClusterMap,
    files: Mapping[str, str],
    dirs: Mapping[str, str] | None = None,
) -> bool:
    if isinstance(old, int | str) and str(old).isdigit():
        return bool(str(new).isdigit() and int(new) == cmap.own_ports.get(int(old), -1))
    if isinstance(old, str) and _mount(old, files, dirs or {}) is not None:
        return bool(new == _mount(old, files, dirs or {}))
    if not isinstance(old, str) or not isinstance(new, str):
        return False
    if old.startswith("-") and "=" in old:
        name, _, value = old.partition("=")
        new_name, _, new_value = new.partition("=")
        return name == new_name and _allowed(value, new_value, cmap, files, dirs)
    a, b = _split(old), _split(new)
    if a is None or b is None or (a[0], a[3]) != (b[0], b[3]):
        return False
    if a[1] == ZMQ_WILDCARD:  # stays a wildcard bind, on the local port
        own = cmap.own_ports
        return b[1] == ZMQ_WILDCARD and a[2] is not None and b[2] == own.get(a[2], a[2])
    if b[1] != LOOPBACK:
        return False
    if a[2] is not None and (a[1], a[2]) in cmap.external:
        return b[2] == cmap.external[(a[1], a[2])]
    if a[1] not in cmap.hosts | {BIND_ANY}:
        return False
    if a[2] is None:
        return b[2] is None
    if a[1] == BIND_ANY:
        return b[2] == cmap.own_ports.get(a[2], a[2])
    target = cmap.service_ports.get((a[1], a[2]))
    return target is not None and b[2] == cmap.ports.get(target)


def check_rewrite(w: Workload, lw: LocalWorkload, cmap: ClusterMap) -> list[str]:
    """Every difference between rendered and local form, each proven to be a cluster rewrite.

    Written apart from ``localize`` on purpose: it diffs the two forms generically and raises
    on any change that is not a DNS name or bind address → 127.0.0.1, a container port → its
    local port, or a mounted path → its local file. Returns the changes, one line each.
    """
    old_files = {p: yaml.safe_load(t) for p, t in w.files.items()}
    new_files = {p: yaml.safe_load(lw.files[lw.file_map[p]]) for p in w.files}
    env_old = {k: expand_env(v, {f: lw.env[f] for f in w.field_env}) for k, v in w.env.items()}
    env_new = {k: v for k, v in lw.env.items() if k not in w.field_env and k not in w.secret_env}
    seen: list[str] = []
    pairs = [(w.argv, lw.argv, "argv"), (env_old, env_new, "env"), (old_files, new_files, "files")]
    for old, new, where in pairs:
        for path, a, b in _changes(old, new, where):
            if not _allowed(a, b, cmap, lw.file_map, lw.dir_map):
                raise StackError(f"{w.name}: {path}: {a!r} -> {b!r} is not a cluster rewrite")
            seen.append(f"{path}: {a!r} -> {b!r}")
    for key in w.field_env:
        seen.append(f"env.{key}: fieldRef {w.field_env[key]} -> {lw.env[key]!r}")
    for key, (secret, item) in w.secret_env.items():
        seen.append(f"env.{key}: secretKeyRef {secret}/{item} -> (local secret)")
    return seen


# --------------------------------------------------------------------------- sim hosts
def sim_hosts(rendered: Mapping[str, Workload], names: Sequence[str]) -> dict[str, list[str]]:
    """``up --sim-host``: one ``kvpool-worker host`` process per domain for its simulated
    workers among ``names`` (in that order), keyed by the process name ``<pool>-sim-host``."""
    out: dict[str, list[str]] = {}
    for name in names:
        w = rendered[name]
        if w.component == "worker" and w.simulated:
            pool = w.labels.get(LABEL_POOL, "domain")
            out.setdefault(f"{pool}-sim-host", []).append(name)
    return out


def host_instances(instances: Sequence[LocalWorkload]) -> str:
    """The ``kvpool-worker host --instances`` file: each instance's local argv and env exactly
    as the process would run alone (only the pod's env: nothing of this shell's)."""
    return json.dumps(
        [{"argv": lw.argv, "env": lw.env} for lw in instances], indent=1, sort_keys=True
    )
