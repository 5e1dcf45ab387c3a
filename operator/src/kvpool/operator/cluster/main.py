"""``kvpool-operator cluster up|down|url``: start, stop and use the local control plane.

Why: one command gives a machine what ``helm install`` and ``kubectl`` need: the API server
(``apiserver``) on 127.0.0.1, the controllers and scheduler (``controllers``), the kubelet
(``kubelet``) and the service proxy (``proxy``), in one process, plus a kubeconfig with an admin
token. ``up`` runs in the foreground until Ctrl-C or ``down`` (``--detach``: in the background,
returning once the API answers); every pod's process is stopped on the way out. The state
directory holds the kubeconfig, ``state.json`` (pid, URL, what runs where) and each pod's
directory and log. ``url`` prints where a Service port listens here (as ``minikube service
--url`` does), the one thing a user needs beyond kubectl to send a request to the gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import logging
import os
import secrets
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import aiohttp.test_utils
import aiohttp.web
import kmock
import yaml

from kvpool.operator.cluster import proxy
from kvpool.operator.cluster.admission import Webhooks
from kvpool.operator.cluster.apiserver import ApiServer, widen_backlog
from kvpool.operator.cluster.controllers import ControllerManager
from kvpool.operator.cluster.kubelet import Kubelet
from kvpool.operator.cluster.podenv import kubeconfig
from kvpool.operator.local.stack import free_port, pid_alive, reap, stop_group, terminate
from kvpool.operator.runtime import certs

log = logging.getLogger(__name__)
DEFAULT_STATE_DIR = ".kvpool/cluster"
STATE_FILE = "state.json"
ADMIN = {"username": "kubernetes-admin", "groups": ["system:masters", "system:authenticated"]}


def _write_state(state_dir: Path, state: dict[str, Any]) -> None:
    tmp = state_dir / f".{STATE_FILE}.tmp"
    tmp.write_text(json.dumps(state, indent=1), encoding="utf-8")
    tmp.replace(state_dir / STATE_FILE)


def read_state(state_dir: Path) -> dict[str, Any] | None:
    path = state_dir / STATE_FILE
    if not path.exists():
        return None
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


async def serve(state_dir: Path, port: int, say: TextIO, stop: asyncio.Event) -> None:
    """Run the control plane until ``stop``; every pod is stopped before returning."""
    state_dir = state_dir.resolve()
    admin_token = secrets.token_hex(16)
    tokens: dict[str, str] = {}
    server = ApiServer(
        declare_kvpool=False, record=False, authorize=True, users={admin_token: ADMIN}
    )

    def token_for(namespace: str, account: str) -> str:
        key = f"{namespace}/{account}"
        if key not in tokens:
            tokens[key] = secrets.token_hex(16)
            server.users[tokens[key]] = {
                "username": f"system:serviceaccount:{namespace}:{account}",
                "groups": [
                    "system:serviceaccounts",
                    f"system:serviceaccounts:{namespace}",
                    "system:authenticated",
                ],
            }
        return tokens[key]

    proxy_port = free_port()
    pki = certs.generate(
        state_dir / "pki", ["localhost"], ip_addresses=["127.0.0.1"], ca_name="kvpool-cluster-ca"
    )
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(pki.certfile, pki.keyfile)
    listening = kmock.Server(server, host="127.0.0.1", port=port, server_cls=_tls_server(tls))
    async with server, listening as listener:
        widen_backlog(listener)
        url = f"https://127.0.0.1:{listener.port}"
        kubelet = Kubelet(
            server.store,
            state_dir / "pods",
            url,
            f"http://127.0.0.1:{proxy_port}",
            token_for,
            pki.ca_pem,
        )
        server.admission = Webhooks(server.store, kubelet.resolve)
        server.resolve_service = kubelet.resolve
        server.pod_log = kubelet.pod_log
        runner = aiohttp.web.AppRunner(proxy.app(kubelet.resolve), access_log=None)
        await runner.setup()
        await aiohttp.web.TCPSite(runner, "127.0.0.1", proxy_port).start()
        controllers = ControllerManager(server.store)
        controllers.start(os.cpu_count() or 1, _memory_bytes())
        kubelet.start()
        config = state_dir / "kubeconfig"
        config.write_text(
            kubeconfig(url, admin_token, "default", "kubernetes-admin", pki.ca_pem),
            encoding="utf-8",
        )
        os.chmod(config, 0o600)
        tasks = [asyncio.create_task(controllers.run(stop)), asyncio.create_task(kubelet.run(stop))]
        state = {
            "pid": os.getpid(),
            "url": url,
            "kubeconfig": str(config),
            "ready": True,
            "proxy": f"http://127.0.0.1:{proxy_port}",
            "ca": str(state_dir / "pki" / "ca.crt"),
        }
        _write_state(state_dir, state)
        print(f"cluster: API server {url}, kubeconfig {config}", file=say, flush=True)
        print(
            f"cluster: export KUBECONFIG={config}; `kvpool-operator cluster down "
            f"--state-dir {state_dir}` stops it",
            file=say,
            flush=True,
        )
        try:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0)
                pods, services = kubelet.endpoints(), kubelet.proxies.addresses()
                _write_state(state_dir, {**state, "pods": pods, "services": services})
        finally:
            print("cluster: stopping every pod", file=say, flush=True)
            for task in tasks:
                with contextlib.suppress(Exception):
                    await task
            await kubelet.close()
            await runner.cleanup()
            (state_dir / STATE_FILE).unlink(missing_ok=True)
            print("cluster: stopped", file=say, flush=True)


def _tls_server(context: ssl.SSLContext) -> Any:
    """kmock's server class, serving TLS with ``context`` (client-go sends tokens over TLS
    only)."""

    class TLSServer(aiohttp.test_utils.RawTestServer):
        async def start_server(self, loop: Any = None, **kwargs: Any) -> None:
            await super().start_server(loop=loop, ssl=context, **kwargs)

    return TLSServer


def _memory_bytes() -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 8 << 30


def up(state_dir: Path, port: int, out: TextIO) -> int:
    """The foreground control plane (Ctrl-C, SIGTERM or ``down`` stops it)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    previous = read_state(state_dir)
    if previous is not None and pid_alive(int(previous["pid"])):
        print(
            f"kvpool-operator cluster: already up from {state_dir} (pid {previous['pid']}, "
            f"{previous['url']})",
            file=out,
        )
        return 1

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(state_dir, port, out, stop)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    asyncio.run(main())
    return 0


