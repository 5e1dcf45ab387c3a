"""Who may reach a domain's internals, as the runtime decides it: the controller's API token
(generated once, kept in the domain's Secret, read back ever after), the allowlist of instance
ids (rendered, and sent to a ready controller before the pods that carry a new id exist), and
the order of the writes that makes a scale-up's instance allowed before its pod can register.

The reconcile runs against a recording client and a fake controller API (no API server and no
controller process are needed for the order; the integration tests run both for real)."""

from __future__ import annotations

import base64
import copy
from typing import Any

import pytest
from op_builders import DocsSource, demo_docs

from kvpool.operator.derive import names
from kvpool.operator.runtime import reconcile
from kvpool.operator.runtime.metrics import Metrics
from kvpool.operator.runtime.plan import AllowlistPush, Observed, Plan, deregistration, plan_domain

Obj = dict[str, Any]
NOW = "2026-01-01T00:00:00Z"


def planned(children: list[Obj] | None = None, docs: list[Obj] | None = None) -> Plan:
    pool, *members = docs or demo_docs()
    observed = Observed(
        "default",
        "demo",
        pool,
        members,
        children or [],
        [],
        fresh_token="fresh-token",
        operator_namespace="kvpool-system",
    )
    return plan_domain(observed, NOW, lambda child, owner: None)


def secret_of(plan: Plan) -> Obj:
    return next(o for o in plan.create if o["kind"] == "Secret")


def ready(children: list[Obj]) -> list[Obj]:
    """The children with the controller Deployment reporting a ready replica."""
    out = copy.deepcopy(children)
    for obj in out:
        if obj["kind"] == "Deployment" and obj["metadata"]["name"] == "demo-controller":
            obj["status"] = {"readyReplicas": 1}
    return out


def test_the_token_is_drawn_once_and_read_back_from_its_secret_ever_after() -> None:
    first = planned()
    secret = secret_of(first)
    assert secret["metadata"]["name"] == "demo-controller-token"
    assert base64.b64decode(secret["data"]["token"]).decode() == "fresh-token"
    kept = copy.deepcopy(first.create)
    kept_secret = next(o for o in kept if o["kind"] == "Secret")
    kept_secret["data"]["token"] = base64.b64encode(b"kept-token").decode()
    again = planned(kept)  # the glue draws another fresh token each pass: never used now
    assert not [o for o in again.create if o["kind"] == "Secret"]
    assert not [c for c, _ in again.patch if c["kind"] == "Secret"]
    deployment = next(
        o
        for o in first.create
        if o["kind"] == "Deployment" and "controller" in o["metadata"]["name"]
    )
    env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    ref = next(e for e in env if e["name"] == "KVPOOL_CONTROLLER_API_TOKEN")
    assert ref["valueFrom"]["secretKeyRef"] == {"name": "demo-controller-token", "key": "token"}
    assert "fresh-token" not in str(deployment)  # only its hash, which restarts the pod
    assert names.ANNOTATION_TOKEN in deployment["spec"]["template"]["metadata"]["annotations"]


def test_the_allowlist_names_every_rendered_instance_and_is_sent_only_to_a_ready_controller() -> (
    None
):
    first = planned()
    allowlist = next(
        o
        for o in first.create
        if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "demo-controller"
    )
    assert allowlist["data"]["instances.yaml"] == (
        "instance_ids:\n- demo-p2p-0~4683d6be7c28\n- demo-p2p-1~4683d6be7c28\n"
        "- demo-pd-decode-0~4683d6be7c28\n- demo-pd-prefill-0~4683d6be7c28\n"
    )
    assert first.allowlist is None  # no controller yet: it reads the file when it starts
    assert planned(first.create).allowlist is None  # there, not ready
    push = planned(ready(first.create)).allowlist
    assert push is not None
    assert push.instance_ids == (
        "demo-p2p-0~4683d6be7c28",
        "demo-p2p-1~4683d6be7c28",
        "demo-pd-decode-0~4683d6be7c28",
        "demo-pd-prefill-0~4683d6be7c28",
    )
    assert (push.target.service, push.target.port, push.target.token) == (
        "demo-controller",
        9000,
        "fresh-token",
    )


