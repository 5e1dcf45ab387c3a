"""An apiserver-like kmock KubernetesEmulator for running kopf (and kvpool's operator) against.

Why: no Kubernetes API server can run on these machines. kmock's stock emulator stores objects
as plain merged dicts; kopf relies on more (../shared/reference/kopf-on-kmock.md). This
subclass adds what the operator's correctness depends on:

- metadata stamping: uid, a monotonic resourceVersion, generation (bumped only when spec
  changes), creationTimestamp, generateName, the namespace taken from the URL;
- JSON patch (RFC 6902) with a failed ``test`` op answered 422, merge patch (RFC 7386: null
  deletes, lists replaced); a no-op patch keeps the resourceVersion;
- the status subresource isolated: ``/status`` changes only status, the main endpoint ignores
  status (also on create);
- finalizers: DELETE sets deletionTimestamp while finalizers remain; removing the last one
  deletes the object;
- LIST returns the current resourceVersion and WATCH resumes from it (no replay of stale
  objects), label selectors (``a=b``, ``a!=b``, ``a``, ``!a``) on both.

Not done here (tested elsewhere or only on a real cluster, e2e/tests/test_kind.py): garbage
collection through ownerReferences, schema validation/defaulting/CEL (the CRDs are checked with
kubernetes-validate and cel-python in tests/unit), admission webhooks (called directly in
tests/integration/test_webhook.py), RBAC (tests check the permissions module instead),
server-side apply, PUT, field selectors, watch bookmarks and 410 Gone.
"""

from __future__ import annotations

import asyncio
import bisect
import datetime
import json
import secrets
import socket
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import jsonpointer
import kmock
from kmock._internal import enums, parsing, references, rendering

_kmock_parse_path = parsing.parse_path


def _parse_path(path: str) -> parsing.ParsedPath:
    """kmock 0.8 reads /api/v1/namespaces[/NAME] as a namespace prefix (and fails on the bare
    list); the API server reads it as the cluster-scoped resource ``namespaces``."""
    parts = path.strip("/").split("/")
    if parts[:3] == ["api", "v1", "namespaces"] and len(parts) <= 4:
        name = parts[3] if len(parts) == 4 else None
        return parsing.ParsedPath("", "v1", "namespaces", None, name, None)
    return _kmock_parse_path(path)


parsing.parse_path = _parse_path

CRDS = {
    "kvpool.io/v1alpha1/kvcachepools": ("KVCachePool", "kvcachepool"),
    "kvpool.io/v1alpha1/p2pgroups": ("P2PGroup", "p2pgroup"),
    "kvpool.io/v1alpha1/pdpairs": ("PDPair", "pdpair"),
}
VERBS = {"list", "watch", "get", "create", "patch", "update", "delete"}


def _copy(obj: Any) -> Any:
    """A private copy of JSON data (a JSON round trip: several times cheaper than deepcopy)."""
    return json.loads(json.dumps(obj))


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return _copy(patch) if isinstance(patch, list) else patch  # scalars are immutable
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def label_filter(selector: str) -> Callable[[dict[str, str]], bool]:
    """The labels an equality-based label selector (as kubectl and kopf send it) matches,
    parsed once: a LIST checks it against every object of its resource."""
    equal: list[tuple[str, str]] = []
    unequal: list[tuple[str, str]] = []
    present: list[str] = []
    absent: list[str] = []
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            unequal.append((key, value))
        elif "=" in term:
            key, value = term.split("=", 1)
            equal.append((key.rstrip("="), value.lstrip("=")))
        elif term.startswith("!"):
            absent.append(term[1:])
        else:
            present.append(term)

    def matches(labels: dict[str, str]) -> bool:
        return (
            all(labels.get(k) == v for k, v in equal)
            and all(labels.get(k) != v for k, v in unequal)
            and all(k in labels for k in present)
            and not any(k in labels for k in absent)
        )

    return matches


