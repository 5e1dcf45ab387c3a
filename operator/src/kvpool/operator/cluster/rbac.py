"""RBAC authorization, as the API server decides it: pure.

Why: the chart gives the operator a service account, a ClusterRole generated from what its
handlers use and a ClusterRoleBinding; on a real cluster a request they do not grant is
refused (403), and the operator misbehaves. ``kvpool-operator cluster`` authorizes every
request with the Roles, ClusterRoles and bindings stored in it, so the operator runs under
exactly the permissions the chart grants. The rules are Kubernetes': a binding's subjects
(User, Group, ServiceAccount) get its role's rules, cluster-wide for a ClusterRoleBinding, in
its namespace for a RoleBinding; a rule matches by API group, resource (``plural``,
``plural/subresource``, ``*``, ``plural/*``), verb and resource name (``*`` everywhere);
``system:masters`` may do anything. Not reproduced (README): aggregated ClusterRoles,
non-resource URL rules (every client may read discovery and OpenAPI), impersonation and
escalation checks on writing roles.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

Obj = Mapping[str, Any]
MASTERS = "system:masters"


@dataclass(frozen=True)
class Request:
    """What is asked: who, which verb on which resource, where."""

    user: str
    groups: tuple[str, ...]
    verb: str
    group: str
    resource: str  # plural, or plural/subresource
    namespace: str | None
    name: str | None


def verb_of(method: str, named: bool, watch: bool) -> str:
    """The RBAC verb of an HTTP request on a resource."""
    if method == "GET":
        return "watch" if watch else ("get" if named else "list")
    if method == "DELETE":
        return "delete" if named else "deletecollection"
    return {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method, method.lower())


def _subject_matches(subject: Obj, request: Request, binding_ns: str | None) -> bool:
    kind, name = subject.get("kind"), subject.get("name")
    if kind == "User":
        return bool(name == request.user)
    if kind == "Group":
        return name in request.groups
    if kind == "ServiceAccount":
        ns = subject.get("namespace") or binding_ns
        return request.user == f"system:serviceaccount:{ns}:{name}"
    return False


def _rule_matches(rule: Obj, request: Request) -> bool:
    groups = rule.get("apiGroups") or []
    resources = rule.get("resources") or []
    verbs = rule.get("verbs") or []
    names = rule.get("resourceNames") or []
    plural = request.resource.split("/", 1)[0]
    by_resource = (
        "*" in resources
        or request.resource in resources
        or ("/" in request.resource and f"{plural}/*" in resources)
    )
    return (
        ("*" in groups or request.group in groups)
        and by_resource
        and ("*" in verbs or request.verb in verbs)
        and (not names or (request.name is not None and request.name in names))
    )


def allowed(
    request: Request,
    roles: Iterable[Obj],
    cluster_roles: Iterable[Obj],
    bindings: Iterable[Obj],
    cluster_bindings: Iterable[Obj],
) -> bool:
    """Whether any binding of the user grants the request."""
    if MASTERS in request.groups:
        return True
    by_role = {(r["metadata"].get("namespace"), r["metadata"]["name"]): r for r in roles}
    by_cluster_role = {r["metadata"]["name"]: r for r in cluster_roles}

    def granted(role_ref: Obj, namespace: str | None) -> bool:
        if role_ref.get("kind") == "ClusterRole":
            role = by_cluster_role.get(str(role_ref.get("name")))
        else:
            role = by_role.get((namespace, str(role_ref.get("name"))))
        return role is not None and any(_rule_matches(r, request) for r in role.get("rules") or [])

    for b in cluster_bindings:
        if any(_subject_matches(s, request, None) for s in b.get("subjects") or []) and granted(
            b.get("roleRef") or {}, None
        ):
            return True
    for b in bindings:
        ns = b["metadata"].get("namespace")
        if request.namespace != ns:
            continue
        if any(_subject_matches(s, request, ns) for s in b.get("subjects") or []) and granted(
            b.get("roleRef") or {}, ns
        ):
            return True
    return False


def forbidden_message(request: Request) -> str:
    """The API server's 403 message."""
    plural, _, sub = request.resource.partition("/")
    what = f'resource "{plural}"' + (f' in subresource "{sub}"' if sub else "")
    where = (
        f' in the namespace "{request.namespace}"' if request.namespace else " at the cluster scope"
    )
    target = f'{plural} "{request.name}"' if request.name else plural
    return (
        f'{target} is forbidden: User "{request.user}" cannot {request.verb} {what} in API '
        f'group "{request.group}"{where}'
    )
