"""NetworkPolicies that keep a domain's internal ports inside its namespace.

Why: the controller's ZMQ sockets (pull, reply, heartbeat, index PUB and snapshot) and its
HTTP API accept admits, evicts and deregistrations from anyone who reaches them, and a
worker's ports (HTTP, LMCache worker, P2P and PD transfer ports, LMCache's internal API) move
KV. Rendered per pool and per member (not by the chart), so every namespace the operator
serves is covered. Ingress comes from pods of the same namespace only, plus the operator's own
pods (any namespace) for the controller's HTTP API, where it deregisters deleted instances. The
gateway is not selected: it is the domain's front door. NetworkPolicies do not apply to
hostNetwork pods, and need a CNI that enforces them.
"""

from __future__ import annotations

from kvpool.operator.api.pool import KVCachePool
from kvpool.operator.render import k8s

Obj = k8s.Obj

#: Labels the Helm chart puts on the operator's pods (charts/kvpool/templates/_helpers.tpl).
OPERATOR_POD_LABELS = {"app.kubernetes.io/name": "kvpool-operator"}


def internal_only(
    name: str,
    namespace: str,
    labels: dict[str, str],
    selector: dict[str, str],
    operator_ports: list[int] | None = None,
) -> Obj:
    """A NetworkPolicy: pods matching ``selector`` accept ingress from their own namespace only
    (and, on ``operator_ports``, from the kvpool operator's pods)."""
    ingress: list[Obj] = [{"from": [{"podSelector": {}}]}]
    if operator_ports:
        ingress.append(
            {
                "from": [
                    {
                        "namespaceSelector": {},
                        "podSelector": {"matchLabels": dict(OPERATOR_POD_LABELS)},
                    }
                ],
                "ports": [{"port": port, "protocol": "TCP"} for port in operator_ports],
            }
        )
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": k8s.meta(name, namespace, labels),
        "spec": {
            "podSelector": {"matchLabels": dict(sorted(selector.items()))},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def controller_policy(pool: KVCachePool, name: str, labels: dict[str, str]) -> Obj:
    """The controller's ports: its namespace, and the operator on the HTTP API."""
    http = pool.spec.controller.ports.http
    return internal_only(name, pool.metadata.namespace, labels, labels, [http])