#: How many connections the emulator's socket queues before the kernel drops SYNs: an API server
#: listens with somaxconn (4096 here), aiohttp's test server with 128. kopf opens a connection
#: per concurrent request (about 400 at once when 100 pools are applied, 530 open in all); past
#: the backlog, while the emulator's one loop is busy, each dropped SYN costs its client a
#: retransmission 1 s later, then 3, 7, 15 s of idle waiting (the bench at a backlog of 16:
#: ~200 dropped SYNs, its creates 1.5-2 s instead of 0.3 s).
LISTEN_BACKLOG = 4096


def widen_backlog(server: kmock.Server, backlog: int = LISTEN_BACKLOG) -> None:
    """Let the started ``server`` queue ``backlog`` connections, as an API server does."""
    for site in server.server.runner.sites:
        for sock in site._server.sockets:  # type: ignore[attr-defined]
            # asyncio's TransportSocket hides listen(); a dup of the fd is the same socket.
            with socket.fromfd(sock.fileno(), sock.family, sock.type) as dup:
                dup.listen(backlog)


def _error(status: int, reason: str, message: str) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=status, reason=reason, message=message, details={})


@attrs.define(kw_only=True)
class ApiServer(kmock.KubernetesEmulator):
    """The emulator with the apiserver behaviour listed in the module docstring."""

    _rv: int = attrs.field(default=0, init=False)
    _log: list[tuple[int, Any, dict[str, Any]]] = attrs.field(factory=list, init=False)
    _watchers: list[tuple[Any, str | None, asyncio.Queue[dict[str, Any]]]] = attrs.field(
        factory=list, init=False
    )
    #: The live objects per resource, (namespace, name) -> body (never mutated in place).
    _state: dict[Any, dict[tuple[str | None, str], dict[str, Any]]] = attrs.field(
        factory=dict, init=False
    )
    _logs: dict[Any, list[tuple[int, dict[str, Any]]]] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.resources.load_bundled()
        for key, (kind, singular) in CRDS.items():
            self.resources[key] = kmock.ResourceInfo(
                namespaced=True,
                kind=kind,
                singular=singular,
                verbs=VERBS,
                subresources={"status"},
            )

    # -- helpers ---------------------------------------------------------------------------
    def _has_status(self, resource: Any) -> bool:
        return resource in self.resources and "status" in self.resources[resource].subresources

    def _emit(self, resource: Any, etype: str, obj: dict[str, Any]) -> None:
        # ``obj`` is already a private version (built from a copy, never mutated after this):
        # the stored state, the event and the response share it, as an API server's cache does.
        event = {"type": etype, "object": obj}
        self._log.append((self._rv, resource, event))
        self._logs.setdefault(resource, []).append((self._rv, event))
        meta = obj["metadata"]
        live = self._state.setdefault(resource, {})
        if etype == "DELETED":
            live.pop((meta.get("namespace"), meta["name"]), None)
        else:
            live[(meta.get("namespace"), meta["name"])] = event["object"]
        namespace = obj.get("metadata", {}).get("namespace")
        for res, ns, queue in self._watchers:
            if res == resource and (ns is None or ns == namespace):
                queue.put_nowait(event)

    def _bump(self, obj: dict[str, Any]) -> None:
        self._rv += 1
        obj.setdefault("metadata", {})["resourceVersion"] = str(self._rv)

    def _current(self, request: rendering.Request) -> tuple[Any, dict[str, Any]]:
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            raise _error(404, "NotFound", f"{request.resource.plural} {request.name!r} not found")
        return key, _copy(self.objects[key].raw)

    # -- mutations -------------------------------------------------------------------------
    def _create(self, request: rendering.Request) -> tuple[int, dict[str, Any]]:
        obj = _copy(request.data) if isinstance(request.data, dict) else {}
        meta = obj.setdefault("metadata", {})
        namespace = request.namespace or meta.get("namespace")
        if namespace:
            meta["namespace"] = namespace
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + secrets.token_hex(3)
        if not meta.get("name"):
            raise _error(422, "Invalid", "metadata.name: Required value")
        key = (request.resource, namespace, meta["name"])
        if key in self.objects and not self.objects[key].deleted:
            raise _error(409, "AlreadyExists", f"{meta['name']!r} already exists")
        if self._has_status(request.resource):
            obj.pop("status", None)
        meta.update(uid=str(uuid.uuid4()), generation=1, creationTimestamp=_now())
        meta.pop("deletionTimestamp", None)
        self._bump(obj)
        if key in self.objects:
            self.objects[key].create(obj)
        else:
            self.objects[key] = obj
        self._emit(request.resource, "ADDED", obj)
        return 201, obj

    def _patched(self, request: rendering.Request, old: dict[str, Any]) -> dict[str, Any]:
        ctype = request.headers.get("Content-Type", "")
        to_status = request.subresource == "status"
        isolate = self._has_status(request.resource)
        if request.subresource not in (None, "status") or (to_status and not isolate):
            raise _error(404, "NotFound", f"no subresource {request.subresource!r}")
        if "json-patch" in ctype:
            ops = request.data if isinstance(request.data, list) else []
            if isolate:
                ops = [
                    op
                    for op in ops
                    if op.get("op") == "test"
                    or str(op.get("path", "")).startswith("/status") == to_status
                ]
            try:
                result: dict[str, Any] = jsonpatch.apply_patch(old, ops)
            except jsonpatch.JsonPatchTestFailed as exc:
                raise _error(422, "Invalid", f"the test operation failed: {exc}") from None
            except (jsonpatch.JsonPatchConflict, jsonpointer.JsonPointerException) as exc:
                raise _error(422, "Invalid", str(exc)) from None
            return result
        if "merge-patch" not in ctype:
            raise _error(415, "UnsupportedMediaType", f"patch type {ctype!r} is not served here")
        patch = request.data if isinstance(request.data, dict) else {}
        if isolate:
            patch = {"status": patch.get("status")} if to_status else dict(patch)
            if not to_status:
                patch.pop("status", None)
        merged: dict[str, Any] = merge_patch(old, patch)
        return merged

    def _update(self, request: rendering.Request) -> tuple[int, dict[str, Any]]:
        key, old = self._current(request)
        new = self._patched(request, old)
        meta, old_meta = new.setdefault("metadata", {}), old["metadata"]
        for immutable in ("uid", "name", "namespace", "creationTimestamp", "resourceVersion"):
            if immutable in old_meta:
                meta[immutable] = old_meta[immutable]
        if "deletionTimestamp" in old_meta:
            meta["deletionTimestamp"] = old_meta["deletionTimestamp"]
        if new.get("spec") != old.get("spec"):
            meta["generation"] = int(old_meta.get("generation", 1)) + 1
        if new == old:
            return 200, old
        self._bump(new)
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            self.objects[key].create(new)
            self.objects[key].delete()
            self._emit(request.resource, "DELETED", new)
            return 200, new
        self.objects[key].create(new)
        self._emit(request.resource, "MODIFIED", new)
        return 200, new

    def _delete(self, request: rendering.Request) -> tuple[int, dict[str, Any]]:
        key, obj = self._current(request)
        meta = obj["metadata"]
        if meta.get("deletionTimestamp"):
            return 200, obj
        if meta.get("finalizers"):
            meta["deletionTimestamp"] = _now()
            self._bump(obj)
            self.objects[key].create(obj)
            self._emit(request.resource, "MODIFIED", obj)
            return 200, obj
        self._bump(obj)
        self.objects[key].delete()
        self._emit(request.resource, "DELETED", obj)
        return 200, obj

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        mutations = {
            enums.action.CREATE: self._create,
            enums.action.UPDATE: self._update,
            enums.action.DELETE: self._delete,
        }
        if request.resource is not None and request.action in mutations:
            if request.action != enums.action.CREATE and request.name is None:
                raise _error(405, "MethodNotAllowed", "collection writes are not served")
            async with self._lock:
                status, body = mutations[request.action](request)
            return aiohttp.web.json_response(body, status=status)
        if request.method == enums.method.PUT:
            raise _error(405, "MethodNotAllowed", "PUT is not served by this emulator")
        if request.resource is not None and request.resource.plural is not None:
            # Reads are served here directly: kmock's reaction matching costs milliseconds per
            # request, which 300 CRs at once (the operator benchmark) turn into seconds.
            if request.action == enums.action.LIST:
                return aiohttp.web.json_response(await self._serve_list(request))
            if request.action == enums.action.FETCH:
                return aiohttp.web.json_response(await self._serve_fetch(request))
            if request.action == enums.action.WATCH:
                return await self._stream(request)
        return await super()._handle(request)

    async def _stream(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        assert request._raw_request is not None
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request._raw_request)  # type: ignore[arg-type]
        async for event in self._serve_watch(request):
            if isinstance(event, dict):
                await response.write(json.dumps(event).encode() + b"\n")
        return response

    # -- reads -----------------------------------------------------------------------------
    def _matching(self, request: rendering.Request) -> list[dict[str, Any]]:
        matches = label_filter(request.params.get("labelSelector", ""))
        found = [
            (key, obj)
            for key, obj in self._state.get(request.resource, {}).items()
            if request.namespace is None or key[0] == request.namespace
            if matches(obj["metadata"].get("labels") or {})
        ]
        return [obj for _key, obj in sorted(found, key=lambda kv: (str(kv[0][0]), kv[0][1]))]

    async def _serve_fetch(self, request: rendering.Request) -> rendering.Payload:
        obj = self._state.get(request.resource, {}).get((request.namespace, str(request.name)))
        if obj is None:
            raise _error(404, "NotFound", f"{request.resource.plural} {request.name!r} not found")
        return obj

    async def _serve_list(self, request: rendering.Request) -> rendering.Payload:
        if request.resource not in self.resources and request.resource not in self._state:
            raise kmock.KubernetesResourceNotFoundError()
        async with self._lock:
            items = self._matching(request)
            rv = str(self._rv)
        return {
            "apiVersion": "v1",
            "kind": "List",
            "metadata": {"resourceVersion": rv},
            "items": items,
        }

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[rendering.Payload]:
        yield b""
        matches = label_filter(request.params.get("labelSelector", ""))
        since = request.params.get("resourceVersion")
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        watcher = (request.resource, request.namespace, queue)
        async with self._lock:
            if since:
                log = self._logs.get(request.resource, [])
                start = bisect.bisect_right(log, int(since), key=lambda entry: entry[0])
                backlog = [
                    event
                    for _rv, event in log[start:]
                    if request.namespace in (None, event["object"]["metadata"].get("namespace"))
                ]
            else:
                backlog = [{"type": "ADDED", "object": obj} for obj in self._matching(request)]
            self._watchers.append(watcher)
        try:
            for event in backlog:
                queue.put_nowait(event)
            while True:
                if not queue.empty():  # no wait_for (a task per event) while events are queued
                    event = queue.get_nowait()
                else:
                    try:
                        event = await asyncio.wait_for(queue.get(), 0.2)
                    except TimeoutError:
                        if self._gone(request):
                            return  # the client hung up: end the stream (aiohttp would wait)
                        continue
                if matches(event["object"].get("metadata", {}).get("labels") or {}):
                    yield event
        finally:
            self._watchers.remove(watcher)

    @staticmethod
    def _gone(request: rendering.Request) -> bool:
        raw = request._raw_request
        transport = raw.transport if raw is not None else None
        return transport is None or transport.is_closing()

    # -- test conveniences -----------------------------------------------------------------
    def live(self, resource: str, namespace: str | None = None) -> list[dict[str, Any]]:
        """Every live object of ``resource`` (e.g. ``"apps/v1/statefulsets"``)."""
        live = self._state.get(references.resource(resource), {})
        return [o for (ns, _n), o in live.items() if namespace is None or ns == namespace]
