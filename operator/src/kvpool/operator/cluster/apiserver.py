"""An API server on kmock's Kubernetes emulator that the real kubectl, Helm and kopf use as is.

Why: no Kubernetes API server can run on these machines. kmock (the test server kopf's author
made for kopf) parses requests, renders errors as Status objects and serves discovery from its
bundled resource list; this subclass, grown from the operator tests' emulator, adds what the
real clients depend on:

- the store (``store.py``): uid, resourceVersion, generation, finalizers, garbage collection,
  graceful pod deletion, LIST -> WATCH continuity with bookmarks and 410 Gone;
- CRDs installed through the API (``registry.py``): discovery, OpenAPI v2 (protobuf) and v3,
  custom resources pruned, defaulted and validated by their structural schema and CEL rules;
- writes (``writes.py``): the status and scale subresources, PUT, the four PATCH types
  (``patches.py``), dry runs;
- label and field selectors (``selectors.py``), server-side Table output (``tables.py``);
- validating admission webhooks (``admission.py``) and the services proxy, when the cluster
  provides them (``kvpool-operator cluster``).

The operator's integration tests use it with ``declare_kvpool=True`` (the three kinds served
without a CRD, so nothing is validated before the operator sees it, as before).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import aiohttp.web
import attrs
import kmock
from kmock._internal import parsing, rendering

from kvpool.operator.cluster import patches, protobuf, rbac, selectors, tables
from kvpool.operator.cluster.admission import AdmissionError
from kvpool.operator.cluster.registry import SERVER_VERSION, Kind, Registry, res_of
from kvpool.operator.cluster.store import Obj, Res, Store, StoreError, events
from kvpool.operator.cluster.writes import NAMESPACES, Admission, Writes, error, method_of

_kmock_parse_path = parsing.parse_path


def _parse_path(path: str) -> parsing.ParsedPath:
    """kmock 0.8 reads /api/v1/namespaces[/NAME] as a namespace prefix (and fails on the bare
    list); the API server reads it as the cluster-scoped resource ``namespaces``."""
    parts = path.strip("/").split("/")
    if (
        parts[:3] == ["api", "v1", "namespaces"]
        and len(parts) <= 5
        and (len(parts) < 5 or parts[4] in ("status", "finalize"))
    ):
        name = parts[3] if len(parts) >= 4 else None
        sub = parts[4] if len(parts) == 5 else None
        return parsing.ParsedPath("", "v1", "namespaces", None, name, sub)
    return _kmock_parse_path(path)


parsing.parse_path = _parse_path

#: How many connections the server's socket queues: kopf opens ~400 at once for 100 pools.
LISTEN_BACKLOG = 4096
INITIAL_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")
PROTOBUF_V2 = "application/com.github.proto-openapi.spec.v2.v1.0+protobuf"


def widen_backlog(server: kmock.Server, backlog: int = LISTEN_BACKLOG) -> None:
    """Let the started ``server`` queue ``backlog`` connections, as an API server does."""
    runner = server.server.runner
    assert runner is not None
    for site in runner.sites:
        for sock in site._server.sockets:  # type: ignore[union-attr]
            with socket.fromfd(sock.fileno(), sock.family, sock.type) as dup:
                dup.listen(backlog)


#: (namespace, service, port name or number) -> (host, port) of a backend, or None.
ServiceResolver = Callable[[str, str, str], Awaitable[tuple[str, int] | None]]


@attrs.define(kw_only=True)
class ApiServer(Writes, kmock.KubernetesEmulator):
    """The API server described in the module docstring."""

    declare_kvpool: bool = True
    record: bool = True
    authorize: bool = False  # RBAC on every resource request (kvpool-operator cluster)
    admission: Admission | None = None
    resolve_service: ServiceResolver | None = None
    pod_log: Callable[[str, str], str | None] | None = None
    bookmark_every_s: float = 5.0
    #: bearer token -> userInfo (username, groups) passed to admission webhooks
    users: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    store: Store = attrs.field(factory=Store, init=False)
    registry: Registry = attrs.field(init=False)
    _warnings: dict[int, list[str]] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if self.record:
            self.store.journal = []
        self.resources.load_bundled()
        self.registry = Registry(self.resources)
        if self.declare_kvpool:
            from kvpool.operator import gen  # noqa: PLC0415 (the API models: only for tests)

            for args in gen.KINDS:
                self.registry.declare(gen.crd(*args), with_schema=False)
        self._isolate_status()
        for namespace in INITIAL_NAMESPACES:
            ns = self.store.create(
                NAMESPACES,
                None,
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
            )
            self.store.replace(NAMESPACES, ns, {**ns, "status": {"phase": "Active"}}, status=True)

    def _isolate_status(self) -> None:
        self.store.status_isolated = {
            res_of(r) for r in self.resources if "status" in self.resources[r].subresources
        }

    # -- entry -----------------------------------------------------------------------------------
    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        """Requests in Kubernetes protobuf (Helm's release Secrets) are read as the JSON they
        stand for before kmock parses them (kmock reads every body as text)."""
        if "vnd.kubernetes.protobuf" in raw_request.headers.get("Content-Type", ""):
            body = await raw_request.read()
            try:
                decoded = protobuf.decode_k8s(body)
            except ValueError as exc:
                return await self._render_error(error(415, "UnsupportedMediaType", str(exc)))
            raw_request._read_bytes = json.dumps(decoded).encode()
        return await super().__call__(raw_request)

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        if not self.record:  # a long-running cluster: keep no history of requests or errors
            self._requests.clear()
            if self._errors:
                self._errors[-1].clear()
        path = request.url.path
        if path.startswith("/openapi/"):
            return self._openapi(request)
        if path in ("/healthz", "/readyz", "/livez"):
            return aiohttp.web.Response(text="ok")
        discovery = self._discovery(request)
        if discovery is not None:
            return aiohttp.web.json_response(discovery)
        if request.resource is not None and request.resource.plural is not None:
            try:
                return await self._resource(request)
            except StoreError as exc:
                self._warnings.pop(id(request), None)
                raise error(exc.status, exc.reason, exc.message) from None
            except patches.PatchError as exc:
                raise error(422, "Invalid", str(exc)) from None
            except selectors.SelectorError as exc:
                raise error(400, "BadRequest", str(exc)) from None
            except AdmissionError as exc:
                self._warnings.pop(id(request), None)
                raise error(exc.status, exc.reason, exc.message) from None
        response: aiohttp.web.StreamResponse = await super()._handle(request)
        return response

    def _openapi(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        path = request.url.path.rstrip("/")
        if path == "/openapi/v2":
            if "protobuf" in request.headers.get("Accept", ""):
                return aiohttp.web.Response(
                    body=self.registry.v2(), headers={"Content-Type": PROTOBUF_V2}
                )
            from kvpool.operator.cluster import openapi  # noqa: PLC0415

            return aiohttp.web.json_response(openapi.v2_document(self.registry.definitions()))
        if path == "/openapi/v3":
            return aiohttp.web.json_response(self.registry.v3_index())
        doc = self.registry.v3_documents().get(path[len("/openapi/v3/") :])
        if doc is None:
            raise error(404, "NotFound", f"no OpenAPI v3 document at {path}")
        return aiohttp.web.json_response(doc)

    # -- discovery ---------------------------------------------------------------------------------
    def _discovery(self, request: rendering.Request) -> Any:
        """The discovery documents (None: not a discovery path)."""
        parts = request.url.path.strip("/").split("/")
        if method_of(request) != "GET":
            return None
        if parts == ["api"]:
            return {"kind": "APIVersions", "versions": ["v1"]}
        if parts == ["apis"]:
            return self.registry.api_group_list()
        if parts == ["version"]:
            return SERVER_VERSION
        if parts == [""]:
            paths = {
                "/api",
                "/api/v1",
                "/apis",
                "/openapi/v2",
                "/openapi/v3",
                "/version",
                "/healthz",
                "/readyz",
                "/livez",
            }
            for group, versions in self.registry.group_versions().items():
                paths |= {f"/apis/{group}"} | {f"/apis/{group}/{v}" for v in versions}
            return {"paths": sorted(paths)}
        if len(parts) == 2 and parts[0] == "apis":
            served = self.registry.group_versions().get(parts[1])
            if served is None:
                raise error(404, "NotFound", "the server could not find the requested resource")
            return Registry.api_group(parts[1], served)
        if (len(parts) == 3 and parts[0] == "apis") or (len(parts) == 2 and parts[0] == "api"):
            group, version = (parts[1], parts[2]) if parts[0] == "apis" else ("", parts[1])
            found = self.registry.api_resource_list(group, version)
            if found is None:
                raise error(404, "NotFound", "the server could not find the requested resource")
            return found
        return None

    # -- resources -------------------------------------------------------------------------------
    def _kind(self, request: rendering.Request) -> Kind:
        assert request.resource is not None
        res = res_of(request.resource)
        key = f"{res[0]}/{res[1]}/{res[2]}" if res[0] else f"{res[1]}/{res[2]}"
        if key not in self.resources:
            raise error(404, "NotFound", "the server could not find the requested resource")
        return self.registry.kind(res)

    async def _resource(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        kind = self._kind(request)
        method, name, sub = method_of(request), request.name, request.subresource
        ns = request.namespace if kind.namespaced else None
        if self.authorize:
            self._authorize(request, kind, method, ns)
        if sub is not None and sub.startswith("proxy") and kind.res == ("", "v1", "services"):
            return await self._proxy(request, ns or "default", str(name), sub)
        if sub == "log" and kind.res == ("", "v1", "pods") and method == "GET":
            text = self.pod_log(ns or "", str(name)) if self.pod_log is not None else None
            if text is None:
                raise error(404, "NotFound", f'no log for pod "{name}"')
            return aiohttp.web.Response(text=text)
        if sub not in (None, "status", "scale"):
            raise error(
                404, "NotFound", f"the server could not find the requested resource ({sub})"
            )
        if method == "GET" and request.params.get("watch") in ("true", "1"):
            return await self._watch(request, kind, ns)
        if method == "GET" and name is None:
            return self._json(request, kind, self._list(request, kind, ns), table_list=True)
        if method == "GET":
            obj = self.store.get(kind.res, ns, str(name))
            return self._json(request, kind, self._scale(kind, obj) if sub == "scale" else obj)
        if method == "POST" and name is None:
            return self._json(request, kind, await self._create(request, kind, ns), 201)
        if method in ("PUT", "PATCH") and name is not None:
            obj = await self._write(request, kind, ns, str(name), sub)
            return self._json(request, kind, obj, 201 if obj.pop("__created__", False) else 200)
        if method == "DELETE" and name is not None:
            return self._json(request, kind, await self._delete(request, kind, ns, str(name)))
        if method == "DELETE":
            match = selectors.label_matcher(request.params.get("labelSelector"))
            for obj in self.store.list(kind.res, ns):
                if match(obj["metadata"].get("labels") or {}):
                    await self._delete(request, kind, ns, obj["metadata"]["name"])
            return aiohttp.web.json_response(
                {"kind": "Status", "apiVersion": "v1", "status": "Success", "metadata": {}}
            )
        raise error(405, "MethodNotAllowed", f"{method} is not supported on this path")

    def _json(
        self,
        request: rendering.Request,
        kind: Kind,
        body: Any,
        status: int = 200,
        table_list: bool = False,
    ) -> aiohttp.web.StreamResponse:
        if tables.wants_table(request.headers.get("Accept", "")) and body.get("kind") != "Scale":
            items = body["items"] if table_list else [body]
            body = tables.table(
                self.registry.columns(kind),
                items,
                datetime.datetime.now(tz=datetime.UTC),
                request.params.get("includeObject", "Metadata"),
                str(self.store.rv),
            )
        warnings = self._warnings.pop(id(request), [])
        headers = {"Warning": ", ".join(f'299 - "{w}"' for w in warnings)} if warnings else None
        return aiohttp.web.json_response(body, status=status, headers=headers)

    def _list(self, request: rendering.Request, kind: Kind, ns: str | None) -> Obj:
        labels = selectors.label_matcher(request.params.get("labelSelector"))
        fields = selectors.field_matcher(request.params.get("fieldSelector"), kind.kind)
        items = [
            o
            for o in self.store.list(kind.res, ns)
            if labels(o["metadata"].get("labels") or {}) and fields(o)
        ]
        return {
            "apiVersion": kind.api_version,
            "kind": f"{kind.kind}List",
            "metadata": {"resourceVersion": str(self.store.rv)},
            "items": items,
        }

    def _authorize(
        self, request: rendering.Request, kind: Kind, method: str, ns: str | None
    ) -> None:
        """RBAC (``rbac.py``) with the Roles and bindings stored here: 401 for an unknown token,
        403 for a request no binding of the user grants."""
        auth = request.headers.get("Authorization", "")
        token = auth.split(" ", 1)[1] if auth.lower().startswith("bearer ") else ""
        if token and token not in self.users:
            raise error(401, "Unauthorized", "Unauthorized")
        user = self._user(request)
        watch = request.params.get("watch") in ("true", "1")
        sub = request.subresource
        asked = rbac.Request(
            str(user["username"]),
            tuple(user.get("groups") or ()),
            rbac.verb_of(method, request.name is not None, watch),
            kind.res.group,
            kind.res.plural + (f"/{sub.split('/', 1)[0]}" if sub else ""),
            ns,
            request.name,
        )
        rbac_res = ("rbac.authorization.k8s.io", "v1")
        if not rbac.allowed(
            asked,
            self.store.list(Res(*rbac_res, "roles")),
            self.store.list(Res(*rbac_res, "clusterroles")),
            self.store.list(Res(*rbac_res, "rolebindings")),
            self.store.list(Res(*rbac_res, "clusterrolebindings")),
        ):
            raise error(403, "Forbidden", rbac.forbidden_message(asked))

    # -- watch -----------------------------------------------------------------------------------
    async def _watch(
        self, request: rendering.Request, kind: Kind, ns: str | None
    ) -> aiohttp.web.StreamResponse:
        params = request.params
        labels = selectors.label_matcher(params.get("labelSelector"))
        fields = selectors.field_matcher(params.get("fieldSelector"), kind.kind)
        if request.name is not None:  # the legacy /watch/... form of one object
            fields = selectors.field_matcher(f"metadata.name={request.name}", kind.kind)
        since = params.get("resourceVersion", "")
        initial = params.get("sendInitialEvents") == "true"
        watcher = self.store.watch(kind.res, ns)
        try:
            if since and since != "0" and not initial:
                backlog: list[Obj] = self.store.since(kind.res, ns, int(since))
            else:
                backlog = [{"type": "ADDED", "object": o} for o in self.store.list(kind.res, ns)]
        except StoreError as exc:
            self.store.unwatch(watcher)
            backlog = [
                {
                    "type": "ERROR",
                    "object": {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "metadata": {},
                        "status": "Failure",
                        "message": exc.message,
                        "reason": exc.reason,
                        "code": exc.status,
                    },
                }
            ]
            watcher = None  # type: ignore[assignment]
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        assert request._raw_request is not None
        await response.prepare(request._raw_request)
        if watcher is None:
            await response.write(json.dumps(backlog[0]).encode() + b"\n")
            return response
        if initial:
            backlog.append({"type": "BOOKMARK", "object": self._mark(kind, initial_end=True)})

        def matches(obj: Obj) -> bool:
            if obj.get("kind") is None or obj.get("metadata", {}).get("name") is None:
                return True  # a bookmark
            return labels(obj["metadata"].get("labels") or {}) and fields(obj)

        timeout = params.get("timeoutSeconds")
        want_table = tables.wants_table(request.headers.get("Accept", ""))
        try:
            async for event in events(
                watcher,
                backlog,
                matches=matches,
                bookmark=(lambda: self._mark(kind))
                if params.get("allowWatchBookmarks") == "true"
                else None,
                bookmark_every_s=self.bookmark_every_s,
                timeout_s=float(timeout) if timeout else None,
                gone=lambda: self._gone(request),
            ):
                out = event
                if want_table and event["type"] != "BOOKMARK":
                    out = {
                        "type": event["type"],
                        "object": tables.table(
                            self.registry.columns(kind),
                            [event["object"]],
                            datetime.datetime.now(tz=datetime.UTC),
                            params.get("includeObject", "Metadata"),
                        ),
                    }
                await response.write(json.dumps(out).encode() + b"\n")
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self.store.unwatch(watcher)
        return response

    def _mark(self, kind: Kind, initial_end: bool = False) -> Obj:
        meta: Obj = {"resourceVersion": str(self.store.rv)}
        if initial_end:
            meta["annotations"] = {"k8s.io/initial-events-end": "true"}
        return {"kind": kind.kind, "apiVersion": kind.api_version, "metadata": meta}

    @staticmethod
    def _gone(request: rendering.Request) -> bool:
        raw = request._raw_request
        transport = raw.transport if raw is not None else None
        return transport is None or transport.is_closing()

    # -- services proxy ----------------------------------------------------------------------------
    async def _proxy(
        self, request: rendering.Request, ns: str, name: str, sub: str
    ) -> aiohttp.web.StreamResponse:
        service, _, port = name.partition(":")
        target = await self.resolve_service(ns, service, port) if self.resolve_service else None
        if target is None:
            raise error(503, "ServiceUnavailable", f'no endpoints available for service "{name}"')
        path = "/" + sub[len("proxy") :].lstrip("/")
        url = f"http://{target[0]}:{target[1]}{path}"
        headers = {
            k: v for k, v in request.headers.items() if k.lower() in ("content-type", "accept")
        }
        timeout = aiohttp.ClientTimeout(total=600)
        async with (
            aiohttp.ClientSession(timeout=timeout) as http,
            http.request(
                method_of(request),
                url,
                params=request.params,
                data=request.body or None,
                headers=headers,
            ) as resp,
        ):
            body = await resp.read()
            return aiohttp.web.Response(
                body=body,
                status=resp.status,
                headers={"Content-Type": resp.headers.get("Content-Type", "text/plain")},
            )

    # -- conveniences (tests, the cluster) -------------------------------------------------------
    @property
    def _log(self) -> list[tuple[int, Res, Obj]]:
        """Every event so far, (resourceVersion, resource, event), when ``record`` is on."""
        return self.store.journal if self.store.journal is not None else []

    def live(self, resource: str, namespace: str | None = None) -> list[Obj]:
        """Every live object of ``resource`` (e.g. ``"apps/v1/statefulsets"``)."""
        parts = resource.split("/")
        res = Res("", parts[0], parts[1]) if len(parts) == 2 else Res(parts[0], parts[1], parts[2])
        return self.store.list(res, namespace)
