"""The level-triggered domain reconcile: read, plan (pure), write — coalesced per domain.

Why per domain: a pool's objects depend on its members (the gateway's routing config) and
every member's objects depend on the pool (seed, fingerprint, controller address), so any
change anywhere in a domain is answered by one pass over the whole domain, in which every pod
template changes together. A pass starts SETTLE_S after the first request for it, and requests
that arrive meanwhile or while a pass runs are folded into one (more) pass, and the handler of
a CR that a pass has already read as it is now joins that pass (``Passes``, the one place that
decides who shares what), so a domain applied at once (a pool and its members) costs about one
pass, not one per resource.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvpool.operator.derive import names
from kvpool.operator.figures import Health
from kvpool.operator.runtime import kube
from kvpool.operator.runtime.controller_api import ControllerApi
from kvpool.operator.runtime.metrics import Metrics
from kvpool.operator.runtime.plan import Adopt, Observed, Plan, domain_selector, plan_domain, ref

Obj = dict[str, Any]
Key = tuple[str, str]  # (namespace, pool name)
log = logging.getLogger(__name__)
#: How long a requested pass waits for more requests of its domain before it starts. The
#: resources of one ``kubectl apply`` reach the operator within a few tens of milliseconds of
#: each other; without the wait the first starts a pass alone and the rest need a second one.
SETTLE_S = 0.2


class AllowlistPendingError(RuntimeError):
    """The controller has not allowed the domain's new instance ids: their pods were held back
    (kopf retries the pass; the drift timer does too)."""


def _access(obj: Obj) -> bool:
    """The controller's allowlist ConfigMap and token Secret: written before anything else."""
    labels = obj["metadata"].get("labels") or {}
    return obj["kind"] in ("ConfigMap", "Secret") and labels.get(names.LABEL_COMPONENT) == (
        "controller"
    )


#: Annotation prefixes of kopf's own bookkeeping (progress, last-handled configuration).
BOOKKEEPING = ("kvpool.io/", "kopf.zalando.org/")


def essence(body: Mapping[str, Any]) -> str:
    """What a pass reads of a CR besides the status it writes itself: identity, generation
    (the spec), labels (adopt copies them onto children), annotations but kopf's, deletion."""
    meta = body.get("metadata") or {}
    notes = {
        k: v for k, v in (meta.get("annotations") or {}).items() if not k.startswith(BOOKKEEPING)
    }
    parts = [meta.get("uid"), meta.get("generation"), meta.get("deletionTimestamp")]
    return json.dumps([*parts, meta.get("labels") or {}, notes], sort_keys=True, default=str)


def utcnow() -> str:
    """RFC 3339 UTC, seconds precision (metav1.Time)."""
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class DomainSource(Protocol):
    """Where the reconcile reads a domain's CRs from (kopf's in-memory indexes)."""

    def pool(self, namespace: str, name: str) -> Obj | None: ...

    def members(self, namespace: str, pool: str) -> list[Obj]: ...


def cr_key(body: Mapping[str, Any]) -> tuple[str, str]:
    """(kind, name): a CR within its domain."""
    return str(body.get("kind")), str((body.get("metadata") or {}).get("name"))


@dataclass
class Pass:
    """One reconcile pass of a domain: its outcome (what every caller sharing it gets) and the
    essence of each CR it read (empty until it has read them)."""

    outcome: asyncio.Future[Plan]
    read: dict[tuple[str, str], str] = field(default_factory=dict)

    def saw(self, bodies: Iterable[Mapping[str, Any]]) -> None:
        """Record the CRs the pass read (before it lists children: sharing starts there)."""
        self.read = {cr_key(b): essence(b) for b in bodies}

    def has_read(self, body: Mapping[str, Any]) -> bool:
        """Whether the pass read ``body`` as it is now (kopf's bookkeeping patches aside)."""
        uid = (body.get("metadata") or {}).get("uid")
        return bool(uid) and self.read.get(cr_key(body)) == essence(body)


