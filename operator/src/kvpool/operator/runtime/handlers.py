"""The kopf handlers: thin glue from kopf's events to the domain reconcile and admission review.

Why thin: every decision lives in pure code (plan.py, admission.py and the cores they call);
a handler only finds the domain a resource belongs to, runs one reconcile pass and turns the
outcome into kopf's vocabulary (PermanentError for an invalid spec, TemporaryError for a
blocked deletion, AdmissionError for a refused apply). Handlers are registered on a registry
passed in, so tests run several operators (a restart) in one process.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import kopf

from kvpool.operator.api import kinds
from kvpool.operator.api.common import GROUP, VERSION
from kvpool.operator.derive import names
from kvpool.operator.runtime import admission, kube, permissions, plan, reconcile
from kvpool.operator.runtime.controller_api import ControllerApi
from kvpool.operator.runtime.figures import FiguresPoller
from kvpool.operator.runtime.metrics import Metrics
from kvpool.operator.runtime.settings import OperatorSettings

Obj = dict[str, Any]
log = logging.getLogger(__name__)
#: kopf's index of each kind: its bodies by domain (namespace, pool name), which the
#: reconcile and the webhook read.
INDEXES = {k.kind: f"kvpool_{k.plural}" for k in kinds.KINDS.values()}
#: Retry of a reconcile that failed on the API (not an invalid spec: that is permanent). The
#: pass is level-triggered and idempotent, so kopf's default of 60 s only delays recovery.
RETRY_S = 5.0


class IndexSource:
    """The reconcile's view of the CRs: kopf's indexes (filled from kopf's own watch streams)."""

    def __init__(self) -> None:
        self.indexes: dict[str, Any] = {}

    def _values(self, index: str, key: tuple[str, str]) -> list[Obj]:
        # The stored bodies are private copies (made once per watch event by _index) and the
        # pure planning never mutates its inputs, so reads share them instead of copying.
        store = self.indexes.get(index, {}).get(key)
        return list(store) if store else []

    def pool(self, namespace: str, name: str) -> Obj | None:
        found = self._values(INDEXES[kinds.POOL.kind], (namespace, name))
        return found[0] if found else None

    def pool_keys(self) -> list[tuple[str, str]]:
        return sorted(self.indexes.get(INDEXES[kinds.POOL.kind], {}))

    def members(self, namespace: str, pool: str) -> list[Obj]:
        out = [b for k in kinds.MEMBERS for b in self._values(INDEXES[k.kind], (namespace, pool))]
        return sorted(out, key=lambda m: (m["kind"], m["metadata"]["name"]))


@dataclass
class Runtime:
    """Everything the handlers share: settings, client, metrics, the reconciler."""

    settings: OperatorSettings
    client: kube.KubeClient
    metrics: Metrics
    source: IndexSource
    reconciler: reconcile.Reconciler
    figures: FiguresPoller
    ready: bool = False
    sts_ready: dict[tuple[str, str], bool] = field(default_factory=dict)
    drift: asyncio.Task[None] | None = None
    figures_task: asyncio.Task[None] | None = None

    @classmethod
    def build(cls, settings: OperatorSettings) -> Runtime:
        client = kube.KubeClient(settings.field_manager)
        metrics = Metrics()
        source = IndexSource()
        reconciler = reconcile.Reconciler(client, source, _adopt, metrics)
        reconciler.controller = ControllerApi(settings)
        reconciler.operator_namespace = settings.operator_namespace

        def request_pass(namespace: str, pool: str) -> Awaitable[plan.Plan]:
            return reconciler.reconcile(namespace, pool, settle=False)

        figures = FiguresPoller(settings, client, source, request_pass, metrics)
        reconciler.figures = figures.health
        return cls(settings, client, metrics, source, reconciler, figures)


def _adopt(children: list[Obj], owner: Obj) -> None:
    kopf.adopt(children, owner=kopf.Body(cast(kopf.RawBody, owner)))


def _raise_if_invalid(result: plan.Plan, resource: str) -> None:
    own = result.invalid.get(resource)
    if own:
        raise kopf.PermanentError(
            f"{len(own)} error(s): " + "; ".join(f"{p.path}: {p.message}" for p in own)
        )


def _index(body: kopf.Body, key: tuple[str, str]) -> dict[tuple[str, str], Obj]:
    return {key: plan.json_copy(dict(body))}


async def _deregister(rt: Runtime, member: Obj) -> None:
    """Tell the pool's controller that the member's instances are gone (before their pods)."""
    ns = member["metadata"]["namespace"]
    pool = rt.source.pool(ns, kinds.pool_ref(member))
    if pool is None:
        return
    # the domain's token Secret (the deregistration route needs it)
    secrets = await rt.client.list("Secret", ns, plan.domain_selector(kinds.pool_ref(member)))
    children = [{**obj, "kind": "Secret"} for obj in secrets]
    target = plan.deregistration(pool, member, children)
    if target is None:
        return
    api = ControllerApi(rt.settings)
    url = api.url(ns, target.target)
    failed = await api.deregister(ns, target)
    if failed:
        rt.metrics.failed(member["kind"], "deregister")
        message = (
            f"could not deregister {len(failed)} instance(s) from {url} ({'; '.join(failed)}); "
            "the controller purges them after its worker timeout"
        )
        log.warning(
            "%s: %s",
            plan.ref(member),
            message,
            extra={"object": f"{ns}/{member['metadata']['name']}"},
        )
        await rt.client.event(member, "Warning", "DeregisterFailed", message, reconcile.utcnow())


async def drift_loop(rt: Runtime) -> None:
    """The drift timer: every interval, one reconcile pass per known pool (which compares the
    running pods with the templates). One task for all pools, not a kopf timer per pool."""
    while True:
        await asyncio.sleep(rt.settings.drift_interval)
        for namespace, name in rt.source.pool_keys():
            try:
                await rt.reconciler.reconcile(namespace, name, settle=False)
            except reconcile.AllowlistPendingError:
                continue  # logged by the pass; the domain's own handler retries it
            except Exception:  # one failing domain must not stop the checks of the others
                log.exception("drift check of %s/%s failed", namespace, name)


async def pool_index(**kw: Any) -> Any:
    """kopf's index of pools: each pool's body under its own (namespace, name)."""
    return _index(kw["body"], (kw["namespace"], kw["name"]))


async def member_index(**kw: Any) -> Any:
    """kopf's index of members: each body under (namespace, the pool it names)."""
    return _index(kw["body"], (kw["namespace"], kinds.pool_ref(kw["body"])))


@dataclass
class Handlers:
    """The operator's resource handlers on one Runtime. kopf calls each method with keyword
    arguments; a test calls it alone, with a Runtime of fakes."""

    rt: Runtime

    async def reconcile_pool(self, **kw: Any) -> None:
        """A pool created, changed or resumed: a (shared) pass over its domain."""
        rt = self.rt
        result = await rt.reconciler.reconcile_resource(kw["namespace"], kw["name"], kw["body"])
        _raise_if_invalid(result, f"{kinds.POOL.kind}/{kw['name']}")

    async def delete_pool(self, **kw: Any) -> None:
        """A pool's finalizer: blocked (status, Event, retry) while live members remain, else
        every child of the domain is pruned."""
        rt = self.rt
        namespace, name, body = kw["namespace"], kw["name"], dict(kw["body"])
        members = [
            m
            for m in rt.source.members(namespace, name)
            if not m["metadata"].get("deletionTimestamp")
        ]
        if members:
            status, message = plan.deletion_blocked(body, members, reconcile.utcnow())
            await rt.client.patch(kinds.POOL.kind, namespace, name, {"status": status}, status=True)
            await rt.client.event(body, "Warning", "DeletionBlocked", message, reconcile.utcnow())
            raise kopf.TemporaryError(message, delay=rt.settings.delete_retry)
        await rt.reconciler.prune_all(namespace, name, body["metadata"].get("uid"))

    async def reconcile_member(self, **kw: Any) -> None:
        """A member created, changed or resumed: a pass over its domain (and over the domain
        it left, when its poolRef changed)."""
        rt = self.rt
        namespace, name = kw["namespace"], kw["name"]
        pool, previous = kinds.pool_ref(kw["body"]), kinds.pool_ref(kw.get("old"))
        if previous and previous != pool:
            await rt.reconciler.reconcile(namespace, previous)
        result = await rt.reconciler.reconcile_resource(namespace, pool, kw["body"])
        _raise_if_invalid(result, f"{kw['body']['kind']}/{name}")

    async def delete_member(self, **kw: Any) -> None:
        """A member's finalizer: deregister its instances, then a pass without it."""
        member = copy.deepcopy(dict(kw["body"]))
        await _deregister(self.rt, member)
        await self.rt.reconciler.reconcile(kw["namespace"], kinds.pool_ref(member))

    async def workload_event(self, **kw: Any) -> None:
        """A worker StatefulSet's readiness changed: a pass (the gateway routes to ready PD
        pairs only, status counts ready instances)."""
        rt = self.rt
        status, spec, labels = kw["status"], kw["spec"], kw["labels"]
        ready = int(status.get("readyReplicas") or 0) >= int(spec.get("replicas", 1))
        key = (kw["namespace"], kw["name"])
        if rt.sts_ready.get(key, False) != ready and labels.get(names.LABEL_POOL):
            rt.sts_ready[key] = ready
            with contextlib.suppress(reconcile.AllowlistPendingError):  # logged; retried elsewhere
                await rt.reconciler.reconcile(kw["namespace"], labels[names.LABEL_POOL])

    async def validate(self, **kw: Any) -> None:
        """The admission webhook: review the operation against the domain as indexed."""
        rt = self.rt
        operation = str(kw.get("operation") or "CREATE")
        obj = copy.deepcopy(dict(kw["body"]))
        ns = obj["metadata"].get("namespace") or kw.get("namespace") or "default"
        obj["metadata"]["namespace"] = ns
        kind = str(obj.get("kind"))
        pool_name = kinds.domain_of(obj)
        pool, members = rt.source.pool(ns, pool_name), rt.source.members(ns, pool_name)
        old = kw.get("old")
        prev = copy.deepcopy(dict(old)) if old else (obj if operation == "DELETE" else None)
        new = None if operation == "DELETE" else obj
        verdict = admission.review(operation, new, prev, pool, members)
        kw["warnings"].extend(verdict.warnings)
        rt.metrics.admissions.labels(kind, "allowed" if verdict.allowed else "refused").inc()
        if not verdict.allowed:
            raise kopf.AdmissionError(verdict.message(), code=422)


def _on_changes(
    registry: kopf.OperatorRegistry,
    kind: kinds.CustomKind,
    on_change: Callable[..., Awaitable[None]],
    on_delete: Callable[..., Awaitable[None]],
) -> None:
    """``on_change`` on create, update and resume (kopf's handler id "reconcile"),
    ``on_delete`` as the finalizer ("finalize"): the ids kopf keeps in each CR's annotations."""
    for on in (kopf.on.create, kopf.on.update, kopf.on.resume):
        on(GROUP, VERSION, kind.plural, id="reconcile", backoff=RETRY_S, registry=registry)(
            on_change
        )
    kopf.on.delete(GROUP, VERSION, kind.plural, id="finalize", registry=registry)(on_delete)


def register(
    registry: kopf.OperatorRegistry,
    rt: Runtime,
    login: Callable[..., kopf.ConnectionInfo | None] | None = None,
) -> None:
    """Register every handler of the operator on ``registry`` (kopf passes keyword args):
    login, startup and cleanup here, the indexes, the resource handlers (``Handlers``) on each
    kind, and the webhook unless ``webhook_mode`` is none."""

    @kopf.on.login(registry=registry)
    def login_handler(**kw: Any) -> kopf.ConnectionInfo | None:
        info = login(**kw) if login is not None else None
        if info is None:
            info = kopf.login_with_service_account(**kw) or kopf.login_with_kubeconfig(**kw)
        if info is not None:
            rt.client.login(info)
        return info

    @kopf.on.startup(registry=registry)
    async def startup(**kw: Any) -> None:
        for name in INDEXES.values():
            rt.source.indexes[name] = kw[name]
        rt.drift = asyncio.create_task(drift_loop(rt), name="kvpool drift timer")
        if rt.settings.figures_interval > 0:
            rt.figures_task = asyncio.create_task(rt.figures.run(), name="kvpool live figures")
        rt.ready = True

    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_: Any) -> None:
        rt.ready = False
        for task in (rt.drift, rt.figures_task):
            if task is not None:
                task.cancel()
        await rt.figures.close()
        await rt.client.close()

    for kind in kinds.KINDS.values():
        index = pool_index if kind == kinds.POOL else member_index
        kopf.index(GROUP, VERSION, kind.plural, id=INDEXES[kind.kind], registry=registry)(index)
    handlers = Handlers(rt)
    _on_changes(registry, kinds.POOL, handlers.reconcile_pool, handlers.delete_pool)
    for kind in kinds.MEMBERS:
        _on_changes(registry, kind, handlers.reconcile_member, handlers.delete_member)
    kopf.on.event("apps", "v1", "statefulsets", labels=names.MANAGED_BY, registry=registry)(
        handlers.workload_event
    )
    if rt.settings.webhook_mode == "none":
        return
    for kind in kinds.KINDS.values():
        hook = permissions.WEBHOOK_PATHS[kind.kind].lstrip("/")
        operations = [
            cast(Literal["CREATE", "UPDATE", "DELETE"], op)
            for op in permissions.WEBHOOK_OPERATIONS[kind.kind]
        ]
        kopf.on.validate(
            GROUP, VERSION, kind.plural, id=hook, operations=operations, registry=registry
        )(handlers.validate)
