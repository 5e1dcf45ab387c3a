"""Services in front of several replicas under ``kvpool-operator up``: which, and where.

Why a module: a cluster's Service spreads connections over the ready pods its selector matches;
on one machine each replica of a Deployment binds its own local ports (``plan.cluster_map``),
and the Service's ports become proxies in the ``up`` process. Which Services need one, on which
local ports, forwarding to which container port of which workload, is decided here, purely,
from the render and the address map; ``services.py`` runs the proxies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvpool.operator.local.plan import ClusterMap, Obj, StackError, by_kind, selects, template_ports


@dataclass(frozen=True)
class Balanced:
    """A Service in front of the replicas of one Deployment: ``up`` listens on ``listen``
    (local port -> the replicas' container port) and sends each connection to a replica that
    is ready and whose pod labels match ``selector``."""

    service: str
    workload: str
    selector: Mapping[str, str]
    listen: Mapping[int, int]


def balanced_services(objects: Sequence[Obj], cmap: ClusterMap) -> list[Balanced]:
    """Every Service whose selector matches a Deployment of several replicas (its ports are
    proxies under ``up``); a headless Service is never one (it names pods, not a proxy)."""
    deployments = {o["metadata"]["name"]: o for o in by_kind(objects, "Deployment")}
    out: list[Balanced] = []
    claimed: dict[int, str] = {}
    for svc in by_kind(objects, "Service"):
        spec = svc["spec"]
        if spec.get("clusterIP") == "None":
            continue
        selector = dict(spec.get("selector", {}))
        for name, deployment in sorted(deployments.items()):
            if name not in cmap.replicas or not selector or not selects(selector, deployment):
                continue
            named = template_ports(deployment)
            listen: dict[int, int] = {}
            for sp in spec.get("ports", []):
                target = sp.get("targetPort", sp["port"])
                number = target if isinstance(target, int) else named.get(str(target))
                if number is None:
                    continue
                local = cmap.ports[int(number)]
                if claimed.setdefault(local, svc["metadata"]["name"]) != svc["metadata"]["name"]:
                    raise StackError(
                        f"Services {claimed[local]} and {svc['metadata']['name']} both front "
                        f"port {number} of {name}: the local stack proxies one Service a port"
                    )
                listen[local] = int(number)
            out.append(Balanced(svc["metadata"]["name"], name, selector, listen))
    return out
