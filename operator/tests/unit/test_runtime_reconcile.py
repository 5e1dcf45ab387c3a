"""The domain reconcile's sharing: a CR's handler joins the pass that has read the CR as it is."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from op_builders import demo_docs

from kvpool.operator.runtime import reconcile
from kvpool.operator.runtime.metrics import Metrics

Obj = dict[str, Any]


class Source:
    def __init__(self, docs: list[Obj]) -> None:
        self.docs = docs

    def pool(self, namespace: str, name: str) -> Obj | None:
        return next((d for d in self.docs if d["kind"] == "KVCachePool"), None)

    def members(self, namespace: str, pool: str) -> list[Obj]:
        return [d for d in self.docs if d["kind"] != "KVCachePool"]


class SlowLists:
    """A client whose LISTs wait for ``release`` (an API server under a burst); writes succeed."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.lists = 0
        self.writes = 0

    async def list(self, kind: str, namespace: str, labels: Any = None) -> list[Obj]:
        self.lists += 1
        await self.release.wait()
        return []

    async def create(self, obj: Obj) -> Obj:
        self.writes += 1
        return obj

    async def patch(self, *args: Any, **kwargs: Any) -> Obj:
        self.writes += 1
        return {}

    async def event(self, *args: Any) -> None:
        self.writes += 1


async def test_a_handler_shares_a_pass_that_is_still_listing_and_has_read_its_cr() -> None:
    docs = demo_docs()
    client = SlowLists()
    rec = reconcile.Reconciler(
        client,  # type: ignore[arg-type]
        Source(docs),
        lambda children, owner: None,
        Metrics(),
        settle=0.0,
    )
    pool, member = docs[0], docs[1]
    first = asyncio.create_task(rec.reconcile_resource("default", "demo", pool))
    while client.lists == 0:  # the pass has read the CRs and waits for its lists
        await asyncio.sleep(0)
    lists = client.lists
    # kopf's finalizer and bookkeeping changed the member's body since: not its essence.
    seen = copy.deepcopy(member)
    seen["metadata"]["finalizers"] = ["kvpool.io/finalizer"]
    seen["metadata"]["annotations"] = {"kvpool.io/last-handled-configuration": "{}"}
    second = asyncio.create_task(rec.reconcile_resource("default", "demo", seen))
    await asyncio.sleep(0.01)
    client.release.set()
    assert await first is await second
    assert client.lists == lists  # one pass for both
    # A spec change is not what the pass read: the handler gets a pass of its own.
    changed = copy.deepcopy(member)
    changed["metadata"]["generation"] = 2
    docs[1] = changed
    await rec.reconcile_resource("default", "demo", changed)
    assert client.lists == 2 * lists
