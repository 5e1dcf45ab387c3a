"""``kvpool-operator cluster``'s kubelet runs every replica of a Deployment, each on its own
ports, with the Deployment's Service a proxy to the Ready ones.

Why: the controller and the gateway run two replicas by default; on one machine two pods
binding the same container port cannot run together, so each pod of a Deployment of several
replicas takes a replica slot with its own local ports, and the Service's address sends each
connection only to pods that are Ready, not terminating, and whose labels match its selector as
they are now (the controller's leader label). Real processes (a small HTTP server whose
readiness the test switches with a file), the real store, Deployment controller, scheduler and
kubelet in this test's loop; no API server (nothing here needs HTTP to the store). 127.0.0.1,
bounded waits, every process stopped at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvpool.operator.cluster import workloads
from kvpool.operator.cluster.controllers import ControllerManager
from kvpool.operator.cluster.kubelet import DEPLOYMENTS, PODS, SERVICES, Kubelet
from kvpool.operator.cluster.store import Store
from kvpool.protocol.domain import CONTROLLER_ROLE_LABEL

NS = "default"
WAIT_S = 60.0
#: A pod: answers every GET with its pod name; /readyz is 200 only once READY_DIR/<pod> exists.
SERVER = """
import http.server, os, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
name = os.environ["POD_NAME"]
flag = os.path.join(os.environ["READY_DIR"], name)
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        ok = self.path != "/readyz" or os.path.exists(flag)
        body = name.encode()
        self.send_response(200 if ok else 503)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def deployment(name: str, replicas: int, port: int, ready_dir: Path) -> dict[str, Any]:
    labels = {"app": name}
    container = {
        "name": "server",
        "image": "local",
        "command": [Path(sys.executable).name, "-c", SERVER],
        "args": ["--port", str(port)],
        "env": [
            {"name": "READY_DIR", "value": str(ready_dir)},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        ],
        "ports": [{"name": "http", "containerPort": port}],
        "readinessProbe": {
            "httpGet": {"path": "/readyz", "port": "http"},
            "periodSeconds": 1,
            "failureThreshold": 1,
        },
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [container], "terminationGracePeriodSeconds": 5},
            },
        },
    }


def service(name: str, selector: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name},
        "spec": {
            "selector": selector,
            "ports": [{"name": "http", "port": 80, "targetPort": "http"}],
        },
    }


