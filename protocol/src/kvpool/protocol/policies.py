"""The names of the gateway's routing policies, as the operator's API and ``gateway.yaml`` spell
them.

Why this module exists: the operator validates ``spec.gateway.routing.policy`` (and generates the
CRD's enum from it), the gateway's config accepts the same names and its policy registry builds
one class per name. The list is written once, here; the gateway's tests check that its registry
has a class for exactly these names.
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["ROUTING_POLICIES", "RoutingPolicyName"]

RoutingPolicyName = Literal["kv-aware", "session", "least-load", "round-robin"]
ROUTING_POLICIES: tuple[str, ...] = get_args(RoutingPolicyName)
