"""The RBAC the chart grants (runtime/permissions.py) is exactly what the operator uses.

Every request the operator process sent to the emulated API server during a full flow —
kopf's own (user agent kopf/...) and the handlers' client (kvpool-operator/...) — is mapped
to (API group, resource[/subresource], verb) and must be granted by PERMISSIONS; and every
grant must have been used, except REAL_CLUSTER_ONLY: kopf's CRD and namespace discovery
(disabled in the emulator runs) and the webhook configuration writes of self-signed mode
(exercised by test_webhook.py, where this test's operator runs without a webhook), and
GRANT_ONLY: what each domain's controller Role grants (the operator holds it only to grant it).
"""

from __future__ import annotations

from typing import Any

from apiserver import ApiServer
from harness import Client, OperatorThread, eventually, example
from test_reconcile import CMS, P2PGS, POOLS, observed, one

from kvpool.operator.render import election
from kvpool.operator.runtime import permissions

PDB = "policy/v1/poddisruptionbudgets"
NP = "networking.k8s.io/v1/networkpolicies"
SVCS = "v1/services"
ROLES = "rbac.authorization.k8s.io/v1/roles"
BINDINGS = "rbac.authorization.k8s.io/v1/rolebindings"
REAL_CLUSTER_ONLY = {
    ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
    ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
    ("", "namespaces", "list"),
    ("", "namespaces", "watch"),
    ("admissionregistration.k8s.io", "validatingwebhookconfigurations", "create"),
    ("admissionregistration.k8s.io", "validatingwebhookconfigurations", "patch"),
}
#: Held only so that the operator may grant them to each domain's controller Role (Kubernetes
#: lets it create a Role only with permissions it holds itself): never used by the operator.
GRANT_ONLY = {
    (group, resource, verb) for group, resource, _named, verbs in election.RULES for verb in verbs
}


def _verb(method: str, named: bool, params: dict[str, str]) -> str:
    if method == "GET":
        return "watch" if params.get("watch") == "true" else ("get" if named else "list")
    return {"POST": "create", "PATCH": "patch", "DELETE": "delete", "PUT": "update"}[method]


def used(requests: list[Any]) -> set[tuple[str, str, str]]:
    out = set()
    for r in requests:
        agent = r.headers.get("User-Agent", "")
        if r.resource is None or r.resource.plural is None:
            continue  # discovery (/api, /apis/...), which RBAC does not restrict
        if not agent.startswith(("kopf/", "kvpool-operator/")):
            continue
        resource = r.resource.plural + (f"/{r.subresource}" if r.subresource else "")
        out.add((r.resource.group, resource, _verb(r.method.value, r.name is not None, r.params)))
    return out


async def test_every_request_is_granted_and_every_grant_is_used(
    apiserver: ApiServer, client: Client, operator: OperatorThread
) -> None:
    pool, p2p, pd = example("cpu-demo")
    pool["spec"]["controller"] = {"replicas": 2}  # leader election: its ServiceAccount and Role
    for doc in (pool, p2p, pd):
        await client.create(doc)
    await eventually(lambda: observed(apiserver, P2PGS, "demo-p2p"))
    await client.patch("P2PGroup", "demo-p2p", {"spec": {"replicas": 1}})
    await eventually(lambda: one(apiserver, P2PGS, "demo-p2p")["status"]["instancesDesired"] == 1)
    await client.patch(
        "StatefulSet", "demo-pd-prefill-0", {"status": {"readyReplicas": 1}}, status=True
    )
    await client.patch(
        "StatefulSet", "demo-pd-decode-0", {"status": {"readyReplicas": 1}}, status=True
    )
    await eventually(
        lambda: "demo-pd" in one(apiserver, CMS, "demo-gateway")["data"]["gateway.yaml"]
    )
    await client.patch("PodDisruptionBudget", "demo-p2p", {"spec": {"maxUnavailable": 5}})
    await client.patch("NetworkPolicy", "demo-p2p", {"spec": {"policyTypes": ["Egress"]}})
    # a Service edited by hand: restored by a patch (no flow above needs one on every run)
    svc_drift = {"metadata": {"labels": {"app.kubernetes.io/name": "x"}}}
    await client.patch("Service", "demo-gateway", svc_drift)
    # hand-made drift of the controller's access objects, restored by the next pass
    await client.patch("Role", "demo-controller", {"rules": []})
    await client.patch("RoleBinding", "demo-controller", {"subjects": []})
    sa_drift = {"metadata": {"labels": {"app.kubernetes.io/name": "x"}}}
    await client.patch("ServiceAccount", "demo-controller", sa_drift)
    await client.patch("Secret", "demo-controller-token", {"data": {"token": "!not-base64"}})
    await client.patch("KVCachePool", "demo", {"spec": {"hashSeed": "9"}})  # rolls every workload
    await eventually(lambda: one(apiserver, ROLES, "demo-controller")["rules"] != [])
    await eventually(lambda: one(apiserver, BINDINGS, "demo-controller")["subjects"] != [])
    await client.patch("KVCachePool", "demo", {"spec": {"controller": {"replicas": 1}}})
    await eventually(lambda: not apiserver.live(ROLES))  # one replica elects nobody: pruned
    await eventually(lambda: one(apiserver, PDB, "demo-p2p")["spec"]["maxUnavailable"] == 1)
    await eventually(lambda: one(apiserver, NP, "demo-p2p")["spec"]["policyTypes"] == ["Ingress"])
    await eventually(
        lambda: one(apiserver, SVCS, "demo-gateway")["metadata"]["labels"]["app.kubernetes.io/name"]
        != "x"
    )
    bad = {"spec": {"tiers": {"disk": {"path": "/kv", "size": "1Gi"}}}}
    await client.patch("KVCachePool", "demo", bad)
    await eventually(
        lambda: [e for e in apiserver.live("v1/events") if e["reason"] == "InvalidSpec"]
    )
    await client.patch("KVCachePool", "demo", {"spec": {"tiers": {"disk": None}}})
    await client.delete("KVCachePool", "demo")
    await client.delete("P2PGroup", "demo-p2p")
    await client.delete("PDPair", "demo-pd")
    await eventually(lambda: not apiserver.live(POOLS), timeout=15)

    granted = {(p.group, p.resource, v) for p in permissions.PERMISSIONS for v in p.verbs}
    seen = used(apiserver._requests)
    assert seen - granted == set(), "requests the chart's RBAC would refuse"
    assert granted - seen - REAL_CLUSTER_ONLY - GRANT_ONLY == set(), "grants nothing uses"


def test_rbac_rules_split_by_scope() -> None:
    cluster = permissions.rbac_rules("cluster")
    assert {r["resources"][0] for r in cluster} == {  # type: ignore[index]
        "namespaces",
        "customresourcedefinitions",
        "validatingwebhookconfigurations",
    }
    assert "validatingwebhookconfigurations" not in str(
        permissions.rbac_rules("cluster", webhook_self_signed=False)
    )
    assert all(r["verbs"] for r in permissions.rbac_rules("namespaced"))
