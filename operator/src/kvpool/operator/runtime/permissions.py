"""The operator's process contract: its command line, its ports and every API permission it uses.

Why one module: the Helm chart's Deployment (args, ports, probes) and its ClusterRole/Role are
generated from (and tested against) these definitions, and the handlers' Kubernetes client
refuses a request that is not listed here (``require``), so the chart can never grant less or
more than the operator actually does. Pure data, no I/O, no kopf.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvpool.operator.api import kinds
from kvpool.operator.api.common import GROUP, VERSION

Scope = Literal["namespaced", "cluster"]

#: Verbs the operator may use. Its own writes are patches; "get" and "update" (PUT) are held on
#: Leases only so that it may grant them: Kubernetes lets the operator create a Role only with
#: permissions it holds itself (RBAC escalation prevention), and each domain's controller Role
#: (``render/election.py``) grants Lease get/create/update and pod patch.
Verb = Literal["get", "list", "watch", "create", "update", "patch", "delete"]

#: ``kvpool-operator run`` flags the chart sets (each also reads KVPOOL_OPERATOR_<NAME>).
HEALTH_PORT = 8080  # GET /healthz (liveness), GET /readyz (readiness)
METRICS_PORT = 8081  # GET /metrics (Prometheus text format)
WEBHOOK_PORT = 9443  # HTTPS, POST /<handler id> (AdmissionReview v1)
WEBHOOK_CERT_DIR = "/tmp/kvpool-webhook"  # tls.crt, tls.key, ca.crt
FIELD_MANAGER = "kvpool-operator"
#: Name of the ValidatingWebhookConfiguration the operator patches in self-signed mode.
WEBHOOK_CONFIGURATION = "kvpool.io"
#: URL paths of the admission handlers (one per kind), under the webhook Service.
WEBHOOK_PATHS = {k.kind: f"/validate-{k.singular}" for k in kinds.KINDS.values()}
#: The operations each kind's webhook reviews: a pool's DELETE is refused while members remain.
WEBHOOK_OPERATIONS: dict[str, tuple[str, ...]] = {
    "KVCachePool": ("CREATE", "UPDATE", "DELETE"),
    "P2PGroup": ("CREATE", "UPDATE"),
    "PDPair": ("CREATE", "UPDATE"),
}
COMMAND = ["kvpool-operator", "run"]
#: Default arguments of the chart's container (values override the ports and the cert mode).
DEFAULT_ARGS = [
    f"--health-port={HEALTH_PORT}",
    f"--metrics-port={METRICS_PORT}",
    f"--webhook-port={WEBHOOK_PORT}",
    "--webhook-mode=self-signed",
    f"--webhook-cert-dir={WEBHOOK_CERT_DIR}",
]


@dataclass(frozen=True)
class Permission:
    """One RBAC rule: API group ("" = core), resource (``plural`` or ``plural/sub``), verbs."""

    group: str
    resource: str
    verbs: tuple[Verb, ...]
    scope: Scope = "namespaced"
    why: str = ""


_CHILD_VERBS: tuple[Verb, ...] = ("list", "create", "patch", "delete")

PERMISSIONS: tuple[Permission, ...] = (
    *(
        Permission(GROUP, k.plural, ("list", "watch", "patch"), why="kopf's watch, finalizers")
        for k in kinds.KINDS.values()
    ),
    *(
        Permission(GROUP, f"{k.plural}/status", ("patch",), why="conditions and status")
        for k in kinds.KINDS.values()
    ),
    Permission("", "configmaps", _CHILD_VERBS, why="domain seed, LMCache and gateway config"),
    Permission(
        "",
        "secrets",
        _CHILD_VERBS,
        why="each domain's controller API token (listed by the domain's labels)",
    ),
    Permission("", "services", _CHILD_VERBS, why="controller, gateway, instance Services"),
    Permission("apps", "deployments", _CHILD_VERBS, why="controller, gateway, Mooncake"),
    Permission("apps", "statefulsets", (*_CHILD_VERBS, "watch"), why="workers; readiness"),
    Permission("policy", "poddisruptionbudgets", _CHILD_VERBS, why="gateway and member PDBs"),
    Permission(
        "networking.k8s.io",
        "networkpolicies",
        _CHILD_VERBS,
        why="controller and worker ports kept to the domain's pods and the operator",
    ),
    Permission(
        "",
        "pods",
        ("list", "patch"),
        why="drift timer reads pod fingerprints; patch only held to grant it (election)",
    ),
    Permission("", "serviceaccounts", _CHILD_VERBS, why="each domain controller's identity"),
    Permission(
        "rbac.authorization.k8s.io", "roles", _CHILD_VERBS, why="each domain controller's Role"
    ),
    Permission(
        "rbac.authorization.k8s.io",
        "rolebindings",
        _CHILD_VERBS,
        why="binds the controller's Role to its ServiceAccount",
    ),
    Permission(
        "coordination.k8s.io",
        "leases",
        ("get", "create", "update"),
        why="only held to grant it to each controller Role (election)",
    ),
    Permission("", "events", ("create",), why="Events on invalid specs and blocked deletes"),
    Permission("", "namespaces", ("list", "watch"), "cluster", why="kopf namespace observer"),
    Permission(
        "apiextensions.k8s.io",
        "customresourcedefinitions",
        ("list", "watch"),
        "cluster",
        why="kopf resource discovery",
    ),
    Permission(
        "admissionregistration.k8s.io",
        "validatingwebhookconfigurations",
        ("create", "patch"),
        "cluster",
        why="self-signed mode only: kopf writes the caBundle",
    ),
)

#: The resources the handlers' client may touch, by (group, resource) -> verbs.
_INDEX: dict[tuple[str, str], frozenset[str]] = {
    (p.group, p.resource): frozenset(p.verbs) for p in PERMISSIONS
}


class NotPermittedError(Exception):
    """A request the operator's RBAC (this module) does not grant: a bug, not a cluster error."""