def down(state_dir: Path, out: TextIO, grace_s: float = 60.0) -> int:
    """Stop the control plane of ``state_dir`` and every pod process it started."""
    state = read_state(state_dir)
    if state is None:
        print(f"nothing is up from {state_dir} (no {STATE_FILE})", file=out)
        return 0
    terminate(int(state["pid"]), grace_s)
    for pods in (state.get("pods") or {}).values():
        for name, pod in pods.items():
            if pod.get("pid") and pid_alive(int(pod["pid"])):
                print(f"stopping pod {name} (process group {pod['pid']})", file=out)
                stop_group(int(pod["pid"]), 10.0)
    (state_dir / STATE_FILE).unlink(missing_ok=True)
    print(f"down: the cluster of {state_dir} is stopped", file=out)
    return 0


def service_url(state_dir: Path, namespace: str, service: str, port: str = "") -> str:
    """``http://127.0.0.1:<local port>`` of a Service port, from the running cluster: its
    proxy's for a Service in front of several replicas, else a running pod's it selects."""
    import urllib.request  # noqa: PLC0415

    state = read_state(state_dir)
    if state is None:
        raise RuntimeError(f"no cluster is up from {state_dir}")
    path = f"/api/v1/namespaces/{namespace}/services/{service}"
    config = yaml.safe_load(Path(state["kubeconfig"]).read_text(encoding="utf-8"))
    auth = {"Authorization": f"Bearer {config['users'][0]['user']['token']}"}
    tls = ssl.create_default_context(cafile=state["ca"])
    req = urllib.request.Request(state["url"] + path, headers=auth)
    with urllib.request.urlopen(req, timeout=10, context=tls) as resp:
        svc = json.loads(resp.read())
    ports = svc["spec"].get("ports") or []
    sp = next((p for p in ports if port in ("", str(p.get("name")), str(p["port"]))), None)
    if sp is None:
        raise RuntimeError(f"service {namespace}/{service} has no port {port!r}")
    selector = svc["spec"].get("selector") or {}
    target = sp.get("targetPort", sp["port"])
    pods_url = f"{state['url']}/api/v1/namespaces/{namespace}/pods?labelSelector=" + ",".join(
        f"{k}={v}" for k, v in sorted(selector.items())
    )
    req = urllib.request.Request(pods_url, headers=auth)
    with urllib.request.urlopen(req, timeout=10, context=tls) as resp:
        items = json.loads(resp.read())["items"]
    running = (state.get("pods") or {}).get(namespace, {})
    proxied = (state.get("services") or {}).get(namespace, {}).get(service, {})
    for pod in items:
        info = running.get(pod["metadata"]["name"])
        for p in pod["spec"]["containers"][0].get("ports", []):
            if target not in (p.get("name"), p["containerPort"]):
                continue
            if str(p["containerPort"]) in proxied:  # several replicas: the Service's proxy
                return f"http://127.0.0.1:{proxied[str(p['containerPort'])]}"
            local = (info or {}).get("ports", {}).get(p.get("name", str(p["containerPort"])))
            if local:
                return f"http://127.0.0.1:{local}"
    raise RuntimeError(f"service {namespace}/{service} has no running pod yet")


