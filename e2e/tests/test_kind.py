"""The operator's flows against a real Kubernetes API server (kind), when one is configured.

Runs what operator/tests/integration runs against the emulator — children with
ownerReferences, status and observedGeneration, a domain rollout, an invalid spec and its
recovery, a member before its pool, a member's finalizer, a pool that waits for its members —
but against a real API server, so what the emulator cannot show is shown here: schema
validation and defaulting of the generated CRDs, the status subresource, and garbage
collection through ownerReferences. The operator runs in this process (``operate``, the code
``kvpool-operator run`` runs), watching one fresh namespace, without the webhook (the API
server could not reach this process). Worker images are not pulled or run: pods stay pending,
so readiness is not asserted.

Skipped unless KUBECONFIG names a reachable cluster whose current context is a kind cluster
(``kind-*``) or KVPOOL_E2E_CLUSTER=1 says another one may be used: the tests create CRDs and
a namespace. ``make e2e-kind`` creates the kind cluster and runs this file.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import json
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import kopf
import pytest
import yaml

from kvpool.operator.runtime import main
from kvpool.operator.runtime.settings import OperatorSettings

ROOT = Path(__file__).resolve().parents[2]
Obj = dict[str, Any]
API = "apis/kvpool.io/v1alpha1/namespaces/{ns}"


def _skip_reason() -> str | None:
    path = os.environ.get("KUBECONFIG")
    if not path or not Path(path).is_file():
        return "KUBECONFIG does not name a kubeconfig file (run `make e2e-kind`)"
    config = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    context = str(config.get("current-context", ""))
    if not context.startswith("kind-") and os.environ.get("KVPOOL_E2E_CLUSTER") != "1":
        return f"current context {context!r} is not a kind cluster (set KVPOOL_E2E_CLUSTER=1)"
    return None


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))


class Cluster:
    """kubectl-like calls with the kubeconfig's credentials (the ones kopf logs in with)."""

    def __init__(self, info: kopf.ConnectionInfo) -> None:
        import ssl

        ctx: ssl.SSLContext | bool = False
        if info.server.startswith("https") and not info.insecure:
            cadata = info.ca_data.decode() if isinstance(info.ca_data, bytes) else info.ca_data
            ctx = ssl.create_default_context(cafile=info.ca_path, cadata=cadata)
            if info.certificate_path and info.private_key_path:
                ctx.load_cert_chain(info.certificate_path, info.private_key_path)
        headers = {"Authorization": f"Bearer {info.token}"} if info.token else {}
        self.http = aiohttp.ClientSession(
            info.server.rstrip("/"), headers=headers, connector=aiohttp.TCPConnector(ssl=ctx)
        )

    async def call(self, method: str, path: str, body: Any = None, ctype: str = "") -> Any:
        headers = {"Content-Type": ctype or "application/json"}
        data = None if body is None else json.dumps(body)
        async with self.http.request(method, f"/{path}", data=data, headers=headers) as r:
            payload = await r.json(content_type=None)
            if r.status >= 400 and r.status != 404:
                raise AssertionError(f"{method} {path}: {r.status} {payload}")
            return None if r.status == 404 else payload

    async def apply_crds(self) -> None:
        for path in sorted((ROOT / "crds").glob("*.yaml")):
            crd = yaml.safe_load(path.read_text(encoding="utf-8"))
            base = "apis/apiextensions.k8s.io/v1/customresourcedefinitions"
            current = await self.call("GET", f"{base}/{crd['metadata']['name']}")
            if current is None:
                await self.call("POST", base, crd)
            else:
                await self.call(
                    "PATCH",
                    f"{base}/{crd['metadata']['name']}",
                    crd,
                    "application/merge-patch+json",
                )
        for _ in range(100):
            if await self.call("GET", "apis/kvpool.io/v1alpha1") is not None:
                return
            await asyncio.sleep(0.2)

    async def get(self, path: str) -> Any:
        return await self.call("GET", path)

    async def items(self, path: str) -> list[Obj]:
        listed = await self.call("GET", path)
        return list((listed or {}).get("items") or [])


