"""NetworkPolicies that admit only the domain itself (and the operator) to its internal ports.

Why: the controller's ZMQ sockets (pull, reply, heartbeat, index PUB and snapshot) accept
admits, evicts and registrations from anyone who reaches them, its HTTP API clears, pins and
moves KV, and a worker's ports (HTTP and the memory API, LMCache worker, P2P and PD transfer
ports, LMCache's internal API) move KV. Rendered per pool and per member (not by the chart), so
every namespace the operator serves is covered. Ingress comes from exactly these peers:

- the domain's own pods, selected by the labels every pod of the pool carries (workers,
  controller, the gateway, the Mooncake parts): not the other applications of the namespace;
- the kvpool operator's pods, on the controller's HTTP port only (deregistration, the
  allowlist, the live figures), in the operator's namespace when the render knows it (the
  runtime does: ``POD_NAMESPACE``), else in any namespace;
- with hostNetwork members, anyone on the controller's worker-facing ZMQ ports (pull, reply,
  heartbeat): a hostNetwork pod's traffic comes from its node's address, which no pod selector
  matches, and node addresses are not known here. There the controller's allowlist of
  instance ids (allowlist.py of the controller) keeps strangers from registering.

The gateway is not selected: it is the domain's front door, open as its Service is configured.
NetworkPolicies are additive: a Prometheus in another namespace needs a policy of its own for
the metrics ports. They do not apply to hostNetwork pods, and need a CNI that enforces them.
"""

from __future__ import annotations

from kvpool.operator.api.pool import KVCachePool
from kvpool.operator.derive import names
from kvpool.operator.render import k8s

Obj = k8s.Obj

#: Labels the Helm chart puts on the operator's pods (charts/kvpool/templates/_helpers.tpl).
OPERATOR_POD_LABELS = {"app.kubernetes.io/name": "kvpool-operator"}
#: The label Kubernetes puts on every namespace: its name.
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


def domain_peer(pool: KVCachePool) -> Obj:
    """Every pod of the pool's domain (the labels ``names.pool_labels`` gives each of them)."""
    labels = names.pool_labels(pool, "")
    del labels[names.LABEL_COMPONENT]
    return {"podSelector": {"matchLabels": dict(sorted(labels.items()))}}


def operator_peer(operator_namespace: str | None) -> Obj:
    """The operator's pods: in its namespace when known, else in any namespace."""
    namespaces = (
        {"matchLabels": {NAMESPACE_NAME_LABEL: operator_namespace}} if operator_namespace else {}
    )
    return {"namespaceSelector": namespaces, "podSelector": {"matchLabels": OPERATOR_POD_LABELS}}


def _tcp(ports: list[int]) -> list[Obj]:
    return [{"port": port, "protocol": "TCP"} for port in ports]


def policy(
    name: str, namespace: str, labels: dict[str, str], selector: dict[str, str], ingress: list[Obj]
) -> Obj:
    """A NetworkPolicy: pods matching ``selector`` accept ``ingress`` only."""
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


def worker_policy(pool: KVCachePool, name: str, labels: dict[str, str]) -> Obj:
    """A member's workers: the domain's own pods only (P2P and PD peers, the controller's
    control requests, the gateway's requests and the memory API)."""
    return policy(name, pool.metadata.namespace, labels, labels, [{"from": [domain_peer(pool)]}])


def controller_policy(
    pool: KVCachePool,
    name: str,
    labels: dict[str, str],
    *,
    host_network: bool = False,
    operator_namespace: str | None = None,
) -> Obj:
    """The controller's ports: the domain's pods, the operator on the HTTP API, and (with
    hostNetwork members, ``host_network``) any source on the ports workers connect to."""
    ports = pool.spec.controller.ports
    ingress: list[Obj] = [
        {"from": [domain_peer(pool)]},
        {"from": [operator_peer(operator_namespace)], "ports": _tcp([ports.http])},
    ]
    if host_network:
        ingress.append({"ports": _tcp([ports.pull, ports.reply, ports.heartbeat])})
    return policy(name, pool.metadata.namespace, labels, labels, ingress)
