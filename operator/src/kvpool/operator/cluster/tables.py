"""Server-side Table output (``meta.k8s.io/v1`` Table) for ``kubectl get``: pure.

Why: ``kubectl get`` asks the API server for a Table and prints its columns; a server that
answers with plain objects gets only NAME and AGE. A custom resource's columns are its CRD's
``additionalPrinterColumns`` (JSONPath into the object, ``date`` columns shown as an age,
``priority > 0`` only with ``-o wide``); the built-in kinds the chart and the operator create
get the columns the real API server prints for them (pods: READY, STATUS, RESTARTS; ...).
Grown from the test suite's imitation of kubectl (the jsonpath subset and kubectl's duration
format), which it replaces.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Obj = Mapping[str, Any]
_FILTER = re.compile(r"^\[\?\(@\.([\w.]+)\s*==\s*[\"']([^\"']*)[\"']\)\]$")
_NAME_DOC = "Name must be unique within a namespace."


@dataclass(frozen=True)
class Column:
    """One column: header, type (string, integer, number, boolean, date), priority, and how a
    cell is read from an object (``now`` for ages)."""

    name: str
    type: str
    cell: Callable[[Obj, datetime.datetime], Any]
    priority: int = 0
    format: str = ""
    description: str = ""

    def definition(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "type": self.type,
            "format": self.format,
            "description": self.description,
            "priority": self.priority,
        }


# -- JSONPath (the subset printer columns use) ---------------------------------------------------
def jsonpath(obj: Any, path: str) -> Any:
    """``.a.b``, ``[N]``, ``[*]`` (first element) and ``[?(@.k=="v")]`` (first match), in an
    optional ``{...}`` wrapper; None when a step finds nothing."""
    path = path.strip()
    if path.startswith("{") and path.endswith("}"):
        path = path[1:-1]
    for part in re.findall(r"\.[A-Za-z0-9_-]+|\[[^\]]*\]", path):
        if obj is None:
            return None
        if part.startswith("."):
            obj = obj.get(part[1:]) if isinstance(obj, dict) else None
            continue
        if not isinstance(obj, list):
            return None
        inner = part[1:-1]
        if inner == "*":
            obj = obj[0] if obj else None
        elif inner.lstrip("-").isdigit():
            i = int(inner)
            obj = obj[i] if -len(obj) <= i < len(obj) else None
        else:
            match = _FILTER.match(part)
            if match is None:
                return None
            key, value = match.groups()
            found = [o for o in obj if isinstance(o, dict) and str(jsonpath(o, "." + key)) == value]
            obj = found[0] if found else None
    return obj


def parse_time(stamp: str) -> datetime.datetime:
    return datetime.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)


def human_duration(seconds_f: float) -> str:
    """Kubernetes' ``duration.HumanDuration`` (what AGE shows)."""
    seconds = int(seconds_f)
    if seconds < -1:
        return "<invalid>"
    if seconds < 0:
        return "0s"
    if seconds < 120:
        return f"{seconds}s"
    minutes = seconds // 60
    if minutes < 10:
        return f"{minutes}m{seconds % 60}s" if seconds % 60 else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    hours = minutes // 60
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        return f"{hours // 24}d{hours % 24}h" if hours % 24 else f"{hours // 24}d"
    if hours < 24 * 365 * 2:
        return f"{hours // 24}d"
    return f"{hours // 24 // 365}y"


def age(stamp: Any, now: datetime.datetime) -> str | None:
    if not isinstance(stamp, str) or not stamp:
        return None
    try:
        return human_duration((now - parse_time(stamp)).total_seconds())
    except ValueError:
        return None


def _name_column() -> Column:
    return Column("Name", "string", lambda o, _n: o["metadata"]["name"], 0, "name", _NAME_DOC)


def _age_column() -> Column:
    return Column("Age", "date", lambda o, n: age(o["metadata"].get("creationTimestamp"), n))


