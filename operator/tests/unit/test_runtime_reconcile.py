"""The domain reconcile's sharing (``reconcile.Passes``): callers before a pass starts share it,
a CR's handler joins the pass that has read the CR as it is, a failed pass is not shared."""

from __future__ import annotations

import asyncio
import contextlib
import copy
from typing import Any

import pytest
from op_builders import DocsSource, demo_docs

from kvpool.operator.runtime import reconcile
from kvpool.operator.runtime.metrics import Metrics

Obj = dict[str, Any]


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
        DocsSource(docs),
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


def _cr(name: str, generation: int = 1) -> Obj:
    return {
        "kind": "P2PGroup",
        "metadata": {"name": name, "uid": f"uid-{name}", "generation": generation},
    }


class Runs:
    """A pass body for ``reconcile.Passes``: records each run, reads ``crs``, waits for ``gate``."""

    def __init__(self, crs: list[Obj]) -> None:
        self.crs = crs
        self.runs = 0
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail = False

    async def __call__(self, key: reconcile.Key, this: reconcile.Pass) -> Any:
        self.runs += 1
        this.saw(self.crs)
        await self.gate.wait()
        if self.fail:
            raise RuntimeError("API down")
        return f"plan {self.runs}"


async def test_passes_callers_before_the_start_share_one_pass_later_ones_get_the_next() -> None:
    runs = Runs([_cr("a")])
    passes = reconcile.Passes(runs, settle=0.01)
    key = ("default", "demo")
    first = await asyncio.gather(*(passes(key) for _ in range(5)))
    assert runs.runs == 1 and set(first) == {"plan 1"}
    runs.gate.clear()
    running = asyncio.create_task(passes(key))
    while runs.runs < 2:
        await asyncio.sleep(0)
    after = [asyncio.create_task(passes(key)) for _ in range(3)]  # the pass has read: too late
    await asyncio.sleep(0.02)
    runs.gate.set()
    assert await running == "plan 2"
    assert {await t for t in after} == {"plan 3"} and runs.runs == 3


async def test_passes_a_cr_read_as_it_is_shares_the_latest_pass_a_changed_one_does_not() -> None:
    runs = Runs([_cr("a")])
    passes = reconcile.Passes(runs)
    key = ("default", "demo")
    assert await passes(key, _cr("a")) == "plan 1"
    assert await passes(key, _cr("a")) == "plan 1"  # finished, but it read this CR as it is
    assert await passes(key, _cr("a", generation=2)) == "plan 2"
    assert await passes(key, _cr("b")) == "plan 3"  # a CR it did not read
    assert await passes(key) == "plan 4"  # no CR: always a pass of its own
    passes.forget(key)
    assert await passes(key, _cr("a")) == "plan 5"
    assert runs.runs == 5


async def test_passes_a_failed_pass_is_not_shared_and_a_cancelled_wait_leaves_none_behind() -> None:
    runs = Runs([_cr("a")])
    passes = reconcile.Passes(runs, settle=10.0)
    key = ("default", "demo")
    runs.fail = True
    with pytest.raises(RuntimeError, match="API down"):
        await passes(key, _cr("a"), settle=False)
    runs.fail = False
    assert await passes(key, _cr("a"), settle=False) == "plan 2"  # its own, not the failure
    waiting = asyncio.create_task(passes(key))  # settles for 10 s
    await asyncio.sleep(0)
    waiting.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await waiting
    assert await passes(key, settle=False) == "plan 3" and runs.runs == 3
