"""The API server's writes: create, update (PUT and the four PATCH types), the scale
subresource and delete, each through schema checks and admission before the store.

Why a module of its own: the write path is the API server's longest and the one real clients
depend on most (kubectl apply and scale, Helm's server-side apply, kopf's JSON patches, the
kubelet's status writes go through the store directly). It follows the API server's order: the
patch applied to the stored object, the status or spec isolated by subresource, the custom
resource pruned, defaulted and validated by its CRD (422 with causes), the validating webhooks
(``admission.py``), then the store; ``dryRun=All`` stops before the store. The mixin is part
of ``apiserver.ApiServer``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import kmock
import yaml
from kmock._internal import rendering

from kvpool.operator.cluster import patches, structural, tables
from kvpool.operator.cluster.registry import Kind, Registry
from kvpool.operator.cluster.store import Obj, Res, Store, StoreError, copy_json, now_stamp

CRD_RES = Res("apiextensions.k8s.io", "v1", "customresourcedefinitions")
NAMESPACES = Res("", "v1", "namespaces")
#: How often a write is applied again when the object changed during its admission review.
UPDATE_ATTEMPTS = 5


def method_of(request: rendering.Request) -> str:
    """The HTTP method's name (kmock keeps it as an enum)."""
    method = request.method
    return str(getattr(method, "value", method)).upper()


def error(status: int, reason: str, message: str, **details: Any) -> kmock.KubernetesError:
    return kmock.KubernetesError(
        status=status, reason=reason, message=message, details=details or {"causes": []}
    )


class Admission(Protocol):
    """Validating admission (``admission.Webhooks``): raises a KubernetesError to refuse, else
    returns the warnings to pass on to the client."""

    async def review(
        self,
        operation: str,
        kind: Kind,
        obj: Obj | None,
        old: Obj | None,
        request: Any,
        subresource: str | None,
        dry_run: bool,
    ) -> list[str]: ...


