"""One rendered workload rewritten to run here, and the independent proof of that rewrite.

Why this module exists: :mod:`kvpool.operator.local.plan` reads what a cluster holds (the
workloads and the :class:`ClusterMap` of addresses and ports); this module applies the map to
one workload (:func:`localize`: argv, env, mounted files, downward API, Secrets) and checks,
written apart on purpose (:func:`check_rewrite`), that nothing but a cluster-provided value
changed. ``kvpool-operator up`` and ``kvpool-operator cluster``'s kubelet both run what
:func:`localize` returns; ``up --sim-host`` groups localized workloads (:func:`sim_hosts`,
:func:`host_instances`). Pure: no processes, no sockets.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvpool.operator.derive.names import LABEL_POOL
from kvpool.operator.local.plan import (
    BIND_ANY,
    LOOPBACK,
    ZMQ_WILDCARD,
    ClusterMap,
    StackError,
    Workload,
    split_address,
)


# --------------------------------------------------------------------------- the rewrite
def _address(value: str, cmap: ClusterMap) -> str:
    parts = split_address(value)
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
    a, b = split_address(old), split_address(new)
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
