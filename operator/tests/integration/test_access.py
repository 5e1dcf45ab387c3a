"""Who may change a domain, against the emulated API server and the real controller's HTTP app.

The operator draws the domain's controller API token once and keeps it in a Secret; it sends a
ready controller the domain's instance ids (``PUT /v1/instances``, with the token) before it
creates the StatefulSet of a scaled-up instance, holds that StatefulSet back while the
controller refuses (a wrong token here) and creates it once the controller takes the ids; a
member's finalizer deregisters with the token. The emulator runs no kubelet: the test sets the
controller Deployment's readiness by hand, as a cluster would.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import pytest
from apiserver import ApiServer
from harness import Client, OperatorThread, eventually, example
from pydantic import SecretStr
from test_finalizers import controller  # noqa: F401 (the fixture: the real controller's app)
from test_reconcile import EVENTS, P2PGS, STS, observed, one

from kvpool.controller.server import ControllerServer
from kvpool.protocol import lmcache_wire as p

SECRETS = "v1/secrets"
SERVICES = "v1/services"
FP = "4683d6be7c28"


@pytest.fixture
def settings_overrides(controller: tuple[str, ControllerServer]) -> dict[str, Any]:  # noqa: F811
    return {"controller_url": controller[0]}


def names(apiserver: ApiServer, resource: str) -> set[str]:
    return {o["metadata"]["name"] for o in apiserver.live(resource)}


async def test_new_instances_are_allowed_before_their_pods_and_the_token_is_the_domains(
    apiserver: ApiServer,
    client: Client,
    operator: OperatorThread,
    controller: tuple[str, ControllerServer],  # noqa: F811
) -> None:
    svc = controller[1].service
    for doc in example("cpu-demo"):
        await client.create(doc)
    await eventually(lambda: observed(apiserver, P2PGS, "demo-p2p"))
    secret = one(apiserver, SECRETS, "demo-controller-token")
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert len(token) >= 40 and secret["type"] == "Opaque"
    svc.settings.api_token = SecretStr(token)  # the env the Secret gives the controller's pod

    sts_when_allowed: dict[str, set[str]] = {}
    replace = svc.allowlist.replace

    def record(ids: list[str], source: str) -> None:
        for iid in ids:
            sts_when_allowed.setdefault(iid, names(apiserver, STS))
        replace(ids, source)

    svc.allowlist.replace = record  # type: ignore[method-assign]
    await client.patch(
        "Deployment", "demo-controller", {"status": {"readyReplicas": 1}}, status=True
    )
    await client.patch("P2PGroup", "demo-p2p", {"spec": {"replicas": 3}})
    await eventually(lambda: "demo-p2p-2" in names(apiserver, STS), what="demo-p2p-2 created")
    assert "demo-p2p-2" not in sts_when_allowed[f"demo-p2p-2~{FP}"]
    assert svc.allowlist.source == "operator"
    allowed = svc.handle_request(p.RegisterMsg(f"demo-p2p-2~{FP}", 0, "10.0.0.3", 7000, None))
    assert isinstance(allowed, p.RegisterRetMsg)
    stranger = svc.handle_request(p.RegisterMsg(f"demo-p2p-9~{FP}", 0, "10.0.0.9", 7000, None))
    assert isinstance(stranger, p.ErrorMsg) and "not one the operator rendered" in stranger.error

    # A controller that refuses the operator (another token): the new pod is held back.
    svc.settings.api_token = SecretStr("not-the-domains-token")
    await client.patch("P2PGroup", "demo-p2p", {"spec": {"replicas": 4}})
    await eventually(lambda: svc.metrics.unauthorized["/v1/instances"] >= 1, what="a refusal")
    await eventually(lambda: "demo-p2p-3" in names(apiserver, SERVICES), what="the rest applied")
    await asyncio.sleep(0.5)
    assert "demo-p2p-3" not in names(apiserver, STS)
    assert not svc.allowlist.allows(f"demo-p2p-3~{FP}")
    svc.settings.api_token = SecretStr(token)
    await eventually(
        lambda: "demo-p2p-3" in names(apiserver, STS), timeout=20, what="created after a retry"
    )
    assert "demo-p2p-3" not in sts_when_allowed[f"demo-p2p-3~{FP}"]

    # The finalizer deregisters with the token.
    svc.handle_request(p.RegisterMsg(f"demo-p2p-0~{FP}", 0, "10.0.0.1", 7000, None))
    unauthorized = sum(svc.metrics.unauthorized.values())
    await client.delete("P2PGroup", "demo-p2p")
    await eventually(lambda: not apiserver.live(P2PGS), what="demo-p2p deleted")
    assert not [i for i in svc.registry.instances() if i.startswith("demo-p2p-")]
    assert sum(svc.metrics.unauthorized.values()) == unauthorized
    assert not [e for e in apiserver.live(EVENTS) if e["reason"] == "DeregisterFailed"]