class Writes:
    """Create, update, scale and delete (a mixin of ``ApiServer``, which provides these)."""

    store: Store
    registry: Registry
    admission: Admission | None
    users: dict[str, dict[str, Any]]
    _warnings: dict[int, list[str]]

    def _isolate_status(self) -> None:
        raise NotImplementedError

    # -- writes ----------------------------------------------------------------------------------
    def _body(self, request: rendering.Request) -> Any:
        ctype = request.headers.get("Content-Type", "")
        if "yaml" in ctype:
            return yaml.safe_load(request.text or "null")
        return request.data

    def _checked(self, kind: Kind, obj: Obj, old: Obj | None, status: bool = False) -> Obj:
        """A custom resource pruned, defaulted and validated by its CRD's schema (422)."""
        schema = kind.schema
        if schema is None:
            return obj
        out, errors = structural.admit(obj, schema, old)
        if errors:
            name = obj.get("metadata", {}).get("name", "")
            raise error(
                422,
                "Invalid",
                structural.invalid_message(kind.qualified(), name, errors),
                name=name,
                group=kind.res[0],
                kind=kind.kind,
                causes=[
                    {
                        "reason": "FieldValueInvalid",
                        "field": e.split(": ", 1)[0],
                        "message": e.split(": ", 1)[-1],
                    }
                    for e in errors
                ],
            )
        return out

    async def _review(
        self,
        request: rendering.Request,
        operation: str,
        kind: Kind,
        obj: Obj | None,
        old: Obj | None,
        sub: str | None = None,
    ) -> None:
        if self.admission is None:
            return
        warnings = await self.admission.review(
            operation,
            kind,
            obj,
            old,
            self._user(request),
            sub,
            request.params.get("dryRun") == "All",
        )
        self._warnings.setdefault(id(request), []).extend(warnings)

    def _user(self, request: rendering.Request) -> dict[str, Any]:
        auth = request.headers.get("Authorization", "")
        token = auth.split(" ", 1)[1] if auth.lower().startswith("bearer ") else ""
        return self.users.get(
            token, {"username": "system:anonymous", "groups": ["system:unauthenticated"]}
        )

    async def _create(self, request: rendering.Request, kind: Kind, ns: str | None) -> Obj:
        body = self._body(request)
        if not isinstance(body, dict):
            raise error(400, "BadRequest", "the body of a create must be an object")
        body.setdefault("apiVersion", kind.api_version)
        body.setdefault("kind", kind.kind)
        given = (body.get("metadata") or {}).get("namespace")
        if ns and given and given != ns:
            raise error(
                400,
                "BadRequest",
                "the namespace of the provided object does not match "
                "the namespace sent on the request",
            )
        if kind.namespaced and not ns:
            ns = given or "default"
        if ns and kind.res != NAMESPACES and self.store.find(NAMESPACES, None, ns) is None:
            raise error(404, "NotFound", f'namespaces "{ns}" not found')
        dry = request.params.get("dryRun") == "All"
        obj = self._checked(kind, self.store.create(kind.res, ns, body, commit=False), None)
        await self._review(request, "CREATE", kind, obj, None)
        if dry:
            return obj
        obj = self.store.create(kind.res, ns, obj)
        return self._after_create(kind, obj)

    def _after_create(self, kind: Kind, obj: Obj) -> Obj:
        if kind.res == CRD_RES:
            self.registry.declare(obj)
            self._isolate_status()
            new = {**obj, "status": Registry.established(obj, now_stamp())}
            return self.store.replace(CRD_RES, obj, new, status=True)
        if kind.res == NAMESPACES:
            new = {**obj, "status": {"phase": "Active"}}
            return self.store.replace(NAMESPACES, obj, new, status=True)
        return obj

    def _patched(self, request: rendering.Request, kind: Kind, old: Obj) -> Obj:
        ctype = request.headers.get("Content-Type", "")
        body = self._body(request)
        if method_of(request) == "PUT":
            if not isinstance(body, dict):
                raise error(400, "BadRequest", "the body of a replace must be an object")
            return body
        if "json-patch" in ctype:
            out: Obj = patches.json_patch(old, body)
            return out
        if "merge-patch" in ctype:
            return dict(patches.merge_patch(old, body))
        schema, resolve = self.registry.patch_schema(kind)
        if "strategic-merge-patch" in ctype:
            if kind.crd is not None or kind.schema is not None:
                raise error(
                    415,
                    "UnsupportedMediaType",
                    "strategic merge patch is not supported for custom resources",
                )
            return dict(patches.strategic_merge(old, body, schema, resolve))
        if "apply-patch" in ctype:
            return dict(patches.apply(old, body, schema, resolve))
        raise error(415, "UnsupportedMediaType", f"the media type {ctype!r} is not supported")

    async def _write(
        self, request: rendering.Request, kind: Kind, ns: str | None, name: str, sub: str | None
    ) -> Obj:
        old = self.store.find(kind.res, ns, name)
        apply = "apply-patch" in request.headers.get("Content-Type", "")
        if old is None and (apply or method_of(request) == "PUT") and sub is None:
            body = self._body(request)
            if isinstance(body, dict):
                body.setdefault("metadata", {})["name"] = name
                created = await self._create_from(request, kind, ns, body)
                created["__created__"] = True
                return created
        if old is None:
            raise StoreError(404, "NotFound", f'{kind.res[2]} "{name}" not found')
        if sub == "scale":
            return await self._write_scale(request, kind, old)
        return await self._guaranteed_update(
            request, kind, old, sub, lambda latest: self._patched(request, kind, latest)
        )

    async def _guaranteed_update(
        self,
        request: rendering.Request,
        kind: Kind,
        old: Obj,
        sub: str | None,
        build: Callable[[Obj], Obj],
    ) -> Obj:
        """``build(old)`` admitted and stored, as the API server's guaranteed update does: when
        the object was written meanwhile (during the admission review's ``await``), ``build``
        runs again on the latest version, at most ``UPDATE_ATTEMPTS`` times, then 409. Storing
        the candidate built on the version before lost that write (a delete's
        deletionTimestamp, under load)."""
        status = sub == "status"
        ns, name = old["metadata"].get("namespace"), _name(old)
        for _ in range(UPDATE_ATTEMPTS):
            candidate = self.store.replace(kind.res, old, build(old), status=status, commit=False)
            candidate = self._checked(kind, candidate, old, status)
            await self._review(request, "UPDATE", kind, candidate, old, sub)
            if request.params.get("dryRun") == "All":
                return candidate
            current = self.store.find(kind.res, ns, name)
            if current is None:
                raise StoreError(404, "NotFound", f'{kind.res[2]} "{name}" not found')
            if _version(current) == _version(old):
                return self.store.replace(kind.res, old, candidate, status=status)
            old = current
        raise StoreError(
            409, "Conflict", f'{kind.res[2]} "{name}": changed by others on every attempt'
        )

    async def _create_from(
        self, request: rendering.Request, kind: Kind, ns: str | None, body: Obj
    ) -> Obj:
        body.setdefault("apiVersion", kind.api_version)
        body.setdefault("kind", kind.kind)
        obj = self._checked(kind, self.store.create(kind.res, ns, body, commit=False), None)
        await self._review(request, "CREATE", kind, obj, None)
        if request.params.get("dryRun") == "All":
            return obj
        return self._after_create(kind, self.store.create(kind.res, ns, obj))

    # -- scale -------------------------------------------------------------------------------------
    def _scale(self, kind: Kind, obj: Obj) -> Obj:
        scale = kind.scale
        if scale is None:
            raise error(404, "NotFound", f"{kind.res[2]} has no scale subresource")
        status_path = scale.get("statusReplicasPath", ".status.replicas")
        selector = (
            tables.jsonpath(obj, scale["labelSelectorPath"])
            if scale.get("labelSelectorPath")
            else None
        )
        meta = obj["metadata"]
        out: Obj = {
            "kind": "Scale",
            "apiVersion": "autoscaling/v1",
            "metadata": {
                k: meta[k]
                for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                if k in meta
            },
            "spec": {"replicas": int(tables.jsonpath(obj, scale["specReplicasPath"]) or 0)},
            "status": {"replicas": int(tables.jsonpath(obj, status_path) or 0)},
        }
        if selector:
            out["status"]["selector"] = str(selector)
        return out

    async def _write_scale(self, request: rendering.Request, kind: Kind, old: Obj) -> Obj:
        body = self._body(request)
        ctype = request.headers.get("Content-Type", "")

        def scaled(latest: Obj) -> Obj:
            current = self._scale(kind, latest)  # 404 for a kind without a scale subresource
            path = str(kind.scale["specReplicasPath"])  # type: ignore[index]
            if method_of(request) == "PUT":
                wanted = body
            elif "json-patch" in ctype:
                wanted = patches.json_patch(current, body)
            else:
                wanted = patches.merge_patch(current, body)
            new = copy_json(latest)
            node = new
            *parents, leaf = path.strip(".").split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = int((wanted.get("spec") or {}).get("replicas", 0))
            return new

        return self._scale(kind, await self._guaranteed_update(request, kind, old, "scale", scaled))

    # -- delete ----------------------------------------------------------------------------------
    async def _delete(
        self, request: rendering.Request, kind: Kind, ns: str | None, name: str
    ) -> Obj:
        options = request.data if isinstance(request.data, dict) else {}
        params = request.params
        propagation = params.get("propagationPolicy") or options.get("propagationPolicy")
        if options.get("orphanDependents") is True:
            propagation = "Orphan"
        grace = params.get("gracePeriodSeconds", options.get("gracePeriodSeconds"))
        old = self.store.get(kind.res, ns, name)
        await self._review(request, "DELETE", kind, None, old)
        if params.get("dryRun") == "All" or "All" in (options.get("dryRun") or []):
            return old
        if kind.res == CRD_RES:
            for res in self.registry.forget(old):
                for obj in self.store.list(res):
                    self.store.delete(
                        res, obj["metadata"].get("namespace"), obj["metadata"]["name"]
                    )
            self._isolate_status()
        if kind.res == NAMESPACES:
            self._empty_namespace(name)
        uid = (options.get("preconditions") or {}).get("uid")
        return self.store.delete(
            kind.res,
            ns,
            name,
            propagation=str(propagation or "Background"),
            grace=None if grace is None else int(grace),
            precondition_uid=uid,
        )

    def _empty_namespace(self, namespace: str) -> None:
        for kind in self.registry.served():
            if kind.namespaced:
                for obj in self.store.list(kind.res, namespace):
                    self.store.delete(kind.res, namespace, obj["metadata"]["name"], grace=0)


def _version(obj: Obj) -> str | None:
    version: str | None = obj["metadata"].get("resourceVersion")
    return version


def _name(obj: Obj) -> str:
    return str(obj["metadata"]["name"])