@dataclass
class ClusterProcess:
    """``kvpool-operator cluster up`` as a child process (``--detach``, the e2e suite and
    ``make demo-cluster``): started, waited on until the API answers, stopped with ``down``."""

    state_dir: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def output(self) -> Path:
        return self.state_dir / "cluster.out"

    def start(self, timeout_s: float = 60.0) -> dict[str, Any]:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        (self.state_dir / STATE_FILE).unlink(missing_ok=True)
        argv = [
            sys.executable,
            "-m",
            "kvpool.operator.cli",
            "cluster",
            "up",
            "--state-dir",
            str(self.state_dir),
        ]
        with self.output.open("wb") as out:
            self.proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.output.read_text(errors="replace")[-3000:]
                raise RuntimeError(
                    f"kvpool-operator cluster up exited with {self.proc.returncode}:\n{tail}"
                )
            state = read_state(self.state_dir)
            if state is not None and state.get("ready") and state["pid"] == self.proc.pid:
                return state
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"kvpool-operator cluster up: not ready within {timeout_s:.0f}s")

    def state(self) -> dict[str, Any]:
        """The running cluster's state file (what runs where)."""
        return read_state(self.state_dir) or {}

    def stop(self) -> int | None:
        down(self.state_dir, io.StringIO())
        return reap(self.proc, 90)

    def __enter__(self) -> ClusterProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: Sequence[str], out: TextIO = sys.stdout) -> int:
    """``kvpool-operator cluster ...``."""
    parser = argparse.ArgumentParser(
        prog="kvpool-operator cluster",
        description="A local Kubernetes control plane for one machine (for trying kvpool and "
        "for the e2e suite; not for production).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    u = sub.add_parser("up", help="run the API server, controllers and kubelet until Ctrl-C")
    u.add_argument("--state-dir", default=DEFAULT_STATE_DIR)
    u.add_argument("--port", type=int, default=0, help="API server port (default: a free one)")
    u.add_argument("--detach", action="store_true", help="run in the background; return once up")
    d = sub.add_parser("down", help="stop the cluster and every pod process")
    d.add_argument("--state-dir", default=DEFAULT_STATE_DIR)
    m = sub.add_parser("demo", help="make demo's workload through cluster up, Helm and kubectl")
    m.add_argument("-f", "--filename", action="append", required=True, help="YAML file")
    m.add_argument("--state-dir", default=".kvpool/demo-cluster")
    m.add_argument("--plot", default="bench-results/demo-cluster.png")
    m.add_argument("--chart", default="charts/kvpool")
    s = sub.add_parser("url", help="print http://127.0.0.1:PORT of a Service port")
    s.add_argument("service")
    s.add_argument("-n", "--namespace", default="default")
    s.add_argument("--port", default="", help="port name or number (default: the first)")
    s.add_argument("--state-dir", default=DEFAULT_STATE_DIR)
    args = parser.parse_args(list(argv))
    state_dir = Path(args.state_dir)
    if args.command == "down":
        return down(state_dir, out)
    if args.command == "demo":
        from kvpool.operator.cluster import demo  # noqa: PLC0415
        from kvpool.operator.local.demo import DemoError  # noqa: PLC0415

        try:
            return demo.run(args.filename, state_dir, Path(args.plot), Path(args.chart), out)
        except (DemoError, RuntimeError) as exc:
            print(f"kvpool-operator cluster demo: FAILED: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print(
                "kvpool-operator cluster demo: interrupted; the cluster is stopped", file=sys.stderr
            )
            return 130
    if args.command == "url":
        try:
            print(service_url(state_dir, args.namespace, args.service, args.port), file=out)
        except (RuntimeError, OSError) as exc:
            print(f"kvpool-operator cluster url: {exc}", file=sys.stderr)
            return 1
        return 0
    if args.detach:
        state = ClusterProcess(state_dir).start()
        print(
            f"cluster: up (pid {state['pid']}) at {state['url']}\n"
            f"export KUBECONFIG={state['kubeconfig']}",
            file=out,
        )
        return 0
    return up(state_dir, args.port, out)
