"""The few Kubernetes API calls a controller replica makes: its Lease and its pod's role label.

Why a client of its own (not the ``kubernetes`` package): two resources, four verbs, and the
controller image should not pull a generated client of the whole API. Credentials are found
the way client-go finds them: ``$KUBECONFIG`` when set (``kvpool-operator cluster`` gives each
pod one with its service account's token; ``kvpool-operator up`` one for its local stand-in),
else the pod's service account (``/var/run/secrets/kubernetes.io/serviceaccount``: token, CA,
namespace; ``KUBERNETES_SERVICE_HOST``/``_PORT``). The token file is read again before each
request, as bound service-account tokens rotate.

Every failure surfaces as :class:`KubeError` (with the HTTP status when there was one);
``409`` — the resourceVersion written is no longer current, or the Lease already exists — is
:class:`ConflictError`, which election treats as "someone else wrote first".
"""

from __future__ import annotations

import base64
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from kvpool.controller.election import LeaseRecord

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
LEASES = "/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
PODS = "/api/v1/namespaces/{namespace}/pods/{name}"


class KubeError(RuntimeError):
    """An API call failed; ``status`` is the HTTP status when the server answered."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class ConflictError(KubeError):
    """409: another writer changed the object first (or created it)."""


@dataclass(frozen=True)
class KubeConfig:
    """Where the API server is and how to authenticate to it."""

    server: str
    namespace: str | None = None
    token: str | None = None
    token_file: str | None = None
    ca_file: str | None = None
    ca_data: bytes | None = None
    insecure: bool = False

    def bearer(self) -> str | None:
        if self.token_file:
            return Path(self.token_file).read_text(encoding="utf-8").strip()
        return self.token

    def ssl_context(self) -> ssl.SSLContext | bool:
        if not self.server.startswith("https"):
            return False
        if self.insecure:
            return False
        ctx = ssl.create_default_context(cafile=self.ca_file)
        if self.ca_data is not None:
            ctx.load_verify_locations(cadata=self.ca_data.decode())
        return ctx


def load_config(env: Mapping[str, str] | None = None) -> KubeConfig:
    """``$KUBECONFIG`` (its current context) when set, else the pod's service account; raises
    :class:`KubeError` naming what is missing."""
    env = os.environ if env is None else env
    path = env.get("KUBECONFIG")
    if path:
        return _from_kubeconfig(Path(path.split(os.pathsep)[0]))
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
    token = SERVICE_ACCOUNT / "token"
    if not host or not port or not token.exists():
        raise KubeError(
            "no Kubernetes API credentials: neither $KUBECONFIG nor an in-cluster service "
            f"account ({token}, KUBERNETES_SERVICE_HOST/PORT); leader election needs one "
            "(or run without --lease-name)"
        )
    namespace_file = SERVICE_ACCOUNT / "namespace"
    host = f"[{host}]" if ":" in host else host
    return KubeConfig(
        server=f"https://{host}:{port}",
        namespace=(
            namespace_file.read_text(encoding="utf-8").strip() if namespace_file.exists() else None
        ),
        token_file=str(token),
        ca_file=str(SERVICE_ACCOUNT / "ca.crt"),
    )


def _named(items: Any, name: str, what: str, path: Path) -> dict[str, Any]:
    for item in items or []:
        if isinstance(item, dict) and item.get("name") == name:
            return dict(item.get(what) or {})
    raise KubeError(f"{path}: no {what} named {name!r}")


def _from_kubeconfig(path: Path) -> KubeConfig:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise KubeError(f"cannot read the kubeconfig {path}: {exc}") from None
    if not isinstance(data, dict) or not data.get("current-context"):
        raise KubeError(f"{path}: not a kubeconfig with a current-context")
    context = _named(data.get("contexts"), data["current-context"], "context", path)
    cluster = _named(data.get("clusters"), context.get("cluster", ""), "cluster", path)
    user = _named(data.get("users"), context["user"], "user", path) if context.get("user") else {}
    if not cluster.get("server"):
        raise KubeError(f"{path}: cluster {context.get('cluster')!r} names no server")
    ca_data = cluster.get("certificate-authority-data")
    return KubeConfig(
        server=str(cluster["server"]).rstrip("/"),
        namespace=context.get("namespace"),
        token=user.get("token"),
        token_file=user.get("tokenFile"),
        ca_file=cluster.get("certificate-authority"),
        ca_data=base64.b64decode(ca_data) if ca_data else None,
        insecure=bool(cluster.get("insecure-skip-tls-verify")),
    )


# ------------------------------------------------------------------ Lease <-> record


def lease_body(namespace: str, name: str, record: LeaseRecord) -> dict[str, Any]:
    """The Lease object of a record (with its resourceVersion, for an update)."""
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    if record.resource_version is not None:
        meta["resourceVersion"] = record.resource_version
    spec: dict[str, Any] = {
        "holderIdentity": record.holder,
        "leaseDurationSeconds": record.duration_s,
        "leaseTransitions": record.transitions,
    }
    if record.acquire_time is not None:
        spec["acquireTime"] = record.acquire_time
    if record.renew_time is not None:
        spec["renewTime"] = record.renew_time
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": meta,
        "spec": spec,
    }


def lease_record(obj: Mapping[str, Any]) -> LeaseRecord:
    """A stored Lease as election sees it (absent fields as the API defaults them)."""
    spec = obj.get("spec") or {}
    return LeaseRecord(
        holder=str(spec.get("holderIdentity") or ""),
        duration_s=int(spec.get("leaseDurationSeconds") or 0),
        acquire_time=spec.get("acquireTime"),
        renew_time=spec.get("renewTime"),
        transitions=int(spec.get("leaseTransitions") or 0),
        resource_version=(obj.get("metadata") or {}).get("resourceVersion"),
    )


class KubeClient:
    """Lease get/create/update and a pod's label, in one namespace."""

    def __init__(self, config: KubeConfig, namespace: str, timeout_s: float = 1.0) -> None:
        self.config = config
        self.namespace = namespace
        self._http = httpx.AsyncClient(
            base_url=config.server, verify=config.ssl_context(), timeout=timeout_s
        )

    async def _call(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> dict[str, Any] | None:
        headers = {"Accept": "application/json"}
        token = self.config.bearer()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        if body is not None:
            headers["Content-Type"] = content_type
        try:
            resp = await self._http.request(method, path, json=body, headers=headers)
        except httpx.HTTPError as exc:
            raise KubeError(f"{method} {path}: {type(exc).__name__}: {exc}") from None
        if resp.status_code == 404 and method == "GET":
            return None
        if resp.status_code >= 400:
            try:
                message = resp.json().get("message", resp.text)
            except ValueError:
                message = resp.text
            kind = ConflictError if resp.status_code == 409 else KubeError
            raise kind(f"{method} {path}: {resp.status_code} {message}", resp.status_code)
        data: dict[str, Any] = resp.json()
        return data

    def _lease_path(self, name: str | None = None) -> str:
        path = LEASES.format(namespace=self.namespace)
        return f"{path}/{name}" if name else path

    async def get_lease(self, name: str) -> LeaseRecord | None:
        obj = await self._call("GET", self._lease_path(name))
        return None if obj is None else lease_record(obj)

    async def create_lease(self, name: str, record: LeaseRecord) -> LeaseRecord:
        body = lease_body(self.namespace, name, record)
        obj = await self._call("POST", self._lease_path(), body)
        assert obj is not None
        return lease_record(obj)

    async def update_lease(self, name: str, record: LeaseRecord) -> LeaseRecord:
        body = lease_body(self.namespace, name, record)
        obj = await self._call("PUT", self._lease_path(name), body)
        assert obj is not None
        return lease_record(obj)

    async def label_pod(self, pod: str, labels: Mapping[str, str | None]) -> None:
        """Merge-patch the pod's labels (``None`` removes one)."""
        body = {"metadata": {"labels": dict(labels)}}
        await self._call(
            "PATCH",
            PODS.format(namespace=self.namespace, name=pod),
            body,
            "application/merge-patch+json",
        )

    async def close(self) -> None:
        await self._http.aclose()
