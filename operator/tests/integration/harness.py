"""Run the real operator (kvpool.operator.runtime.main.operate) in a side thread against the
emulator, plus a small client and polling helpers for the tests and the benchmark.

Why a side thread: kopf cancels every task created after it started when it stops, which would
include pytest-asyncio's fixture teardown if it shared the loop (kopf-on-kmock.md). The
emulator serves from the test's loop; the operator talks to it over HTTP like to a cluster.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import kopf
import yaml

from kvpool.operator.runtime import handlers, main
from kvpool.operator.runtime.settings import OperatorSettings

Obj = dict[str, Any]
ROOT = Path(__file__).resolve().parents[3]
PLURALS = {
    "KVCachePool": "apis/kvpool.io/v1alpha1/namespaces/{ns}/kvcachepools",
    "P2PGroup": "apis/kvpool.io/v1alpha1/namespaces/{ns}/p2pgroups",
    "PDPair": "apis/kvpool.io/v1alpha1/namespaces/{ns}/pdpairs",
    "Pod": "api/v1/namespaces/{ns}/pods",
    "StatefulSet": "apis/apps/v1/namespaces/{ns}/statefulsets",
    "ConfigMap": "api/v1/namespaces/{ns}/configmaps",
    "Deployment": "apis/apps/v1/namespaces/{ns}/deployments",
    "Secret": "api/v1/namespaces/{ns}/secrets",
    "ServiceAccount": "api/v1/namespaces/{ns}/serviceaccounts",
    "Service": "api/v1/namespaces/{ns}/services",
    "Role": "apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
    "RoleBinding": "apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
    "PodDisruptionBudget": "apis/policy/v1/namespaces/{ns}/poddisruptionbudgets",
    "NetworkPolicy": "apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies",
}


def example(name: str) -> list[Obj]:
    """The documents of examples/<name>.yaml."""
    text = (ROOT / "examples" / f"{name}.yaml").read_text(encoding="utf-8")
    return [d for d in yaml.safe_load_all(text) if d]


def fast(ks: kopf.OperatorSettings) -> None:
    """kopf settings for tests: short backoffs (a 5xx must not look like a one-minute hang)."""
    ks.networking.error_backoffs = [0.1]
    ks.watching.reconnect_backoff = 0.1
    ks.scanning.disabled = True
    ks.queueing.exit_timeout = 0.2
    ks.process.instant_exit_timeout = 0.2


def test_settings(**overrides: Any) -> OperatorSettings:
    base: dict[str, Any] = {
        "health_host": "127.0.0.1",
        "health_port": 0,
        "metrics_port": 0,
        "webhook_mode": "none",
        "drift_interval": 30.0,
        "delete_retry": 0.2,
        "log_format": "text",
        "controller_url": "http://127.0.0.1:9/",
        "gateway_url": "http://127.0.0.1:9/",
        "figures_interval": 0.0,  # no live figures unless a test asks (test_live_figures.py)
    }
    base.update(overrides)
    return OperatorSettings(**base)


class OperatorThread:
    """The operator of one test, in its own thread and event loop."""

    def __init__(self, url: str, settings: OperatorSettings) -> None:
        self.url = url
        self.settings = settings
        self.runtime = handlers.Runtime.build(settings)
        self.stop_flag = threading.Event()
        self.ready_flag = threading.Event()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        self._future: concurrent.futures.Future[None] | None = None
        self._ready_at = time.monotonic()

    def _login(self, **_: Any) -> kopf.ConnectionInfo:
        return kopf.ConnectionInfo(server=self.url, insecure=True)

    def start(self) -> OperatorThread:
        coro = main.operate(
            self.settings,
            login=self._login,
            stop_flag=self.stop_flag,
            ready_flag=self.ready_flag,
            kopf_overrides=fast,
            runtime=self.runtime,
        )
        self._future = self._pool.submit(asyncio.run, coro)
        return self

    async def wait_ready(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not (self.ready_flag.is_set() and self.runtime.ready):
            if self._future is not None and self._future.done():
                self._future.result()
            if time.monotonic() > deadline:
                raise TimeoutError("the operator did not start")
            await asyncio.sleep(0.02)
        self._ready_at = time.monotonic()

    async def stop(self) -> None:
        # kopf waits 5 s for requests still in flight when stopped during its start-up
        # discovery; a test that stops at once gives that discovery a moment to finish.
        await asyncio.sleep(max(0.0, self._ready_at + 0.5 - time.monotonic()))
        self.stop_flag.set()
        if self._future is not None:
            await asyncio.wrap_future(self._future)
        self._pool.shutdown()


class Client:
    """What a person's kubectl does, over HTTP to the emulator."""

    def __init__(self, url: str) -> None:
        self.http = aiohttp.ClientSession(url)

    async def close(self) -> None:
        await self.http.close()

    async def create(self, obj: Obj, namespace: str = "default") -> Obj:
        path = PLURALS[obj["kind"]].format(ns=namespace)
        async with self.http.post(f"/{path}", json=obj) as resp:
            body: Obj = await resp.json()
            assert resp.status == 201, body
            return body

    async def patch(
        self, kind: str, name: str, patch: Obj, namespace: str = "default", status: bool = False
    ) -> Obj:
        path = PLURALS[kind].format(ns=namespace) + f"/{name}" + ("/status" if status else "")
        headers = {"Content-Type": "application/merge-patch+json"}
        async with self.http.patch(f"/{path}", data=json.dumps(patch), headers=headers) as resp:
            body: Obj = await resp.json()
            assert resp.status == 200, body
            return body

    async def delete(self, kind: str, name: str, namespace: str = "default") -> None:
        path = PLURALS[kind].format(ns=namespace) + f"/{name}"
        async with self.http.delete(f"/{path}") as resp:
            assert resp.status == 200, await resp.text()


async def eventually(
    check: Callable[[], Any], timeout: float = 10.0, what: str = "condition"
) -> Any:
    """Poll ``check`` until it returns something truthy (or raise with its last value)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            last = exc
        if last and not isinstance(last, Exception):
            return last
        await asyncio.sleep(0.02)
    raise AssertionError(f"{what} not reached in {timeout}s; last: {last!r}")