def test_a_deleted_members_deregistration_carries_the_token() -> None:
    pool, p2p, _ = demo_docs()
    children = planned().create
    target = deregistration(pool, p2p, children)
    assert target is not None and target.target.token == "fresh-token"
    assert target.instance_ids == ["demo-p2p-0~4683d6be7c28", "demo-p2p-1~4683d6be7c28"]
    assert deregistration(pool, p2p, []).target.token is None  # type: ignore[union-attr]


class Recorder:
    """A client that records every write in order."""

    def __init__(self, children: list[Obj]) -> None:
        self.children = children
        self.log: list[str] = []

    async def list(self, kind: str, namespace: str, labels: Any = None) -> list[Obj]:
        return [c for c in self.children if c["kind"] == kind]

    async def create(self, obj: Obj) -> Obj:
        self.log.append(f"create {obj['kind']}/{obj['metadata']['name']}")
        return obj

    async def patch(self, kind: str, namespace: str, name: str, *a: Any, **kw: Any) -> Obj:
        self.log.append(f"patch {kind}/{name}")
        return {}

    async def delete(self, kind: str, namespace: str, name: str) -> None:
        self.log.append(f"delete {kind}/{name}")

    async def event(self, *args: Any) -> None:
        pass


class FakeController:
    """The controller's allowlist route: records what it was told, or fails."""

    def __init__(self, client: Recorder, answer: str | None = None) -> None:
        self.client = client
        self.answer = answer
        self.allowed: list[tuple[str, ...]] = []

    async def allow(self, namespace: str, push: AllowlistPush) -> str | None:
        self.client.log.append("push allowlist")
        if self.answer is None:
            self.allowed.append(push.instance_ids)
        return self.answer


def scaled_up(docs: list[Obj]) -> list[Obj]:
    out = copy.deepcopy(docs)
    out[1]["spec"]["replicas"] = 3
    out[1]["metadata"]["generation"] = 2
    return out


def reconciler(client: Recorder, docs: list[Obj], controller: FakeController) -> Any:
    rec = reconcile.Reconciler(
        client,  # type: ignore[arg-type]
        DocsSource(docs),
        lambda children, owner: None,
        Metrics(),
        settle=0.0,
    )
    rec.controller = controller  # type: ignore[assignment]
    return rec


async def test_a_scale_up_allows_the_new_instance_before_its_statefulset_exists() -> None:
    docs = demo_docs()
    client = Recorder(ready(planned(docs=docs).create))
    controller = FakeController(client)
    await reconciler(client, scaled_up(docs), controller).reconcile("default", "demo")
    assert "demo-p2p-2~4683d6be7c28" in controller.allowed[-1]
    log = client.log
    order = [
        log.index("patch ConfigMap/demo-controller"),  # the file a restarted controller reads
        log.index("push allowlist"),
        log.index("create StatefulSet/demo-p2p-2"),
    ]
    assert order == sorted(order), log


async def test_a_controller_that_did_not_take_the_ids_holds_the_new_pods_back() -> None:
    docs = demo_docs()
    client = Recorder(ready(planned(docs=docs).create))
    controller = FakeController(client, "PUT http://c/v1/instances: HTTP 401 ...")
    metrics = Metrics()
    rec = reconciler(client, scaled_up(docs), controller)
    rec.metrics = metrics
    pending = r"HTTP 401.*not created yet: demo-p2p-2"
    with pytest.raises(reconcile.AllowlistPendingError, match=pending):
        await rec.reconcile("default", "demo")
    assert "create StatefulSet/demo-p2p-2" not in client.log
    assert "create Service/demo-p2p-2" in client.log  # the rest is applied
    assert "patch ConfigMap/demo-controller" in client.log
    assert metrics.errors.labels("domain", "allowlist")._value.get() == 1
    # A failure that holds nothing back (no new pod) is no failed pass: the next one retries.
    quiet = Recorder(ready(planned(docs=docs).create))
    await reconciler(quiet, docs, FakeController(quiet, "refused")).reconcile("default", "demo")
    assert "push allowlist" in quiet.log
