"""The Kubernetes API a pod of ``kvpool-operator up`` reaches: Leases and its own pod's labels.

Why: the controller's replicas elect their leader on a ``coordination.k8s.io/v1`` Lease and
label their pods with their role, which the controller Service selects (controller/README.md,
"High availability"). Under ``up`` the same controller code runs against this stand-in, found
through the ``$KUBECONFIG`` every process gets (as a cluster gives every pod its service
account): the same paths, verbs and status codes as the API server for those two resources —
GET/POST/PUT of Leases with resourceVersions (409 Conflict on a stale update or a second
create), GET and merge PATCH of a pod (its labels) — and nothing else (404). No auth: it binds
127.0.0.1 and lives as long as ``up``. :class:`Store` is pure; :func:`app` serves it.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Mapping
from typing import Any

import aiohttp.web

Obj = dict[str, Any]
LEASES = "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"
PODS = "/api/v1/namespaces/{ns}/pods/{name}"


class ApiError(Exception):
    """An answer other than 2xx, as the API server's Status object."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message

    def status(self) -> Obj:
        return {
            "apiVersion": "v1",
            "kind": "Status",
            "status": "Failure",
            "code": self.code,
            "reason": self.reason,
            "message": self.message,
        }


class Store:
    """Leases and pods of the processes ``up`` runs (thread-safe: the proxies read labels)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rv = 0
        self.leases: dict[tuple[str, str], Obj] = {}
        self.pods: dict[tuple[str, str], Obj] = {}

    def _stamp(self, obj: Obj) -> Obj:
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        return copy.deepcopy(obj)

    def add_pod(self, namespace: str, name: str, labels: Mapping[str, str]) -> None:
        """A pod ``up`` starts a process for (kept across restarts of that process)."""
        with self._lock:
            if (namespace, name) not in self.pods:
                meta = {"name": name, "namespace": namespace, "labels": dict(labels)}
                self.pods[(namespace, name)] = self._stamp(
                    {"apiVersion": "v1", "kind": "Pod", "metadata": meta}
                )

    def labels(self, namespace: str, name: str) -> dict[str, str]:
        with self._lock:
            pod = self.pods.get((namespace, name))
            return dict(pod["metadata"].get("labels") or {}) if pod else {}

    def get_pod(self, namespace: str, name: str) -> Obj:
        with self._lock:
            pod = self.pods.get((namespace, name))
            if pod is None:
                raise ApiError(404, "NotFound", f'pods "{name}" not found')
            return copy.deepcopy(pod)

    def patch_pod(self, namespace: str, name: str, patch: Obj) -> Obj:
        """A JSON merge patch; only ``metadata.labels`` is honoured (a value null removes)."""
        labels = (patch.get("metadata") or {}).get("labels")
        if not isinstance(labels, dict):
            raise ApiError(422, "Invalid", "this stand-in patches metadata.labels only")
        with self._lock:
            pod = self.pods.get((namespace, name))
            if pod is None:
                raise ApiError(404, "NotFound", f'pods "{name}" not found')
            current = pod["metadata"].setdefault("labels", {})
            for key, value in labels.items():
                if value is None:
                    current.pop(key, None)
                else:
                    current[key] = str(value)
            return self._stamp(pod)

    def get_lease(self, namespace: str, name: str) -> Obj:
        with self._lock:
            lease = self.leases.get((namespace, name))
            if lease is None:
                raise ApiError(404, "NotFound", f'leases.coordination.k8s.io "{name}" not found')
            return copy.deepcopy(lease)

    def create_lease(self, namespace: str, body: Obj) -> Obj:
        name = str((body.get("metadata") or {}).get("name") or "")
        if not name:
            raise ApiError(422, "Invalid", "metadata.name: Required value")
        with self._lock:
            if (namespace, name) in self.leases:
                raise ApiError(
                    409, "AlreadyExists", f'leases.coordination.k8s.io "{name}" already exists'
                )
            obj = _lease(namespace, name, body)
            self.leases[(namespace, name)] = obj
            return self._stamp(obj)

    def replace_lease(self, namespace: str, name: str, body: Obj) -> Obj:
        expected = (body.get("metadata") or {}).get("resourceVersion")
        with self._lock:
            old = self.leases.get((namespace, name))
            if old is None:
                raise ApiError(404, "NotFound", f'leases.coordination.k8s.io "{name}" not found')
            if expected and expected != old["metadata"]["resourceVersion"]:
                raise ApiError(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on leases.coordination.k8s.io "{name}": the '
                    "object has been modified; please apply your changes to the latest version "
                    "and try again",
                )
            obj = _lease(namespace, name, body)
            self.leases[(namespace, name)] = obj
            return self._stamp(obj)


def _lease(namespace: str, name: str, body: Obj) -> Obj:
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": name, "namespace": namespace},
        "spec": dict(body.get("spec") or {}),
    }


def app(store: Store) -> aiohttp.web.Application:
    """The stand-in's HTTP routes over ``store``."""

    async def answer(request: aiohttp.web.Request) -> aiohttp.web.Response:
        ns, name = request.match_info["ns"], request.match_info.get("name")
        try:
            if request.method in ("POST", "PUT", "PATCH"):
                try:
                    body = json.loads(await request.read())
                except ValueError:
                    raise ApiError(400, "BadRequest", "the body is not JSON") from None
                if not isinstance(body, dict):
                    raise ApiError(400, "BadRequest", "the body is not an object")
            kind = request.match_info["kind"]
            code, obj = 200, None
            if kind == "pods" and name and request.method == "GET":
                obj = store.get_pod(ns, name)
            elif kind == "pods" and name and request.method == "PATCH":
                obj = store.patch_pod(ns, name, body)
            elif kind == "leases" and name and request.method == "GET":
                obj = store.get_lease(ns, name)
            elif kind == "leases" and name and request.method == "PUT":
                obj = store.replace_lease(ns, name, body)
            elif kind == "leases" and not name and request.method == "POST":
                code, obj = 201, store.create_lease(ns, body)
            else:
                raise ApiError(405, "MethodNotAllowed", f"{request.method} is not served here")
        except ApiError as exc:
            return aiohttp.web.json_response(exc.status(), status=exc.code)
        return aiohttp.web.json_response(obj, status=code)

    application = aiohttp.web.Application()
    for path in (
        "/apis/coordination.k8s.io/v1/namespaces/{ns}/{kind:leases}",
        "/apis/coordination.k8s.io/v1/namespaces/{ns}/{kind:leases}/{name}",
        "/api/v1/namespaces/{ns}/{kind:pods}/{name}",
    ):
        application.router.add_route("*", path, answer)
    return application


def kubeconfig(server: str, namespace: str) -> str:
    """The kubeconfig a process here reads (plain HTTP on 127.0.0.1, no credentials)."""
    return (
        "apiVersion: v1\nkind: Config\n"
        f"clusters:\n- name: kvpool-up\n  cluster:\n    server: {server}\n"
        "users:\n- name: pod\n  user: {}\n"
        f"contexts:\n- name: kvpool-up\n  context:\n    cluster: kvpool-up\n"
        f"    user: pod\n    namespace: {namespace}\n"
        "current-context: kvpool-up\n"
    )
