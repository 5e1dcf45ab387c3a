"""Pure render: a pool and its members in, Kubernetes objects (dicts) out.

No clock, no environment, no globals: the same input always yields the same objects, which the
golden-file tests pin. The kopf glue adopts and applies them; the CLI prints them.
"""

from __future__ import annotations

from kvpool.operator.api.members import P2PGroup, PDPair
from kvpool.operator.api.pool import KVCachePool
from kvpool.operator.render.k8s import Obj
from kvpool.operator.render.member_objects import lmcache_configs, member_objects
from kvpool.operator.render.pool_objects import pool_objects


def render(pool: KVCachePool, member: P2PGroup | PDPair) -> list[Obj]:
    """The child objects of one member (P2PGroup or PDPair) of ``pool``'s domain."""
    return member_objects(pool, member)


def render_domain(
    pool: KVCachePool,
    members: list[P2PGroup | PDPair],
    ready_pd_pairs: frozenset[str] | None = None,
    *,
    api_token: str | None = None,
    operator_namespace: str | None = None,
) -> list[Obj]:
    """The pool's own objects followed by every member's, members sorted by kind and name.

    ``ready_pd_pairs``: the PDPairs whose prefill and decode sides are ready (observed by the
    operator); only those are announced to the gateway. None (the CLI's dry run) announces all.
    ``api_token``: the domain's controller API token (the operator generates it once and keeps
    it in its Secret); None renders no Secret (a dry run; ``up`` makes a value of its own).
    ``operator_namespace``: where the operator's pods run (its NetworkPolicy peer); None: any.
    """
    ordered = sorted(members, key=lambda m: (m.kind, m.metadata.name))
    out = pool_objects(pool, ordered, ready_pd_pairs, api_token, operator_namespace)
    for member in ordered:
        out.extend(member_objects(pool, member))
    return out


__all__ = ["Obj", "lmcache_configs", "render", "render_domain"]
