"""Small builders for Kubernetes object dicts (Deployment, Service, ConfigMap, PDB, env).

Why: every component's objects share the same shapes; building them in one place keeps the
rendered YAML uniform (labels, ports, probes) and the renderer modules short.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import yaml

from kvpool.operator.api.common import Placement, Resources
from kvpool.operator.api.pool import KVCachePool
from kvpool.operator.derive import names
from kvpool.operator.render.fingerprint import pool_fingerprint, resolve_hash_seed
from kvpool.protocol.domain import FINGERPRINT_ENV

Obj = dict[str, Any]

#: libyaml's emitter when PyYAML has it: about 4x faster than the pure-Python one (the
#: operator renders every domain on each reconcile) and the same text for these configs.
_CONFIG_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


#: Recent config texts by the JSON of their config: PyYAML's representer is Python even with
#: libyaml, and a reconcile renders the same configs again on every pass over a domain.
_CONFIG_TEXTS: dict[str, str] = {}
_CONFIG_TEXTS_MAX = 2048


def config_text(config: dict[str, Any]) -> str:
    """The YAML of a config file mounted into pods (keys sorted, stable for its hash)."""
    try:
        key = json.dumps(config, sort_keys=True, separators=(",", ":"))
    except TypeError:  # keys JSON cannot sort (never in the rendered configs): no caching
        return yaml.dump(config, Dumper=_CONFIG_DUMPER, sort_keys=True)
    text = _CONFIG_TEXTS.get(key)
    if text is None:
        text = yaml.dump(config, Dumper=_CONFIG_DUMPER, sort_keys=True)
        if len(_CONFIG_TEXTS) >= _CONFIG_TEXTS_MAX:
            del _CONFIG_TEXTS[next(iter(_CONFIG_TEXTS))]  # the oldest entry
        _CONFIG_TEXTS[key] = text
    return text


def meta(name: str, namespace: str, labels: dict[str, str], **annotations: str) -> Obj:
    """ObjectMeta with sorted labels (and annotations when given)."""
    out: Obj = {"name": name, "namespace": namespace, "labels": dict(sorted(labels.items()))}
    if annotations:
        out["annotations"] = dict(sorted(annotations.items()))
    return out


def env(name: str, value: str) -> Obj:
    """A literal env var."""
    return {"name": name, "value": value}


def field_env(name: str, path: str) -> Obj:
    """An env var from the downward API (e.g. status.podIP)."""
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def domain_env(pool: KVCachePool) -> list[Obj]:
    """Env every process of the domain gets: one PYTHONHASHSEED (rule 1) and the fingerprint."""
    return [
        env("PYTHONHASHSEED", resolve_hash_seed(pool)),
        env(FINGERPRINT_ENV, pool_fingerprint(pool)),
    ]


def rollout_hash(pool: KVCachePool) -> str:
    """Changes whenever a domain-wide setting changes, so every pod of the domain restarts.

    Covers the fingerprint (seed, chunk size, hash algorithm, model, dtype, block size) and the
    other settings every process must agree on: controller ports and the cache tiers.
    """
    spec = pool.spec
    payload = {
        "fingerprint": pool_fingerprint(pool),
        "controller_ports": spec.controller.ports.model_dump(),
        "tiers": spec.tiers.model_dump(mode="json"),
    }
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def pod_annotations(pool: KVCachePool, mounted_config: str | None = None) -> dict[str, str]:
    """Annotations on every pod template of the domain. ``mounted_config`` is the text of the
    config file the pod reads once at start (its LMCache YAML; of the gateway's settings, the
    part it cannot apply live): its hash on the template makes a change to it restart the pod."""
    out = {
        names.ANNOTATION_ROLLOUT: rollout_hash(pool),
        names.ANNOTATION_FINGERPRINT: pool_fingerprint(pool),
    }
    if mounted_config is not None:
        out[names.ANNOTATION_CONFIG] = hashlib.sha256(mounted_config.encode()).hexdigest()[:16]
    return out


def resources(spec: Resources, extra_limits: dict[str, str] | None = None) -> Obj:
    """core/v1 ResourceRequirements from the API model plus extra limits (accelerators)."""
    limits = dict(spec.limits)
    requests = dict(spec.requests)
    for key, value in (extra_limits or {}).items():
        limits[key] = value
        requests[key] = value
    out: Obj = {}
    if limits:
        out["limits"] = dict(sorted(limits.items()))
    if requests:
        out["requests"] = dict(sorted(requests.items()))
    return out


def placement(spec: Placement) -> Obj:
    """nodeSelector and tolerations for a pod spec (only the keys that are set)."""
    out: Obj = {}
    if spec.node_selector:
        out["nodeSelector"] = dict(sorted(spec.node_selector.items()))
    if spec.tolerations:
        out["tolerations"] = [
            t.model_dump(by_alias=True, exclude_none=True) for t in spec.tolerations
        ]
    return out


def http_probe(port: int, path: str) -> Obj:
    """A readiness probe on an HTTP path."""
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": 5, "failureThreshold": 3}


def deployment(
    name: str,
    namespace: str,
    labels: dict[str, str],
    replicas: int,
    pod_spec: Obj,
    annotations: dict[str, str],
) -> Obj:
    """apps/v1 Deployment whose selector is ``labels``."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta(name, namespace, labels),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": dict(sorted(labels.items()))},
            "template": {
                "metadata": {
                    "labels": dict(sorted(labels.items())),
                    "annotations": dict(sorted(annotations.items())),
                },
                "spec": pod_spec,
            },
        },
    }


def service(
    name: str,
    namespace: str,
    labels: dict[str, str],
    ports: dict[str, int],
    *,
    headless: bool = False,
    selector: dict[str, str] | None = None,
) -> Obj:
    """core/v1 Service selecting ``labels`` (or ``selector``), one named TCP port per entry."""
    spec: Obj = {
        "selector": dict(sorted((labels if selector is None else selector).items())),
        "ports": [
            {"name": pname, "port": port, "targetPort": port, "protocol": "TCP"}
            for pname, port in ports.items()
        ],
    }
    if headless:
        spec["clusterIP"] = "None"
        spec["publishNotReadyAddresses"] = True
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(name, namespace, labels),
        "spec": spec,
    }


def configmap(name: str, namespace: str, labels: dict[str, str], data: dict[str, str]) -> Obj:
    """core/v1 ConfigMap with sorted keys."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta(name, namespace, labels),
        "data": dict(sorted(data.items())),
    }


def pdb(name: str, namespace: str, labels: dict[str, str], max_unavailable: int) -> Obj:
    """policy/v1 PodDisruptionBudget over ``labels``."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": meta(name, namespace, labels),
        "spec": {
            "maxUnavailable": max_unavailable,
            "selector": {"matchLabels": dict(sorted(labels.items()))},
        },
    }


def container(
    name: str,
    image: str,
    command: list[str],
    env_vars: list[Obj],
    ports: dict[str, int],
    res: Obj,
    probe: Obj | None,
) -> Obj:
    """A container with named TCP ports (names at most 15 characters)."""
    out: Obj = {
        "name": name,
        "image": image,
        "command": command,
        "env": env_vars,
        "ports": [
            {"name": pname, "containerPort": port, "protocol": "TCP"}
            for pname, port in ports.items()
        ],
    }
    if res:
        out["resources"] = res
    if probe is not None:
        out["readinessProbe"] = probe
    return out