class Passes:
    """The one way reconcile passes are shared: per domain, one pass runs at a time, and a
    caller joins a pass instead of starting one whenever that pass answers it.

    A caller shares the pass that waits to start (it will read the CRs as they are then). A
    caller that handles a CR also shares the latest pass that has read that CR as it is now,
    running or finished (not one that failed). Any other caller starts a pass: it waits
    ``settle`` seconds for more callers, then for the running pass of its domain to end.
    """

    def __init__(self, run: Callable[[Key, Pass], Awaitable[Plan]], settle: float = 0.0) -> None:
        self.run = run
        self.settle = settle
        self._locks: dict[Key, asyncio.Lock] = {}
        self._waiting: dict[Key, Pass] = {}
        self._latest: dict[Key, Pass] = {}

    def lock(self, key: Key) -> asyncio.Lock:
        """The lock a pass of ``key`` holds (for work that must not interleave with one)."""
        return self._locks.setdefault(key, asyncio.Lock())

    def forget(self, key: Key) -> None:
        """Share no pass of ``key`` that has read its CRs already (its children are pruned)."""
        self._latest.pop(key, None)

    async def __call__(
        self, key: Key, body: Mapping[str, Any] | None = None, *, settle: bool = True
    ) -> Plan:
        latest = self._latest.get(key)
        if body is not None and latest is not None and latest.has_read(body):
            with contextlib.suppress(Exception):  # that pass failed: join or start another
                return await asyncio.shield(latest.outcome)
        waiting = self._waiting.get(key)
        if waiting is not None:
            return await asyncio.shield(waiting.outcome)
        return await self._start(key, settle)

    async def _start(self, key: Key, settle: bool) -> Plan:
        outcome: asyncio.Future[Plan] = asyncio.get_running_loop().create_future()
        outcome.add_done_callback(lambda f: f.cancelled() or f.exception())
        this = self._waiting[key] = Pass(outcome)
        lock = self.lock(key)
        try:
            if settle and self.settle > 0:
                await asyncio.sleep(self.settle)
            await lock.acquire()
        except BaseException:
            if self._waiting.get(key) is this:
                del self._waiting[key]
            outcome.cancel()
            raise
        try:
            if self._waiting.get(key) is this:
                del self._waiting[key]
            self._latest[key] = this
            try:
                result = await self.run(key, this)
            except BaseException as exc:
                cancelled = RuntimeError("reconcile pass cancelled")
                outcome.set_exception(exc if isinstance(exc, Exception) else cancelled)
                raise
            outcome.set_result(result)
            return result
        finally:
            lock.release()