async def until(what: str, check: Callable[[], Any], timeout_s: float = WAIT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        await asyncio.sleep(0.1)
    raise AssertionError(f"not within {timeout_s:.0f}s: {what}")


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[tuple[Store, Kubelet]]:
    store = Store()
    manager = ControllerManager(store)
    manager.start(2, 1 << 30)
    kubelet = Kubelet(
        store, tmp_path / "pods", "https://127.0.0.1:9", "http://127.0.0.1:9", lambda *_: "t", b""
    )
    kubelet.start()
    stop = asyncio.Event()
    tasks = [asyncio.create_task(manager.run(stop)), asyncio.create_task(kubelet.run(stop))]
    try:
        yield store, kubelet
    finally:
        stop.set()
        for task in tasks:
            with contextlib.suppress(Exception):
                await task
        await kubelet.close()


def _pods(store: Store, app: str) -> dict[str, dict[str, Any]]:
    return {
        p["metadata"]["name"]: p
        for p in store.list(PODS, NS)
        if p["metadata"]["labels"].get("app") == app and not workloads.terminating(p)
    }


def _running(kubelet: Kubelet, names: Any) -> dict[str, dict[str, Any]] | None:
    pods = kubelet.endpoints().get(NS, {})
    found = {n: pods.get(n) for n in names}
    return found if all(p and p["pid"] for p in found.values()) else None  # type: ignore[misc]


async def _answers(url: str, count: int) -> list[str]:
    """Who answers ``count`` GETs through the Service's proxy (one connection each); a refused
    or closed connection (no ready endpoint) is ``""``."""
    out = []
    for _ in range(count):
        async with httpx.AsyncClient(timeout=2.0) as http:
            try:
                out.append((await http.get(url)).text)
            except httpx.TransportError:
                out.append("")
    return out


def _closed_at_once(port: int) -> bool:
    """A connection the proxy accepts and closes (no ready endpoint), as kube-proxy rejects."""
    with socket.create_connection(("127.0.0.1", port), 2.0) as conn:
        conn.settimeout(2.0)
        return conn.recv(1) == b""


async def test_each_replica_has_its_own_ports_and_the_service_reaches_only_ready_ones(
    cluster: tuple[Store, Kubelet], tmp_path: Path
) -> None:
    store, kubelet = cluster
    flags = tmp_path / "ready"
    flags.mkdir()
    store.create(SERVICES, NS, service("echo", {"app": "echo"}))
    store.create(DEPLOYMENTS, NS, deployment("echo", 2, 8080, flags))
    store.create(SERVICES, NS, service("solo", {"app": "solo"}))
    store.create(DEPLOYMENTS, NS, deployment("solo", 1, 8081, flags))

    names = await until(
        "two echo pods",
        lambda: sorted(_pods(store, "echo")) if len(_pods(store, "echo")) == 2 else None,
    )
    info = await until("both echo pods running", lambda: _running(kubelet, names))
    assert sorted(p["replica"] for p in info.values()) == [0, 1]
    own = [p["ports"]["http"] for p in info.values()]
    proxy = await until(
        "the echo Service's proxy", lambda: kubelet.proxies.addresses().get(NS, {}).get("echo")
    )
    assert set(proxy) == {"8080"}
    front = proxy["8080"]
    assert len(set(own)) == 2 and front not in own  # distinct ports, the Service's apart
    info = _running(kubelet, names) or {}  # as the state file says, now the proxy listens
    assert all(p["service_ports"] == {"http": front} for p in info.values())
    assert not any(workloads.is_ready(p) for p in _pods(store, "echo").values())
    assert await asyncio.to_thread(_closed_at_once, front)  # no Ready pod: no endpoint
    assert await kubelet.resolve(NS, "echo", "http") is None  # nor for *.svc HTTP names

    # One replica Ready: the Service sends every connection to it, none to the other.
    first, second = names
    (flags / first).touch()
    await until(f"{first} Ready", lambda: workloads.is_ready(store.get(PODS, NS, first)))
    assert not workloads.is_ready(store.get(PODS, NS, second))
    assert set(await _answers(f"http://127.0.0.1:{front}/", 6)) == {first}
    assert await kubelet.resolve(NS, "echo", "http") == ("127.0.0.1", info[first]["ports"]["http"])

    # Both Ready: both get connections.
    (flags / second).touch()
    await until(f"{second} Ready", lambda: workloads.is_ready(store.get(PODS, NS, second)))
    assert set(await _answers(f"http://127.0.0.1:{front}/", 6)) == {first, second}

    # A Deployment of one replica runs as before: the namespace's port, no proxy.
    (solo,) = await until("the solo pod", lambda: list(_pods(store, "solo")) or None)
    solo_info = (await until("solo running", lambda: _running(kubelet, [solo])))[solo]
    assert solo_info["replica"] is None and solo_info["service_ports"] == {}
    assert solo_info["ports"]["http"] == kubelet.ports[NS][8081]
    assert "solo" not in kubelet.proxies.addresses().get(NS, {})

    # The selector as the pods' labels are now (the controller's leader label): only the
    # labelled Ready replica is an endpoint.
    svc = store.get(SERVICES, NS, "echo")
    selector = {"app": "echo", CONTROLLER_ROLE_LABEL: "leader"}
    store.replace(SERVICES, svc, {**svc, "spec": {**svc["spec"], "selector": selector}})
    pod = store.get(PODS, NS, second)
    labels = {**pod["metadata"]["labels"], CONTROLLER_ROLE_LABEL: "leader"}
    store.replace(PODS, pod, {**pod, "metadata": {**pod["metadata"], "labels": labels}})
    await until(
        "only the leader answering",
        lambda: kubelet._eligible(NS, kubelet.proxies.balanced[(NS, front)], 8080)
        == [info[second]["ports"]["http"]],
    )
    assert set(await _answers(f"http://127.0.0.1:{front}/", 4)) == {second}

    # Deleting a replica frees its slot: the replacement takes it, with its ports, and is no
    # endpoint until it is Ready itself.
    store.delete(PODS, NS, first)
    replacement = await until(
        "a replacement pod",
        lambda: next((n for n in _pods(store, "echo") if n not in names), None),
    )
    now = (await until("the replacement running", lambda: _running(kubelet, [replacement])))[
        replacement
    ]
    assert (now["replica"], now["ports"]) == (info[first]["replica"], info[first]["ports"])
    assert first not in kubelet.endpoints().get(NS, {})
    svc = store.get(SERVICES, NS, "echo")
    store.replace(SERVICES, svc, {**svc, "spec": {**svc["spec"], "selector": {"app": "echo"}}})
    await asyncio.sleep(1.0)  # a pass of the proxies with the plain selector again
    assert set(await _answers(f"http://127.0.0.1:{front}/", 4)) == {second}
    (flags / replacement).touch()
    await until(
        "the replacement Ready", lambda: workloads.is_ready(store.get(PODS, NS, replacement))
    )
    assert set(await _answers(f"http://127.0.0.1:{front}/", 6)) == {second, replacement}