# -- custom resources ------------------------------------------------------------------------
def crd_columns(version: Mapping[str, Any]) -> list[Column]:
    """Name, then the CRD version's additionalPrinterColumns (or Age when it has none)."""
    printer = version.get("additionalPrinterColumns")
    if not printer:
        return [_name_column(), _age_column()]
    out = [_name_column()]
    for col in printer:
        path, kind = col["jsonPath"], col.get("type", "string")

        def cell(obj: Obj, now: datetime.datetime, path: str = path, kind: str = kind) -> Any:
            value = jsonpath(obj, path)
            if kind == "date":
                return age(value, now)
            if isinstance(value, dict | list):
                return str(value)
            return value

        out.append(
            Column(
                col["name"],
                kind,
                cell,
                int(col.get("priority", 0)),
                str(col.get("format", "")),
                str(col.get("description", "")),
            )
        )
    return out


# -- built-in kinds ------------------------------------------------------------------------------
def _pod_ready(pod: Obj, _now: datetime.datetime) -> str:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    total = len((pod.get("spec") or {}).get("containers") or [])
    return f"{sum(1 for s in statuses if s.get('ready'))}/{total}"


def pod_phase_text(pod: Obj) -> str:
    """What kubectl's STATUS column shows: a terminating pod, a waiting container's reason,
    else the phase."""
    if pod["metadata"].get("deletionTimestamp"):
        return "Terminating"
    status = pod.get("status") or {}
    for cs in status.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting")
        if waiting and waiting.get("reason"):
            return str(waiting["reason"])
    return str(status.get("reason") or status.get("phase") or "Pending")


def _restarts(pod: Obj, _now: datetime.datetime) -> int:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return sum(int(s.get("restartCount", 0)) for s in statuses)


def _ports(svc: Obj, _now: datetime.datetime) -> str:
    ports = (svc.get("spec") or {}).get("ports") or []
    return ",".join(f"{p['port']}/{p.get('protocol', 'TCP')}" for p in ports) or "<none>"


def _get(path: str) -> Callable[[Obj, datetime.datetime], Any]:
    return lambda obj, _now: jsonpath(obj, path)


def _ready_of(desired: str, ready: str) -> Callable[[Obj, datetime.datetime], str]:
    return lambda o, _n: f"{jsonpath(o, ready) or 0}/{jsonpath(o, desired) or 0}"


def _count(path: str) -> Callable[[Obj, datetime.datetime], int]:
    return lambda o, _n: len(jsonpath(o, path) or {})


def _images(obj: Obj, _now: datetime.datetime) -> str:
    containers = jsonpath(obj, ".spec.template.spec.containers") or []
    return ",".join(str(c.get("image", "")) for c in containers)