class Reconciler:
    """Reads a domain, plans it and applies the plan with the operator's client."""

    def __init__(
        self,
        client: kube.KubeClient,
        source: DomainSource,
        adopt: Adopt,
        metrics: Metrics,
        clock: Callable[[], str] = utcnow,
        settle: float = SETTLE_S,
    ) -> None:
        self.client = client
        self.source = source
        self.adopt = adopt
        self.metrics = metrics
        self.clock = clock
        #: Domains whose children were pruned for good: the uid of the pool being deleted.
        self.pruned: dict[Key, str] = {}
        #: FiguresCurrent of a domain, kept by the live-figures poller (read, never awaited).
        self.figures: Callable[[str, str], Health | None] = lambda _ns, _pool: None
        #: Tells a ready controller which instance ids may register (None: nobody does).
        self.controller: ControllerApi | None = None
        #: The operator's own namespace, a peer in the domains' NetworkPolicies.
        self.operator_namespace: str | None = None
        self._passes = Passes(self._reconcile, settle)

    async def reconcile(self, namespace: str, pool: str, *, settle: bool = True) -> Plan:
        """One (possibly shared) pass over the domain ``namespace/pool``; ``settle=False``
        starts it without waiting for more requests (the drift timer: nothing else comes)."""
        return await self._passes((namespace, pool), settle=settle)

    async def reconcile_resource(self, namespace: str, pool: str, body: Mapping[str, Any]) -> Plan:
        """A pass that has read the CR ``body`` as it is now: the domain's latest pass if it
        read the same essence of it (kopf's finalizer and bookkeeping patches aside), else a
        new one. A pool and members applied together are mostly all read by one pass, and
        their handlers share it."""
        return await self._passes((namespace, pool), body)

    def read(self, namespace: str, pool_name: str) -> tuple[Obj | None, list[Obj]]:
        """The domain's CRs as the indexes hold them now: the pool (None if absent, or being
        deleted with its children pruned) and its members."""
        pool = self.source.pool(namespace, pool_name)
        if pool is not None and self.pruned.get((namespace, pool_name)) == pool["metadata"].get(
            "uid"
        ):
            pool = None  # being deleted and its children pruned: nothing may come back
        return pool, self.source.members(namespace, pool_name)

    async def observe(
        self, namespace: str, pool_name: str, pool: Obj | None, members: list[Obj]
    ) -> Observed:
        """The domain's children and pods as the API server lists them, with the CRs read."""
        selector = domain_selector(pool_name)
        kinds = (*kube.CHILD_KINDS, "Pod") if pool is not None else ()
        lists = await asyncio.gather(*(self.client.list(k, namespace, selector) for k in kinds))
        children = [
            {**obj, "kind": kind}
            for kind, objs in zip(kinds[:-1], lists[:-1], strict=True)
            for obj in objs
        ]
        pods = lists[-1] if lists else []
        figures = self.figures(namespace, pool_name)
        return Observed(
            namespace,
            pool_name,
            pool,
            members,
            children,
            pods,
            figures,
            fresh_token=secrets.token_urlsafe(32),
            operator_namespace=self.operator_namespace,
        )

    async def _reconcile(self, key: Key, this: Pass) -> Plan:
        namespace, pool_name = key
        started = time.monotonic()
        try:
            pool, members = self.read(namespace, pool_name)
            # Recorded before the listing: a handler whose CR this pass has read as it is now
            # shares the pass, also while the pass waits for the API server's lists.
            this.saw([*([pool] if pool else []), *members])
            observed = await self.observe(namespace, pool_name, pool, members)
            plan = plan_domain(observed, self.clock(), self.adopt)
            held = await self.apply(plan, namespace)
            if held:
                raise AllowlistPendingError(
                    f"domain {namespace}/{pool_name}: {held}; StatefulSets not created yet: "
                    + ", ".join(sorted(o["metadata"]["name"] for o in plan.create if _held(o)))
                )
        except Exception:
            self.metrics.reconciled("domain", "error", time.monotonic() - started)
            self.metrics.failed("domain", "reconcile")
            raise
        result = "invalid" if plan.invalid else "ok"
        self.metrics.reconciled("domain", result, time.monotonic() - started)
        log.info(
            "reconciled domain %s/%s: %d created, %d patched, %d pruned, %d status(es)%s",
            namespace,
            pool_name,
            len(plan.create),
            len(plan.patch),
            len(plan.delete),
            len(plan.statuses),
            f"; invalid: {', '.join(sorted(plan.invalid))}" if plan.invalid else "",
            extra={"object": f"{namespace}/{pool_name}", "kind": "KVCachePool"},
        )
        return plan

    async def prune_all(self, namespace: str, pool_name: str, uid: str | None = None) -> None:
        """Delete every child of a domain (the pool ``uid`` is going; a real cluster's garbage
        collector would do the same through ownerReferences). Waits for a running pass, and
        later passes see no pool, so nothing is re-created behind the pruning."""
        key = (namespace, pool_name)
        if uid:
            self.pruned[key] = uid
        self._passes.forget(key)
        selector = domain_selector(pool_name)
        async with self._passes.lock(key):
            for kind in kube.CHILD_KINDS:
                for obj in await self.client.list(kind, namespace, selector):
                    await self.client.delete(kind, namespace, obj["metadata"]["name"])

    async def _create(self, obj: Obj) -> None:
        try:
            await self.client.create(obj)
        except kube.ApiError as exc:
            if exc.status != 409:
                raise
            meta = obj["metadata"]
            await self.client.patch(obj["kind"], meta["namespace"], meta["name"], obj)

    async def _status(self, body: Obj, status: Obj) -> None:
        meta = body["metadata"]
        try:
            await self.client.patch(
                body["kind"], meta["namespace"], meta["name"], {"status": status}, status=True
            )
        except kube.ApiError as exc:
            if exc.status != 404:  # deleted meanwhile: nothing to report on
                raise

    async def _allow(self, namespace: str, plan: Plan) -> str | None:
        """Make a ready controller allow the domain's instance ids. Returns why it did not when
        that holds back new worker pods (a failure that holds nothing back is logged, and the
        next pass tries again). A controller that is not ready, or not there yet, reads the
        allowlist from its mounted ConfigMap when it starts, written before this."""
        if plan.allowlist is None or self.controller is None:
            return None
        why = await self.controller.allow(namespace, plan.allowlist)
        if why is None:
            return None
        self.metrics.failed("domain", "allowlist")
        log.warning(
            "controller allowlist not updated: %s",
            why,
            extra={"object": f"{namespace}/{plan.allowlist.target.service}"},
        )
        return why if any(_held(o) for o in plan.create) else None

    async def apply(self, plan: Plan, namespace: str) -> str | None:
        """Children first, then statuses, then Events. Among the children, the controller's
        allowlist ConfigMap and token Secret come first, then the running controller is told the
        domain's instance ids, then the rest (creates, patches, prunes): a new instance is
        allowed before its pod can register. If the controller did not take them, new worker
        StatefulSets are held back; returns why (None: nothing held)."""
        now = self.clock()
        access: list[Awaitable[Any]] = [self._create(o) for o in plan.create if _access(o)]
        access += [self._patch(cur, p) for cur, p in plan.patch if _access(cur)]
        await asyncio.gather(*access)
        held = await self._allow(namespace, plan)
        writes: list[Awaitable[Any]] = [
            self._create(o)
            for o in plan.create
            if not _access(o) and not (held is not None and _held(o))
        ]
        writes += [self._patch(cur, p) for cur, p in plan.patch if not _access(cur)]
        writes += [
            self.client.delete(o["kind"], o["metadata"]["namespace"], o["metadata"]["name"])
            for o in plan.delete
        ]
        await asyncio.gather(*writes)
        await asyncio.gather(*(self._status(body, st) for body, st in plan.statuses))
        for body, etype, reason, message in plan.events:
            log.warning(
                "%s %s: %s",
                ref(body),
                reason,
                message.replace("\n", " | "),
                extra={"object": f"{body['metadata']['namespace']}/{body['metadata']['name']}"},
            )
            try:
                await self.client.event(body, etype, reason, message, now)
            except kube.ApiError as exc:  # an Event is best effort, never a failed reconcile
                log.warning("could not post Event %s on %s: %s", reason, ref(body), exc)
        return held

    def _patch(self, current: Obj, patch: Obj) -> Awaitable[Any]:
        meta = current["metadata"]
        return self.client.patch(current["kind"], meta["namespace"], meta["name"], patch)


def _held(obj: Obj) -> bool:
    """A new worker StatefulSet: its pod would register an id the controller may refuse."""
    return bool(obj["kind"] == "StatefulSet")