def require(group: str, resource: str, verb: str) -> None:
    """Raise NotPermittedError unless PERMISSIONS grants ``verb`` on ``group/resource``."""
    if verb not in _INDEX.get((group, resource), frozenset()):
        raise NotPermittedError(
            f"{verb} {group or 'core'}/{resource} is not in kvpool.operator.runtime.permissions"
        )


def webhooks() -> list[dict[str, object]]:
    """One webhook per kind: name, path and the rule it matches (the chart's cert-manager
    template and the operator's self-signed configuration both use this)."""
    return [
        {
            "name": f"{kind.lower()}.validate.{GROUP}",
            "path": WEBHOOK_PATHS[kind],
            "rules": [
                {
                    "apiGroups": [GROUP],
                    "apiVersions": [VERSION],
                    "operations": list(WEBHOOK_OPERATIONS[kind]),
                    "resources": [kinds.KINDS[kind].plural],
                    "scope": "Namespaced",
                }
            ],
        }
        for kind in sorted(WEBHOOK_PATHS)
    ]


def webhook_configuration(
    service: str, namespace: str, port: int, ca_bundle: str, *, enabled: bool = True
) -> dict[str, object]:
    """The ValidatingWebhookConfiguration the operator writes in self-signed mode: the chart's
    webhooks (``webhooks()``) at its Service with its CA; ``enabled=False``: no webhooks (what
    it leaves behind when it stops, so kvpool resources stay writable without it)."""
    hooks = [
        {
            "name": hook["name"],
            "admissionReviewVersions": ["v1"],
            "sideEffects": "None",
            "failurePolicy": "Fail",
            "timeoutSeconds": 10,
            "clientConfig": {
                "service": {
                    "name": service,
                    "namespace": namespace,
                    "path": hook["path"],
                    "port": port,
                },
                "caBundle": ca_bundle,
            },
            "rules": hook["rules"],
        }
        for hook in webhooks()
    ]
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": WEBHOOK_CONFIGURATION},
        "webhooks": hooks if enabled else [],
    }


def rbac_rules(scope: Scope, *, webhook_self_signed: bool = True) -> list[dict[str, object]]:
    """Kubernetes PolicyRules for one scope (what a ClusterRole or Role must contain)."""
    rules: list[dict[str, object]] = []
    for p in PERMISSIONS:
        if p.scope != scope:
            continue
        if p.resource == "validatingwebhookconfigurations" and not webhook_self_signed:
            continue
        rules.append({"apiGroups": [p.group], "resources": [p.resource], "verbs": list(p.verbs)})
    return rules
