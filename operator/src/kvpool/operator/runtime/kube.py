"""A thin async Kubernetes REST client for the handlers, on the credentials kopf logged in with.

Why not a generated client: the operator needs six verbs on eight kinds. kopf already holds an
aiohttp stack and the cluster credentials (``kopf.ConnectionInfo`` from the login handler);
reusing both keeps the operator small (its RSS target is 150 MB) and makes every request pass
``permissions.require`` first, so the chart's RBAC and the code cannot drift apart. Writes are
JSON merge patches carrying our field manager (they work identically on a real apiserver and
on the test emulator); status goes through the ``/status`` subresource only.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import kopf

from kvpool.operator.api import kinds
from kvpool.operator.api.common import API_VERSION
from kvpool.operator.runtime import permissions

Obj = dict[str, Any]


@dataclass(frozen=True)
class Kind:
    """Where a kind lives in the REST API."""

    api_version: str
    plural: str
    namespaced: bool = True

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]

    def path(self, namespace: str | None, name: str | None = None, sub: str | None = None) -> str:
        root = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        scope = f"/namespaces/{namespace}" if self.namespaced else ""
        out = f"{root}{scope}/{self.plural}"
        if name is not None:
            out += f"/{name}"
        if sub is not None:
            out += f"/{sub}"
        return out


KINDS: dict[str, Kind] = {
    **{k.kind: Kind(API_VERSION, k.plural) for k in kinds.KINDS.values()},
    "ConfigMap": Kind("v1", "configmaps"),
    "Secret": Kind("v1", "secrets"),
    "Service": Kind("v1", "services"),
    "Pod": Kind("v1", "pods"),
    "Event": Kind("v1", "events"),
    "ServiceAccount": Kind("v1", "serviceaccounts"),
    "Role": Kind("rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": Kind("rbac.authorization.k8s.io/v1", "rolebindings"),
    "Deployment": Kind("apps/v1", "deployments"),
    "StatefulSet": Kind("apps/v1", "statefulsets"),
    "PodDisruptionBudget": Kind("policy/v1", "poddisruptionbudgets"),
    "NetworkPolicy": Kind("networking.k8s.io/v1", "networkpolicies"),
    "ValidatingWebhookConfiguration": Kind(
        "admissionregistration.k8s.io/v1", "validatingwebhookconfigurations", namespaced=False
    ),
}

#: Sent with every request, so audit logs (and the RBAC test) can tell the operator's calls.
USER_AGENT = "kvpool-operator/0.1"

#: Kinds the renderer emits: listed per domain to find what to prune.
CHILD_KINDS = (
    "ConfigMap",
    "Secret",
    "Service",
    "ServiceAccount",
    "Role",
    "RoleBinding",
    "Deployment",
    "StatefulSet",
    "PodDisruptionBudget",
    "NetworkPolicy",
)


class ApiError(Exception):
    """A non-2xx answer of the API server."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


def ssl_context(creds: kopf.ConnectionInfo) -> ssl.SSLContext | bool:
    """TLS for the API server as kopf's own client builds it: the CA from a file or a
    kubeconfig's base64 ``certificate-authority-data``, client certificates from files or data
    (kopf decodes them; a hand-made ``cadata`` of base64 text was "no start line")."""
    if not creds.server.startswith("https") or creds.insecure:
        return False
    return creds.as_ssl_context()


