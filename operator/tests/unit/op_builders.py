"""Builders for the operator's unit tests: small valid resources, tweaked per test."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from kvpool.operator.api import KVCachePool, P2PGroup, PDPair

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = REPO / "examples"

POOL: dict[str, Any] = {
    "apiVersion": "kvpool.io/v1alpha1",
    "kind": "KVCachePool",
    "metadata": {"name": "pool", "namespace": "ns"},
    "spec": {
        "model": {"name": "m", "numLayers": 36, "numKvHeads": 8, "headDim": 128},
        "hashSeed": "123",
        "tiers": {"cpu": {"size": "16Gi"}},
    },
}

P2P: dict[str, Any] = {
    "apiVersion": "kvpool.io/v1alpha1",
    "kind": "P2PGroup",
    "metadata": {"name": "grp", "namespace": "ns"},
    "spec": {
        "poolRef": {"name": "pool"},
        "replicas": 2,
        "tensorParallelSize": 2,
        "engine": {"platform": "ascend"},
        "transfer": {
            "pullMode": True,
            "delayPull": True,
            "useNPU": True,
            "hostStaging": {"enabled": True, "bytes": "8Gi"},
        },
    },
}

PD: dict[str, Any] = {
    "apiVersion": "kvpool.io/v1alpha1",
    "kind": "PDPair",
    "metadata": {"name": "pair", "namespace": "ns"},
    "spec": {
        "poolRef": {"name": "pool"},
        "prefill": {"tensorParallelSize": 2, "engine": {"platform": "ascend"}},
        "decode": {"tensorParallelSize": 2, "engine": {"platform": "ascend"}},
        "transfer": {"mode": "pull-delay"},
        "ports": {"base": 30000},
    },
}


def merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge ``patch`` into a copy of ``base`` (dicts merge, everything else replaces)."""
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def pool(**spec: Any) -> KVCachePool:
    """The base pool with ``spec`` merged in."""
    return KVCachePool.model_validate(merge(POOL, {"spec": spec}))


def p2p(name: str = "grp", **spec: Any) -> P2PGroup:
    """The base P2P group (ascend, TP 2, delay pull + HostStaging) with ``spec`` merged in."""
    return P2PGroup.model_validate(merge(P2P, {"metadata": {"name": name}, "spec": spec}))


def plain_p2p(name: str = "grp", **spec: Any) -> P2PGroup:
    """The base P2P group without its transfer settings (LMCache's defaults), ``spec`` merged."""
    doc = merge(P2P, {"metadata": {"name": name}})
    del doc["spec"]["transfer"]
    return P2PGroup.model_validate(merge(doc, {"spec": spec}))


def pd(name: str = "pair", **spec: Any) -> PDPair:
    """The base PD pair (ascend, TP 2, pull-delay) with ``spec`` merged in."""
    return PDPair.model_validate(merge(PD, {"metadata": {"name": name}, "spec": spec}))


def demo_docs(namespace: str = "default") -> list[dict[str, Any]]:
    """examples/cpu-demo.yaml as the API server returns it (uid, generation stamped)."""
    text = (EXAMPLES / "cpu-demo.yaml").read_text()
    docs = [d for d in yaml.safe_load_all(text) if d]
    for i, d in enumerate(docs):
        d["metadata"].update(namespace=namespace, uid=f"uid-{i}", generation=1)
    return docs


class DocsSource:
    """A reconcile's view of the CRs (``reconcile.DomainSource``) over a list of bodies: the
    first pool, and every other body as its member."""

    def __init__(self, docs: list[dict[str, Any]]) -> None:
        self.docs = docs

    def pool(self, namespace: str, name: str) -> dict[str, Any] | None:
        return next((d for d in self.docs if d["kind"] == "KVCachePool"), None)

    def members(self, namespace: str, pool: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] != "KVCachePool"]