BUILTIN: dict[str, list[Column]] = {
    "Pod": [
        Column("Ready", "string", _pod_ready),
        Column("Status", "string", lambda o, _n: pod_phase_text(o)),
        Column("Restarts", "integer", _restarts),
        _age_column(),
        Column("IP", "string", _get(".status.podIP"), 1),
        Column("Node", "string", _get(".spec.nodeName"), 1),
    ],
    "Deployment": [
        Column("Ready", "string", _ready_of(".spec.replicas", ".status.readyReplicas")),
        Column("Up-to-date", "integer", lambda o, _n: jsonpath(o, ".status.updatedReplicas") or 0),
        Column("Available", "integer", lambda o, _n: jsonpath(o, ".status.availableReplicas") or 0),
        _age_column(),
        Column("Images", "string", _images, 1),
    ],
    "StatefulSet": [
        Column("Ready", "string", _ready_of(".spec.replicas", ".status.readyReplicas")),
        _age_column(),
        Column("Images", "string", _images, 1),
    ],
    "Service": [
        Column("Type", "string", lambda o, _n: jsonpath(o, ".spec.type") or "ClusterIP"),
        Column("Cluster-IP", "string", lambda o, _n: jsonpath(o, ".spec.clusterIP") or "<none>"),
        Column("External-IP", "string", lambda o, _n: "<none>"),
        Column("Port(s)", "string", _ports),
        _age_column(),
    ],
    "ConfigMap": [Column("Data", "integer", _count(".data")), _age_column()],
    "Secret": [
        Column("Type", "string", _get(".type")),
        Column("Data", "integer", _count(".data")),
        _age_column(),
    ],
    "Namespace": [Column("Status", "string", _get(".status.phase")), _age_column()],
    "PodDisruptionBudget": [
        Column("Min Available", "string", lambda o, _n: jsonpath(o, ".spec.minAvailable") or "N/A"),
        Column(
            "Max Unavailable", "string", lambda o, _n: jsonpath(o, ".spec.maxUnavailable") or "N/A"
        ),
        Column(
            "Allowed Disruptions",
            "integer",
            lambda o, _n: jsonpath(o, ".status.disruptionsAllowed") or 0,
        ),
        _age_column(),
    ],
    "Node": [
        Column(
            "Status",
            "string",
            lambda o, _n: "Ready"
            if any(
                c.get("type") == "Ready" and c.get("status") == "True"
                for c in jsonpath(o, ".status.conditions") or []
            )
            else "NotReady",
        ),
        Column(
            "Roles",
            "string",
            lambda o, _n: ",".join(
                k.split("/", 1)[1]
                for k in (o["metadata"].get("labels") or {})
                if k.startswith("node-role.kubernetes.io/")
            )
            or "<none>",
        ),
        _age_column(),
        Column("Version", "string", _get(".status.nodeInfo.kubeletVersion")),
    ],
    "CustomResourceDefinition": [
        Column("Created At", "date", lambda o, _n: o["metadata"].get("creationTimestamp")),
    ],
    "Event": [
        Column("Type", "string", _get(".type")),
        Column("Reason", "string", _get(".reason")),
        Column(
            "Object",
            "string",
            lambda o, _n: f"{str(jsonpath(o, '.involvedObject.kind')).lower()}/"
            f"{jsonpath(o, '.involvedObject.name')}",
        ),
        Column("Message", "string", _get(".message")),
    ],
}


def builtin_columns(kind: str) -> list[Column]:
    """The columns of a built-in kind (Name and Age for kinds without their own)."""
    if kind == "Event":
        seen = Column(
            "Last Seen",
            "string",
            lambda o, n: age(o.get("lastTimestamp") or o["metadata"].get("creationTimestamp"), n),
        )
        return [seen, *BUILTIN[kind]]
    if kind in BUILTIN:
        return [_name_column(), *BUILTIN[kind]]
    return [_name_column(), _age_column()]


# -- the Table ---------------------------------------------------------------------------------
def partial_metadata(obj: Obj) -> dict[str, Any]:
    return {
        "kind": "PartialObjectMetadata",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": dict(obj.get("metadata") or {}),
    }


def table(
    columns: Sequence[Column],
    objects: Sequence[Obj],
    now: datetime.datetime,
    include_object: str = "Metadata",
    resource_version: str = "",
) -> dict[str, Any]:
    """The ``meta.k8s.io/v1`` Table of ``objects``; ``include_object``: the request's
    ``includeObject`` (Object, Metadata or None)."""
    rows = []
    for obj in objects:
        row: dict[str, Any] = {"cells": [c.cell(obj, now) for c in columns]}
        if include_object == "Object":
            row["object"] = dict(obj)
        elif include_object != "None":
            row["object"] = partial_metadata(obj)
        rows.append(row)
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": resource_version},
        "columnDefinitions": [c.definition() for c in columns],
        "rows": rows,
    }


def wants_table(accept: str) -> bool:
    """Whether an Accept header asks for a Table (kubectl get's ``as=Table;g=meta.k8s.io``)."""
    return any("as=Table" in part for part in accept.split(","))
