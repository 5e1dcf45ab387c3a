"""The controller's leader election as rendered (``render/election.py``): only with replicas > 1.

With two replicas the controller gets the election flags (addresses through its own Service),
its pod's name and namespace, a ServiceAccount whose Role grants exactly the Lease and the pod
label it uses, the Service selects the leader's pod only, and a PodDisruptionBudget lets a drain
evict one replica at a time. With one replica nothing of it is rendered: the controller leads
alone, as before.
"""

from __future__ import annotations

from typing import Any

from op_builders import p2p, pool

from kvpool.operator.render import render_domain
from kvpool.protocol.domain import CONTROLLER_LEADER, CONTROLLER_ROLE_LABEL


def _controller(replicas: int) -> dict[str, dict[str, Any]]:
    the_pool = pool()
    the_pool.spec.controller.replicas = replicas
    objects = render_domain(the_pool, [p2p()])
    return {
        o["kind"]: o
        for o in objects
        if o["metadata"]["name"] == "pool-controller"
        and o["kind"]
        in ("Deployment", "Service", "ServiceAccount", "Role", "RoleBinding", "PodDisruptionBudget")
    }


def test_two_replicas_elect_a_leader_the_service_selects() -> None:
    objs = _controller(2)
    assert set(objs) == {
        "Deployment", "Service", "ServiceAccount", "Role", "RoleBinding", "PodDisruptionBudget"
    }  # fmt: skip
    deployment = objs["Deployment"]
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "pool-controller"
    (container,) = pod["containers"]
    command = container["command"]
    host = "pool-controller.ns.svc"
    ports = pool().spec.controller.ports
    assert command[command.index("--lease-name") + 1] == "pool-controller"
    assert command[command.index("--leader-pub-url") + 1] == f"tcp://{host}:{ports.pub}"
    assert command[command.index("--leader-snapshot-url") + 1] == f"tcp://{host}:{ports.snapshot}"
    assert command[command.index("--heartbeat-url") + 1] == f"{host}:{ports.heartbeat}"
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}) for e in container["env"]}
    assert env["POD_NAME"]["fieldPath"] == "metadata.name"
    assert env["POD_NAMESPACE"]["fieldPath"] == "metadata.namespace"
    selector = objs["Service"]["spec"]["selector"]
    assert selector[CONTROLLER_ROLE_LABEL] == CONTROLLER_LEADER
    template = deployment["spec"]["template"]["metadata"]["labels"]
    assert {k: v for k, v in selector.items() if k != CONTROLLER_ROLE_LABEL}.items() <= (
        template.items()
    )
    rules = objs["Role"]["rules"]
    assert {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]} in (
        rules
    )
    assert {
        "apiGroups": ["coordination.k8s.io"],
        "resources": ["leases"],
        "verbs": ["get", "update"],
        "resourceNames": ["pool-controller"],
    } in rules
    assert {"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]} in rules
    assert len(rules) == 3
    assert objs["RoleBinding"]["subjects"] == [
        {"kind": "ServiceAccount", "name": "pool-controller", "namespace": "ns"}
    ]
    budget = objs["PodDisruptionBudget"]["spec"]
    assert budget["maxUnavailable"] == 1  # a drain takes one replica: the other leads, warm
    assert budget["selector"]["matchLabels"].items() <= template.items()
    assert CONTROLLER_ROLE_LABEL not in budget["selector"]["matchLabels"]  # leader and standby


def test_one_replica_renders_no_election() -> None:
    objs = _controller(1)
    assert set(objs) == {"Deployment", "Service"}
    pod = objs["Deployment"]["spec"]["template"]["spec"]
    assert "serviceAccountName" not in pod
    assert "--lease-name" not in pod["containers"][0]["command"]
    assert CONTROLLER_ROLE_LABEL not in objs["Service"]["spec"]["selector"]