async def eventually(check: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = await check()
        if last:
            return last
        await asyncio.sleep(0.5)
    raise AssertionError(f"not reached in {timeout}s; last: {last!r}")


def example(name: str, namespace: str) -> list[Obj]:
    text = (ROOT / "examples" / f"{name}.yaml").read_text(encoding="utf-8")
    docs = [d for d in yaml.safe_load_all(text) if d]
    for doc in docs:
        doc["metadata"]["namespace"] = namespace
    return docs


@pytest.fixture
async def cluster() -> AsyncIterator[tuple[Cluster, str]]:
    info = kopf.login_with_kubeconfig(settings=kopf.OperatorSettings())
    assert info is not None
    c = Cluster(info)
    await c.apply_crds()
    ns = f"kvpool-e2e-{uuid.uuid4().hex[:6]}"
    await c.call("POST", "api/v1/namespaces", {"metadata": {"name": ns}})
    stop = threading.Event()
    # KVPOOL_E2E_CLUSTERWIDE=1 watches every namespace (as the chart's default does).
    watched = [] if os.environ.get("KVPOOL_E2E_CLUSTERWIDE") == "1" else [ns]
    settings = OperatorSettings(
        namespace=watched,
        health_host="127.0.0.1",
        health_port=0,
        metrics_port=0,
        webhook_mode="none",
        drift_interval=2.0,
        delete_retry=1.0,
        log_format="text",
    )
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    future = pool.submit(asyncio.run, main.operate(settings, stop_flag=stop))
    yield c, ns
    stop.set()
    await asyncio.wrap_future(future)
    pool.shutdown()
    await c.call("DELETE", f"api/v1/namespaces/{ns}")
    await c.http.close()


def _cond(obj: Obj | None, ctype: str) -> Obj:
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == ctype:
            return dict(cond)
    return {}


async def test_domain_children_status_rollout_and_gc(cluster: tuple[Cluster, str]) -> None:
    c, ns = cluster
    pool, p2p, pd = example("cpu-demo", ns)
    for doc in (pool, p2p, pd):
        await c.call("POST", API.format(ns=ns) + f"/{doc['kind'].lower()}s", doc)

    async def observed() -> bool:
        obj = await c.get(API.format(ns=ns) + "/p2pgroups/demo-p2p")
        return bool(
            obj and obj.get("status", {}).get("observedGeneration") == obj["metadata"]["generation"]
        )

    await eventually(observed)
    sts = await c.items(f"apis/apps/v1/namespaces/{ns}/statefulsets")
    assert sorted(s["metadata"]["name"] for s in sts) == [
        "demo-p2p-0",
        "demo-p2p-1",
        "demo-pd-decode-0",
        "demo-pd-prefill-0",
    ]
    assert all(s["metadata"]["ownerReferences"][0]["controller"] for s in sts)
    p = await c.get(API.format(ns=ns) + "/kvcachepools/demo")
    old_fp = p["status"]["domainFingerprint"]
    await c.call(
        "PATCH",
        API.format(ns=ns) + "/kvcachepools/demo",
        {"spec": {"hashSeed": "7"}},
        "application/merge-patch+json",
    )

    async def rolled() -> bool:
        items = await c.items(f"apis/apps/v1/namespaces/{ns}/statefulsets")
        items += await c.items(f"apis/apps/v1/namespaces/{ns}/deployments")
        fps = {
            i["spec"]["template"]["metadata"]["annotations"]["kvpool.io/domain-fingerprint"]
            for i in items
        }
        return len(items) == 6 and old_fp not in fps

    await eventually(rolled)
    # Deleting the member: finalizer, then the cluster's garbage collector removes its workers.
    await c.call("DELETE", API.format(ns=ns) + "/p2pgroups/demo-p2p")

    async def gone() -> bool:
        items = await c.items(f"apis/apps/v1/namespaces/{ns}/statefulsets")
        member = await c.get(API.format(ns=ns) + "/p2pgroups/demo-p2p")
        return member is None and not [
            i for i in items if i["metadata"]["name"].startswith("demo-p2p")
        ]

    await eventually(gone)


async def test_invalid_spec_then_recovery_and_member_before_pool(
    cluster: tuple[Cluster, str],
) -> None:
    c, ns = cluster
    pool, p2p, _ = example("cpu-demo", ns)
    await c.call("POST", API.format(ns=ns) + "/p2pgroups", p2p)

    async def not_found() -> bool:
        return (
            _cond(await c.get(API.format(ns=ns) + "/p2pgroups/demo-p2p"), "Ready").get("reason")
            == "PoolNotFound"
        )

    await eventually(not_found)
    bad = copy.deepcopy(pool)
    bad["spec"]["tiers"] = {"disk": {"path": "/kv", "size": "10Gi"}}
    await c.call("POST", API.format(ns=ns) + "/kvcachepools", bad)

    async def invalid() -> bool:
        return (
            _cond(await c.get(API.format(ns=ns) + "/kvcachepools/demo"), "ConfigValid").get(
                "status"
            )
            == "False"
        )

    await eventually(invalid)
    assert await c.items(f"apis/apps/v1/namespaces/{ns}/statefulsets") == []
    events = await c.items(f"api/v1/namespaces/{ns}/events")
    assert [e for e in events if e.get("reason") == "InvalidSpec"]
    await c.call(
        "PATCH",
        API.format(ns=ns) + "/kvcachepools/demo",
        {"spec": {"tiers": {"disk": None}}},
        "application/merge-patch+json",
    )

    async def recovered() -> bool:
        return len(await c.items(f"apis/apps/v1/namespaces/{ns}/statefulsets")) == 2

    await eventually(recovered)
    await c.call("DELETE", API.format(ns=ns) + "/kvcachepools/demo")

    async def blocked() -> bool:
        return (
            _cond(await c.get(API.format(ns=ns) + "/kvcachepools/demo"), "Ready").get("reason")
            == "DeletionBlocked"
        )

    await eventually(blocked)
    await c.call("DELETE", API.format(ns=ns) + "/p2pgroups/demo-p2p")

    async def pool_gone() -> bool:
        return await c.get(API.format(ns=ns) + "/kvcachepools/demo") is None

    await eventually(pool_gone)