class KubeClient:
    """Async CRUD on namespaced objects; one aiohttp session, created in the operator's loop."""

    def __init__(self, field_manager: str, timeout_s: float = 30.0) -> None:
        self.field_manager = field_manager
        # Per socket operation, not per request: under a burst, requests queue for one of the
        # pooled connections, and that wait must not count as the API server being down.
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=10.0, sock_read=timeout_s)
        self._creds: kopf.ConnectionInfo | None = None
        self._session: aiohttp.ClientSession | None = None
        self.requests = 0

    def login(self, creds: kopf.ConnectionInfo) -> None:
        """Use these credentials from now on (kopf's login handler calls this)."""
        self._creds = creds

    def _http(self) -> aiohttp.ClientSession:
        if self._creds is None:
            raise RuntimeError("KubeClient used before the operator logged in")
        if self._session is None or self._session.closed:
            headers = {"Accept": "application/json", "User-Agent": USER_AGENT}
            if self._creds.token:
                headers["Authorization"] = f"{self._creds.scheme or 'Bearer'} {self._creds.token}"
            self._session = aiohttp.ClientSession(
                base_url=self._creds.server.rstrip("/"),
                headers=headers,
                timeout=self._timeout,
                connector=aiohttp.TCPConnector(ssl=ssl_context(self._creds), limit=32),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _call(
        self,
        method: str,
        kind: str,
        verb: str,
        path: str,
        *,
        sub: str | None = None,
        params: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> Obj:
        spec = KINDS[kind]
        permissions.require(spec.group, spec.plural + (f"/{sub}" if sub else ""), verb)
        self.requests += 1
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if data is not None else {}
        async with self._http().request(
            method, path, params=params, data=data, headers=headers
        ) as resp:
            text = await resp.text()
            try:
                payload: Obj = json.loads(text) if text else {}
            except ValueError:
                payload = {"message": text[:200]}
            if resp.status >= 400:
                raise ApiError(
                    resp.status,
                    str(payload.get("reason", resp.reason)),
                    str(payload.get("message", "")),
                )
            return payload

    async def list(
        self, kind: str, namespace: str, labels: Mapping[str, str] | None = None
    ) -> list[Obj]:
        """Objects of ``kind`` in ``namespace`` matching every label (also checked here)."""
        params = {}
        if labels:
            params["labelSelector"] = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        payload = await self._call("GET", kind, "list", KINDS[kind].path(namespace), params=params)
        items: list[Obj] = payload.get("items") or []
        wanted = dict(labels or {})
        return [
            i
            for i in items
            if all(
                (i.get("metadata", {}).get("labels") or {}).get(k) == v for k, v in wanted.items()
            )
        ]

    async def create(self, obj: Obj) -> Obj:
        meta = obj["metadata"]
        return await self._call(
            "POST",
            obj["kind"],
            "create",
            KINDS[obj["kind"]].path(meta["namespace"]),
            params={"fieldManager": self.field_manager},
            body=obj,
        )

    async def patch(
        self, kind: str, namespace: str, name: str, patch: Obj, *, status: bool = False
    ) -> Obj:
        """JSON merge patch of the object, or of its status subresource."""
        sub = "status" if status else None
        return await self._call(
            "PATCH",
            kind,
            "patch",
            KINDS[kind].path(namespace, name, sub),
            sub=sub,
            params={"fieldManager": self.field_manager},
            body=patch,
            content_type="application/merge-patch+json",
        )

    async def put_cluster_object(self, obj: Obj) -> Obj:
        """Create a cluster-scoped object, or merge-patch it to ``obj`` when it exists."""
        kind, name = obj["kind"], obj["metadata"]["name"]
        params = {"fieldManager": self.field_manager}
        try:
            return await self._call(
                "POST", kind, "create", KINDS[kind].path(None), params=params, body=obj
            )
        except ApiError as exc:
            if exc.status != 409:
                raise
        return await self._call(
            "PATCH",
            kind,
            "patch",
            KINDS[kind].path(None, name),
            params=params,
            body=obj,
            content_type="application/merge-patch+json",
        )

    async def delete(self, kind: str, namespace: str, name: str) -> None:
        try:
            await self._call(
                "DELETE",
                kind,
                "delete",
                KINDS[kind].path(namespace, name),
                body={"propagationPolicy": "Background"},
            )
        except ApiError as exc:
            if exc.status != 404:
                raise

    async def event(
        self, regarding: Obj, event_type: str, reason: str, message: str, now: str
    ) -> None:
        """A core/v1 Event about ``regarding`` (what ``kubectl describe`` shows)."""
        meta = regarding["metadata"]
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": regarding.get("apiVersion", API_VERSION),
                "kind": regarding["kind"],
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
                "resourceVersion": meta.get("resourceVersion"),
            },
            "type": event_type,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": self.field_manager},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
            "reportingComponent": self.field_manager,
        }
        await self._call(
            "POST", "Event", "create", KINDS["Event"].path(meta["namespace"]), body=body
        )
