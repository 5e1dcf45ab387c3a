"""The operator's resource handlers (``handlers.Handlers``) one at a time, on a Runtime of
fakes: which domains a member's handler reconciles, a pool deletion blocked by its members,
readiness changes that start a pass, the webhook's verdict, and the indexes' keys."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import kopf
import pytest
from op_builders import DocsSource, demo_docs

from kvpool.operator.runtime import handlers, plan
from kvpool.operator.runtime.metrics import Metrics

Obj = dict[str, Any]


class Reconciler:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.pruned: list[tuple[str, str, str | None]] = []

    async def reconcile(self, namespace: str, pool: str, *, settle: bool = True) -> plan.Plan:
        self.calls.append((namespace, pool))
        return plan.Plan()

    async def reconcile_resource(self, namespace: str, pool: str, body: Any) -> plan.Plan:
        return await self.reconcile(namespace, pool)

    async def prune_all(self, namespace: str, pool: str, uid: str | None = None) -> None:
        self.pruned.append((namespace, pool, uid))


class Client:
    def __init__(self) -> None:
        self.patches: list[tuple[Any, ...]] = []
        self.events: list[str] = []

    async def patch(self, *args: Any, **kwargs: Any) -> Obj:
        self.patches.append(args)
        return {}

    async def event(self, body: Obj, etype: str, reason: str, *args: Any) -> None:
        self.events.append(reason)


def _handlers(docs: list[Obj]) -> tuple[handlers.Handlers, SimpleNamespace]:
    rt = SimpleNamespace(
        reconciler=Reconciler(),
        client=Client(),
        source=DocsSource(docs),
        metrics=Metrics(),
        settings=SimpleNamespace(delete_retry=7.0),
        sts_ready={},
    )
    return handlers.Handlers(rt), rt  # type: ignore[arg-type]


async def test_a_member_that_moves_to_another_pool_reconciles_both_domains() -> None:
    docs = demo_docs()
    h, rt = _handlers(docs)
    member = docs[1]
    old = copy.deepcopy(member)
    old["spec"]["poolRef"]["name"] = "before"
    await h.reconcile_member(namespace="default", name="x", body=member, old=old)
    assert rt.reconciler.calls == [("default", "before"), ("default", "demo")]
    rt.reconciler.calls.clear()
    await h.reconcile_member(namespace="default", name="x", body=member, old=None)
    assert rt.reconciler.calls == [("default", "demo")]


async def test_a_pool_with_live_members_is_not_deleted_and_says_why() -> None:
    docs = demo_docs()
    h, rt = _handlers(docs)
    pool = docs[0]
    with pytest.raises(kopf.TemporaryError) as refused:
        await h.delete_pool(namespace="default", name="demo", body=pool)
    assert refused.value.delay == 7.0
    assert rt.client.events == ["DeletionBlocked"] and rt.reconciler.pruned == []
    assert rt.client.patches[0][:3] == ("KVCachePool", "default", "demo")
    for member in docs[1:]:
        member["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    await h.delete_pool(namespace="default", name="demo", body=pool)
    assert rt.reconciler.pruned == [("default", "demo", "uid-0")]


async def test_only_a_readiness_change_of_a_pool_s_workload_starts_a_pass() -> None:
    h, rt = _handlers(demo_docs())
    event = {
        "namespace": "default",
        "name": "demo-p2p-0",
        "spec": {"replicas": 1},
        "labels": {"kvpool.io/pool": "demo"},
    }
    await h.workload_event(status={"readyReplicas": 0}, **event)  # not ready, as assumed
    await h.workload_event(status={"readyReplicas": 1}, **event)
    await h.workload_event(status={"readyReplicas": 1}, **event)
    await h.workload_event(status={"readyReplicas": 1}, **{**event, "labels": {}})
    assert rt.reconciler.calls == [("default", "demo")]


async def test_the_webhook_refuses_what_a_change_breaks_and_warns_about_a_missing_pool() -> None:
    docs = demo_docs()
    h, rt = _handlers(docs)
    bad = copy.deepcopy(docs[1])
    bad["spec"]["tensorParallelSize"] = 3
    warnings: list[str] = []
    with pytest.raises(kopf.AdmissionError):
        await h.validate(operation="CREATE", body=bad, old=None, warnings=warnings)
    await h.validate(operation="UPDATE", body=docs[1], old=docs[1], warnings=warnings)
    rt.source.docs = docs[1:]  # no pool yet: allowed, with a warning
    await h.validate(operation="CREATE", body=docs[1], warnings=warnings)
    assert len(warnings) == 1 and "does not exist" in warnings[0]
    refused = rt.metrics.admissions.labels("P2PGroup", "refused")._value.get()
    allowed = rt.metrics.admissions.labels("P2PGroup", "allowed")._value.get()
    assert (refused, allowed) == (1, 2)


async def test_the_indexes_key_a_pool_by_its_name_and_a_member_by_its_pool_ref() -> None:
    pool, member, *_ = demo_docs()
    assert list(await handlers.pool_index(body=pool, namespace="default", name="demo")) == [
        ("default", "demo")
    ]
    assert list(await handlers.member_index(body=member, namespace="default")) == [
        ("default", "demo")
    ]
    source = handlers.IndexSource()
    source.indexes = {
        handlers.INDEXES["KVCachePool"]: {("default", "demo"): [pool]},
        handlers.INDEXES[member["kind"]]: {("default", "demo"): [member]},
    }
    assert source.pool("default", "demo") is pool and source.members("default", "demo") == [member]
    assert source.pool_keys() == [("default", "demo")]
