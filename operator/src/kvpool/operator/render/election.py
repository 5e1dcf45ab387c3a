"""What the controller's replicas need to elect a leader: flags, env, RBAC, the Service selector.

Why a module: with ``spec.controller.replicas`` of two or more, the replica holding the Lease
``<pool>-controller`` leads (controller/README.md, "High availability"). Rendering that takes
four pieces, kept together here so they cannot disagree (none of them with one replica):

- flags: ``--lease-name``, the leader's delta stream and snapshot sockets through the controller
  Service (a standby follows the leader there), and ``--heartbeat-url`` naming the Service's
  heartbeat port (workers are told it at registration: heartbeats then follow the leader too);
- env: the pod's name and namespace (downward API), for the Lease holder and the role label;
- RBAC: a ServiceAccount, and a Role granting exactly what election uses: create a Lease, get
  and update this one, patch pods (each replica labels its own pod with its role);
- the controller Service selects ``kvpool.io/controller-role: leader`` besides the pool's
  labels, so workers, gateways and the standby itself reach the leader only. Readiness is not
  leadership: a warm standby is ready, so Deployment rollouts proceed pod by pod.
"""

from __future__ import annotations

from kvpool.operator.api.pool import KVCachePool
from kvpool.operator.derive import names
from kvpool.operator.render import k8s
from kvpool.protocol.domain import CONTROLLER_LEADER, CONTROLLER_ROLE_LABEL

Obj = k8s.Obj
RBAC_API = "rbac.authorization.k8s.io/v1"
LEASE_GROUP = "coordination.k8s.io"

#: The Role's rules: (API group, resource, resource names or None, verbs).
RULES: tuple[tuple[str, str, bool, tuple[str, ...]], ...] = (
    (LEASE_GROUP, "leases", False, ("create",)),
    (LEASE_GROUP, "leases", True, ("get", "update")),
    ("", "pods", False, ("patch",)),
)


def enabled(pool: KVCachePool) -> bool:
    """Whether the controller runs several replicas (and so elects a leader). One replica
    leads alone: no Lease, no RBAC, the Service selects it by the pool's labels."""
    return pool.spec.controller.replicas > 1


def lease_name(pool: KVCachePool) -> str:
    """The Lease the controller's replicas compete for (also its ServiceAccount and Role)."""
    return names.controller_name(pool)


def args(pool: KVCachePool) -> list[str]:
    """The controller flags of leader election (addresses through the controller Service)."""
    ports = pool.spec.controller.ports
    host = names.service_host(names.controller_name(pool), pool.metadata.namespace)
    return [
        "--lease-name",
        lease_name(pool),
        "--leader-pub-url",
        f"tcp://{host}:{ports.pub}",
        "--leader-snapshot-url",
        f"tcp://{host}:{ports.snapshot}",
        "--heartbeat-url",
        f"{host}:{ports.heartbeat}",
    ]


def env() -> list[Obj]:
    """The pod's own name and namespace (the Lease holder, the pod it labels)."""
    return [
        k8s.field_env("POD_NAME", "metadata.name"),
        k8s.field_env("POD_NAMESPACE", "metadata.namespace"),
    ]


def selector(labels: dict[str, str]) -> dict[str, str]:
    """The controller Service's selector: the pool's controller pods, the leader only."""
    return {**labels, CONTROLLER_ROLE_LABEL: CONTROLLER_LEADER}


def objects(pool: KVCachePool, labels: dict[str, str]) -> list[Obj]:
    """ServiceAccount, Role and RoleBinding of the controller's replicas."""
    name, ns = lease_name(pool), pool.metadata.namespace
    rules = []
    for group, resource, named, verbs in RULES:
        rule: Obj = {"apiGroups": [group], "resources": [resource], "verbs": list(verbs)}
        if named:
            rule["resourceNames"] = [name]
        rules.append(rule)
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": k8s.meta(name, ns, labels)},
        {
            "apiVersion": RBAC_API,
            "kind": "Role",
            "metadata": k8s.meta(name, ns, labels),
            "rules": rules,
        },
        {
            "apiVersion": RBAC_API,
            "kind": "RoleBinding",
            "metadata": k8s.meta(name, ns, labels),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}],
        },
    ]
