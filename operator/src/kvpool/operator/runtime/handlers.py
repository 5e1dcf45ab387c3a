"""The kopf handlers: thin glue from kopf's events to the domain reconcile and admission review.

Why thin: every decision lives in pure code (plan.py, admission.py and the cores they call);
a handler only finds the domain a resource belongs to, runs one reconcile pass and turns the
outcome into kopf's vocabulary (PermanentError for an invalid spec, TemporaryError for a
blocked deletion, AdmissionError for a refused apply). Handlers are registered on a registry
passed in, so tests run several operators (a restart) in one process.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import aiohttp
import kopf

from kvpool.operator.api.common import GROUP, VERSION
from kvpool.operator.derive import names
from kvpool.operator.runtime import admission, kube, permissions, plan, reconcile
from kvpool.operator.runtime.metrics import Metrics
from kvpool.operator.runtime.settings import OperatorSettings

Obj = dict[str, Any]
log = logging.getLogger(__name__)
MEMBER_PLURALS = {"P2PGroup": "p2pgroups", "PDPair": "pdpairs"}
MANAGED_STS = {"app.kubernetes.io/managed-by": "kvpool-operator"}
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
        found = self._values("kvpool_pools", (namespace, name))
        return found[0] if found else None

    def pool_keys(self) -> list[tuple[str, str]]:
        return sorted(self.indexes.get("kvpool_pools", {}))

    def members(self, namespace: str, pool: str) -> list[Obj]:
        out = self._values("kvpool_p2pgroups", (namespace, pool))
        out += self._values("kvpool_pdpairs", (namespace, pool))
        return sorted(out, key=lambda m: (m["kind"], m["metadata"]["name"]))


@dataclass
class Runtime:
    """Everything the handlers share: settings, client, metrics, the reconciler."""

    settings: OperatorSettings
    client: kube.KubeClient
    metrics: Metrics
    source: IndexSource
    reconciler: reconcile.Reconciler
    ready: bool = False
    sts_ready: dict[tuple[str, str], bool] = field(default_factory=dict)
    drift: asyncio.Task[None] | None = None

    @classmethod
    def build(cls, settings: OperatorSettings) -> Runtime:
        client = kube.KubeClient(settings.field_manager)
        metrics = Metrics()
        source = IndexSource()
        reconciler = reconcile.Reconciler(client, source, _adopt, metrics)
        return cls(settings, client, metrics, source, reconciler)


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
    pool = rt.source.pool(ns, member["spec"]["poolRef"]["name"])
    if pool is None:
        return
    target = plan.deregistration(pool, member)
    if target is None:
        return
    url = rt.settings.controller_url.format(service=target.service, namespace=ns, port=target.port)
    timeout = aiohttp.ClientTimeout(total=rt.settings.controller_timeout)
    failed: list[str] = []
    # trust_env: an HTTP proxy in the pod's environment (a cluster's egress proxy, or the
    # service proxy of `kvpool-operator cluster`) is used, as Go clients do; NO_PROXY exempts.
    async with aiohttp.ClientSession(timeout=timeout, trust_env=True) as http:
        for iid in target.instance_ids:
            try:
                async with http.post(f"{url}/v1/deregister", json={"instance_id": iid}) as resp:
                    if resp.status >= 400:
                        failed.append(f"{iid}: HTTP {resp.status}")
            except (aiohttp.ClientError, TimeoutError) as exc:
                failed.append(f"{iid}: {exc.__class__.__name__} {exc}")
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
            except Exception:  # one failing domain must not stop the checks of the others
                log.exception("drift check of %s/%s failed", namespace, name)


def register(
    registry: kopf.OperatorRegistry,
    rt: Runtime,
    login: Callable[..., kopf.ConnectionInfo | None] | None = None,
) -> None:
    """Register every handler of the operator on ``registry`` (kopf passes keyword args)."""
    pools = (GROUP, VERSION, "kvcachepools")

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
        for name in ("kvpool_pools", "kvpool_p2pgroups", "kvpool_pdpairs"):
            rt.source.indexes[name] = kw[name]
        rt.drift = asyncio.create_task(drift_loop(rt), name="kvpool drift timer")
        rt.ready = True

    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_: Any) -> None:
        rt.ready = False
        if rt.drift is not None:
            rt.drift.cancel()
        await rt.client.close()

    @kopf.index(*pools, id="kvpool_pools", registry=registry)
    async def pool_index(**kw: Any) -> Any:
        return _index(kw["body"], (kw["namespace"], kw["name"]))

    async def member_index(**kw: Any) -> Any:
        pool = str(kw["spec"].get("poolRef", {}).get("name", ""))
        return _index(kw["body"], (kw["namespace"], pool))

    kopf.index(GROUP, VERSION, "p2pgroups", id="kvpool_p2pgroups", registry=registry)(member_index)
    kopf.index(GROUP, VERSION, "pdpairs", id="kvpool_pdpairs", registry=registry)(member_index)

    async def reconcile_pool(**kw: Any) -> None:
        result = await rt.reconciler.reconcile_resource(kw["namespace"], kw["name"], kw["body"])
        _raise_if_invalid(result, f"KVCachePool/{kw['name']}")

    for on in (kopf.on.create, kopf.on.update, kopf.on.resume):
        on(*pools, id="reconcile", backoff=RETRY_S, registry=registry)(reconcile_pool)

    @kopf.on.delete(*pools, id="finalize", registry=registry)
    async def delete_pool(**kw: Any) -> None:
        namespace, name, body = kw["namespace"], kw["name"], dict(kw["body"])
        members = [
            m
            for m in rt.source.members(namespace, name)
            if not m["metadata"].get("deletionTimestamp")
        ]
        if members:
            status, message = plan.deletion_blocked(body, members, reconcile.utcnow())
            await rt.client.patch("KVCachePool", namespace, name, {"status": status}, status=True)
            await rt.client.event(body, "Warning", "DeletionBlocked", message, reconcile.utcnow())
            raise kopf.TemporaryError(message, delay=rt.settings.delete_retry)
        await rt.reconciler.prune_all(namespace, name, body["metadata"].get("uid"))

    async def reconcile_member(**kw: Any) -> None:
        namespace, name = kw["namespace"], kw["name"]
        pool = str(kw["spec"].get("poolRef", {}).get("name", ""))
        old = kw.get("old") or {}
        previous = (old.get("spec") or {}).get("poolRef", {}).get("name")
        if previous and previous != pool:
            await rt.reconciler.reconcile(namespace, str(previous))
        result = await rt.reconciler.reconcile_resource(namespace, pool, kw["body"])
        _raise_if_invalid(result, f"{kw['body']['kind']}/{name}")

    async def delete_member(**kw: Any) -> None:
        member = copy.deepcopy(dict(kw["body"]))
        await _deregister(rt, member)
        await rt.reconciler.reconcile(kw["namespace"], str(member["spec"]["poolRef"]["name"]))

    for plural in MEMBER_PLURALS.values():
        for on in (kopf.on.create, kopf.on.update, kopf.on.resume):
            on(GROUP, VERSION, plural, id="reconcile", backoff=RETRY_S, registry=registry)(
                reconcile_member
            )
        kopf.on.delete(GROUP, VERSION, plural, id="finalize", registry=registry)(delete_member)

    @kopf.on.event("apps", "v1", "statefulsets", labels=MANAGED_STS, registry=registry)
    async def workload_event(**kw: Any) -> None:
        status, spec, labels = kw["status"], kw["spec"], kw["labels"]
        ready = int(status.get("readyReplicas") or 0) >= int(spec.get("replicas", 1))
        key = (kw["namespace"], kw["name"])
        if rt.sts_ready.get(key, False) != ready and labels.get(names.LABEL_POOL):
            rt.sts_ready[key] = ready
            await rt.reconciler.reconcile(kw["namespace"], labels[names.LABEL_POOL])

    async def validate(**kw: Any) -> None:
        operation = str(kw.get("operation") or "CREATE")
        obj = copy.deepcopy(dict(kw["body"]))
        ns = obj["metadata"].get("namespace") or kw.get("namespace") or "default"
        obj["metadata"]["namespace"] = ns
        kind = str(obj.get("kind"))
        if kind == "KVCachePool":
            pool_name = obj["metadata"]["name"]
        else:
            pool_name = str((obj.get("spec") or {}).get("poolRef", {}).get("name", ""))
        pool, members = rt.source.pool(ns, pool_name), rt.source.members(ns, pool_name)
        old = kw.get("old")
        prev = copy.deepcopy(dict(old)) if old else (obj if operation == "DELETE" else None)
        new = None if operation == "DELETE" else obj
        verdict = admission.review(operation, new, prev, pool, members)
        kw["warnings"].extend(verdict.warnings)
        rt.metrics.admissions.labels(kind, "allowed" if verdict.allowed else "refused").inc()
        if not verdict.allowed:
            raise kopf.AdmissionError(verdict.message(), code=422)

    operations = {
        kind: [cast(Literal["CREATE", "UPDATE", "DELETE"], op) for op in ops]
        for kind, ops in permissions.WEBHOOK_OPERATIONS.items()
    }
    if rt.settings.webhook_mode == "none":
        return
    for kind, path in {"KVCachePool": "kvcachepools", **MEMBER_PLURALS}.items():
        hook = permissions.WEBHOOK_PATHS[kind].lstrip("/")
        kopf.on.validate(
            GROUP, VERSION, path, id=hook, operations=operations[kind], registry=registry
        )(validate)
