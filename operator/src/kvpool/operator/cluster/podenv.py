"""What a pod of ``kvpool-operator cluster`` gets from the cluster rather than from its spec.

Why this module exists: the kubelet (:mod:`kvpool.operator.cluster.kubelet`) starts processes
and keeps their status; the values a cluster hands each pod on top of its rendered spec are
decided here, in one place: the downward API (pod IP 127.0.0.1, name, namespace, uid, node,
service account), the values of its namespace's Secrets, and API credentials. A pod reaches the
API server through a kubeconfig holding its service account's token, and ``*.svc`` HTTP names
through the cluster's service proxy (``HTTP_PROXY``). :func:`kubeconfig` also writes the
admin's kubeconfig (``cluster.main``).
"""

from __future__ import annotations

import base64
import contextlib
import os
from collections.abc import Iterable
from pathlib import Path

from kvpool.operator.cluster import workloads
from kvpool.operator.cluster.store import Obj
from kvpool.operator.local.plan import LOOPBACK


def downward_fields(pod: Obj) -> dict[str, str]:
    """The value of each downward-API ``fieldRef`` the pod may read, as it runs here."""
    meta, spec = pod["metadata"], pod["spec"]
    return {
        "status.podIP": LOOPBACK,
        "status.hostIP": LOOPBACK,
        "metadata.name": meta["name"],
        "metadata.namespace": meta["namespace"],
        "metadata.uid": meta["uid"],
        "spec.nodeName": workloads.NODE,
        "spec.serviceAccountName": str(spec.get("serviceAccountName", "default")),
    }


def secret_values(secrets: Iterable[Obj]) -> dict[tuple[str, str], str]:
    """Each (Secret, key) -> its decoded value (a value that is not base64 is left out)."""
    out: dict[tuple[str, str], str] = {}
    for secret in secrets:
        for key, value in (secret.get("data") or {}).items():
            with contextlib.suppress(ValueError):
                out[(secret["metadata"]["name"], key)] = base64.b64decode(value).decode()
    return out


def pod_env(
    path: Path,
    *,
    api_url: str,
    proxy_url: str,
    namespace: str,
    account: str,
    token: str,
    ca_pem: bytes,
) -> dict[str, str]:
    """API credentials (the service account's ``token`` in a kubeconfig written to ``path``)
    and the service proxy for ``*.svc`` names: the env a pod gets from the cluster."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        kubeconfig(
            api_url,
            token,
            namespace,
            f"system:serviceaccount:{namespace}:{account}",
            ca_pem,
        ),
        encoding="utf-8",
    )
    os.chmod(path, 0o600)
    return {
        "KUBECONFIG": str(path),
        "KUBERNETES_SERVICE_HOST": LOOPBACK,
        "KUBERNETES_SERVICE_PORT": api_url.rsplit(":", 1)[-1],
        "HTTP_PROXY": proxy_url,
        "http_proxy": proxy_url,
        "NO_PROXY": "127.0.0.1,localhost,::1",
        "no_proxy": "127.0.0.1,localhost,::1",
    }


def kubeconfig(server: str, token: str, namespace: str, user: str, ca_pem: bytes) -> str:
    """A kubeconfig for one client of this cluster (HTTPS on 127.0.0.1 verified against the
    cluster's CA, a bearer token: client-go sends no token over plain HTTP)."""
    ca = base64.b64encode(ca_pem).decode()
    return (
        "apiVersion: v1\nkind: Config\n"
        f"clusters:\n- name: kvpool-local\n  cluster:\n    server: {server}\n"
        f"    certificate-authority-data: {ca}\n"
        f"users:\n- name: {user}\n  user:\n    token: {token}\n"
        f"contexts:\n- name: kvpool-local\n  context:\n    cluster: kvpool-local\n"
        f"    user: {user}\n    namespace: {namespace}\n"
        "current-context: kvpool-local\n"
    )
