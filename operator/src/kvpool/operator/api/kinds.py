"""The three kinds as the API server names them, and readers of their bodies as raw dicts.

Why: the generator (CRD names), the runtime (kopf's watches, indexes and webhooks, the REST
client's paths, RBAC) and the local control plane all name the kinds by their plural, and the
runtime reads kopf's bodies, which are plain dicts, not the models. One table spells each
kind's plural and short names, and a few accessors read the fields the runtime needs before a
body is parsed (the pool a member names, the seed a pool's status keeps), so a spelling or a
default (a member without ``poolRef``) is decided once. Pure data, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

Obj = dict[str, Any]


@dataclass(frozen=True)
class CustomKind:
    """One of kvpool's custom resources, as the API server names it."""

    kind: str
    plural: str
    short_names: tuple[str, ...]

    @property
    def singular(self) -> str:
        return self.kind.lower()


POOL = CustomKind("KVCachePool", "kvcachepools", ("kvp",))
P2P_GROUP = CustomKind("P2PGroup", "p2pgroups", ("p2pg",))
PD_PAIR = CustomKind("PDPair", "pdpairs", ("pdp",))
#: Members point at a pool (``spec.poolRef.name``) in their namespace.
MEMBERS = (P2P_GROUP, PD_PAIR)
#: Every kind, pool first; by kind name.
KINDS: dict[str, CustomKind] = {k.kind: k for k in (POOL, *MEMBERS)}

_SEED = "resolvedHashSeed"  # KVCachePoolStatus.resolved_hash_seed on the wire


def _dict(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def pool_ref(body: Mapping[str, Any] | None) -> str:
    """The pool a member names (``spec.poolRef.name``); "" when it names none."""
    spec = _dict(_dict(body).get("spec"))
    return str(_dict(spec.get("poolRef")).get("name") or "")


def domain_of(body: Mapping[str, Any]) -> str:
    """The pool whose domain a CR belongs to: a pool's own name, a member's ``poolRef``."""
    if body.get("kind") == POOL.kind:
        return str(_dict(body.get("metadata")).get("name") or "")
    return pool_ref(body)


def stored_seed(body: Mapping[str, Any] | None) -> str | None:
    """The seed a pool's status keeps (``status.resolvedHashSeed``), None when it keeps none."""
    seed = _dict(_dict(body).get("status")).get(_SEED)
    return str(seed) if seed else None


def seed_status(seed: str) -> Obj:
    """A pool status holding only ``seed`` (what ``stored_seed`` reads)."""
    return {_SEED: seed}
