"""Label and field selectors, as the API server applies them to LIST and WATCH: pure.

Why: ``kubectl get -l``, ``kubectl wait`` (a field selector on ``metadata.name``), kopf's
label-selected lists and the workload controllers' pod selection all filter objects. The
grammar is Kubernetes' own: label selectors with equality (``a=b``, ``a==b``, ``a!=b``) and
set terms (``a in (x,y)``, ``a notin (x)``, ``a``, ``!a``); field selectors with ``=``, ``==``,
``!=`` on the fields the API server indexes (``metadata.name``, ``metadata.namespace`` for every
kind, plus a few per kind, e.g. a pod's ``status.phase``). A selector parsed once answers for
every object of a LIST.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

Obj = Mapping[str, Any]
Matcher = Callable[[Mapping[str, str]], bool]

_SET_TERM = re.compile(r"^\s*(!?)([A-Za-z0-9._/-]+)\s+(in|notin)\s+\((.*)\)\s*$")


class SelectorError(ValueError):
    """A selector the API server would refuse (400 BadRequest), with its reason."""


def _terms(selector: str) -> list[str]:
    """Split on commas outside parentheses."""
    out: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(selector):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            out.append(selector[start:i])
            start = i + 1
    out.append(selector[start:])
    return [t.strip() for t in out if t.strip()]


def _term(term: str) -> Matcher:
    m = _SET_TERM.match(term)
    if m is not None:
        key, op = m.group(2), m.group(3)
        values = {v.strip() for v in m.group(4).split(",") if v.strip()}
        if op == "in":
            return lambda labels: labels.get(key) in values
        return lambda labels: labels.get(key) not in values
    for op in ("!=", "==", "="):
        if op in term:
            key, value = (p.strip() for p in term.split(op, 1))
            if not key:
                raise SelectorError(f"invalid label selector term {term!r}")
            if op == "!=":
                return lambda labels: labels.get(key) != value
            return lambda labels: labels.get(key) == value
    if term.startswith("!"):
        key = term[1:].strip()
        return lambda labels: key not in labels
    if not re.fullmatch(r"[A-Za-z0-9._/-]+", term):
        raise SelectorError(f"invalid label selector term {term!r}")
    return lambda labels: term in labels


def label_matcher(selector: str | None) -> Matcher:
    """The labels a label selector string (``?labelSelector=``) matches."""
    matchers = [_term(t) for t in _terms(selector or "")]
    return lambda labels: all(m(labels) for m in matchers)


def selector_matcher(selector: Mapping[str, Any] | None) -> Matcher:
    """The labels a ``LabelSelector`` object (matchLabels, matchExpressions) matches; an empty
    or absent selector matches everything, as in a Deployment's or a Service's spec."""
    selector = selector or {}
    match = dict(selector.get("matchLabels") or {})
    exprs = list(selector.get("matchExpressions") or [])

    def matches(labels: Mapping[str, str]) -> bool:
        if any(labels.get(k) != v for k, v in match.items()):
            return False
        for e in exprs:
            key, op, values = e["key"], e["operator"], set(e.get("values") or [])
            if op == "In":
                ok = labels.get(key) in values
            elif op == "NotIn":
                ok = labels.get(key) not in values
            elif op == "Exists":
                ok = key in labels
            else:  # DoesNotExist
                ok = key not in labels
            if not ok:
                return False
        return True

    return matches


def selector_string(selector: Mapping[str, Any] | None) -> str:
    """A LabelSelector object as the string form (the Scale subresource's ``status.selector``)."""
    selector = selector or {}
    terms = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for e in selector.get("matchExpressions") or []:
        op, key, values = e["operator"], e["key"], ",".join(sorted(e.get("values") or []))
        terms.append(
            {"In": f"{key} in ({values})", "NotIn": f"{key} notin ({values})"}.get(
                op, key if op == "Exists" else f"!{key}"
            )
        )
    return ",".join(terms)


# -- field selectors ------------------------------------------------------------------------
#: Fields every kind can be selected on, and those a few kinds add (the API server's indexes).
_COMMON = ("metadata.name", "metadata.namespace")
FIELDS: dict[str, tuple[str, ...]] = {
    "Pod": (
        "spec.nodeName",
        "spec.restartPolicy",
        "spec.schedulerName",
        "spec.serviceAccountName",
        "status.phase",
        "status.podIP",
        "status.nominatedNodeName",
    ),
    "Event": (
        "involvedObject.kind",
        "involvedObject.namespace",
        "involvedObject.name",
        "involvedObject.uid",
        "involvedObject.apiVersion",
        "involvedObject.resourceVersion",
        "involvedObject.fieldPath",
        "reason",
        "reportingComponent",
        "source",
        "type",
    ),
    "Secret": ("type",),
    "Namespace": ("status.phase",),
    "Node": ("spec.unschedulable",),
    "ReplicaSet": ("status.replicas",),
    "Job": ("status.successful",),
}


def _field(obj: Obj, path: str) -> str:
    node: Any = obj
    for part in path.split("."):
        node = node.get(part) if isinstance(node, Mapping) else None
    if path == "source" and isinstance(node, Mapping):
        node = node.get("component")
    if node is None:
        return ""
    if isinstance(node, bool):
        return "true" if node else "false"
    return str(node)


def field_matcher(selector: str | None, kind: str) -> Callable[[Obj], bool]:
    """The objects of ``kind`` a field selector string (``?fieldSelector=``) matches; a field
    the API server does not index for this kind is refused as it would be."""
    allowed = set(_COMMON) | set(FIELDS.get(kind, ()))
    checks: list[tuple[str, str, bool]] = []
    for term in _terms(selector or ""):
        for op in ("!=", "==", "="):
            if op in term:
                key, value = (p.strip() for p in term.split(op, 1))
                break
        else:
            raise SelectorError(f"invalid field selector term {term!r}: no operator")
        if key not in allowed:
            raise SelectorError(f'field label not supported: "{key}"')
        checks.append((key, value, op == "!="))
    return lambda obj: all((_field(obj, k) == v) != negate for k, v, negate in checks)
