"""The benchmark's cache domain and the routers in front of it, as local processes.

Why this module exists: every arm of the routing benchmark must see the same workers, started
the way a cluster would start them. The domain (``pool.yaml``: controller and three reference
workers with the real LMCache) is the operator's render run through ``kvpool-operator up``'s
local runner (``kvpool.operator.local``): Services mapped to loopback ports, the rendered
command lines, env and LMCache YAML unchanged. Our gateway is started from the rendered
gateway Deployment and its rendered ``gateway.yaml``; the round-robin arm renders the same
pool with ``spec.gateway.routing.policy: round-robin`` and runs that render's gateway against
the same addresses. sglang-router (PyPI ``sglang-router``, a Rust binary) gets the same worker
URLs on the command line.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import yaml

from kvpool.operator.local.services import LocalServices
from kvpool.operator.local.stack import LocalStack, Running
from kvpool.operator.local.up import local_services, render_files, start_pods

sys.path.append(str(Path(__file__).resolve().parents[2] / "worker" / "bench"))
import services

POOL_FILE = Path(__file__).resolve().parent / "pool.yaml"
SGLANG = "sglang-router"


def log(msg: str) -> None:
    print(f"[gateway-bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _policy_file(policy: str, root: Path) -> Path:
    """``pool.yaml`` with ``spec.gateway.routing.policy`` set (the operator renders the rest)."""
    docs = list(yaml.safe_load_all(POOL_FILE.read_text(encoding="utf-8")))
    for doc in docs:
        if doc.get("kind") == "KVCachePool":
            doc["spec"].setdefault("gateway", {}).setdefault("routing", {})["policy"] = policy
    path = root / f"pool-{policy}.yaml"
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False), encoding="utf-8")
    return path


def terminate_all(runs: list[Running], grace_s: float = 8.0) -> None:
    """SIGTERM every process group at once, SIGKILL what is left after ``grace_s``."""
    for run in runs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for run in runs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            run.proc.wait(max(0.1, deadline - time.monotonic()))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.proc.pid, signal.SIGKILL)
        run.proc.wait(10)


@dataclass
class Domain:
    """The rendered domain: controller and workers run here; gateways start per arm. Its pods
    run as ``up`` runs them: each replica of a workload behind its Service's proxy, with the
    credentials of ``up``'s Kubernetes API stand-in (the controller's replicas elect their
    leader through it)."""

    root: Path
    stack: LocalStack
    services: LocalServices
    exits: contextlib.ExitStack
    #: The process of the gateway :meth:`gateway` started last (its resident memory is read).
    gateway_pid: int | None = None

    @classmethod
    def render(cls, root: Path, pool_file: Path = POOL_FILE) -> Domain:
        rendered = render_files([pool_file])
        stack = LocalStack(rendered.objects, root / "domain", rendered.services)
        exits = contextlib.ExitStack()
        # the gateways are started per arm on the Service's port, not behind a proxy
        others = [n for n, w in stack.rendered.items() if w.component != "gateway"]
        services = exits.enter_context(local_services(stack, root / "domain", others))
        return cls(root, stack, services, exits)

    def names(self, component: str) -> list[str]:
        return sorted(n for n, w in self.stack.rendered.items() if w.component == component)

    def ports(self, name: str) -> dict[str, int]:
        """Local ports of a workload (the operator's container ports, mapped)."""
        w = self.stack.rendered[name]
        return {k: self.stack.cmap.ports[v] for k, v in w.ports.items()}

    @property
    def worker_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{self.ports(n)['http']}" for n in self.names("worker")]

    @property
    def gateway_config(self) -> dict[str, Any]:
        """The rendered gateway.yaml (model, chunk size, instances, routing), as rendered."""
        (name,) = self.names("gateway")
        return dict(yaml.safe_load(next(iter(self.stack.rendered[name].files.values()))))

    def local_gateway_config(self) -> dict[str, Any]:
        """The rendered gateway.yaml with the local addresses, as the gateway would read it."""
        (name,) = self.names("gateway")
        lw = self.stack.prepare(name, as_name=f"{name}-config")
        return dict(yaml.safe_load(next(iter(lw.files.values()))))

    @property
    def controller_url(self) -> str:
        return f"http://127.0.0.1:{self.ports(self.names('controller')[0])['http']}"

    def start(self, names: list[str], timeout_s: float = 240.0) -> float:
        """Start ``names`` together, wait until every rendered readiness probe answers 200."""
        t0 = time.monotonic()
        runs = [run for n in names for run in start_pods(self.stack, self.services, n)]
        for run in runs:
            self.stack.wait_ready(run, timeout_s, progress=log)
        return time.monotonic() - t0

    def stop(self, names: list[str]) -> None:
        terminate_all([self.stack.running.pop(n) for n in names if n in self.stack.running])

    def close(self) -> None:
        try:
            self.stop(list(self.stack.running))
        finally:
            self.exits.close()

    @contextlib.contextmanager
    def gateway(
        self,
        policy: str | None = None,
        extra_args: tuple[str, ...] = (),
        port: int | None = None,
        tag: str = "",
        pool_file: Path | None = None,
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """Our gateway from the render (``policy`` None: the pool's own routing policy;
        ``pool_file``: the render of that variant of the domain's pool), its command line
        extended by ``extra_args`` (``--workers N``: the operator renders one process), on
        ``port`` instead of the rendered one (two gateways at once), named with ``tag``.

        Yields its URL and the rendered (localized) gateway config it reads."""
        stack = self.stack
        if policy is not None or pool_file is not None:
            path = pool_file if pool_file is not None else _policy_file(str(policy), self.root)
            rendered = render_files([path])
            stack = LocalStack(
                rendered.objects, self.root / f"gw-{path.stem}", cluster=self.stack.cmap
            )
        (name,) = [n for n, w in stack.rendered.items() if w.component == "gateway"]
        lw = stack.prepare(name, as_name=f"{name}-{policy or 'default'}{tag}")
        lw.argv.extend(extra_args)
        if port is not None:
            lw.argv[lw.argv.index("--port") + 1] = str(port)
            lw.ports["http"] = port
            if lw.readiness is not None:
                lw = dataclasses.replace(lw, readiness=(lw.readiness[0], port))
        run = stack.start(lw)
        self.gateway_pid = run.proc.pid
        try:
            stack.wait_ready(run, 120, progress=log)
            config = yaml.safe_load(next(iter(lw.files.values())))
            yield f"http://127.0.0.1:{lw.ports['http']}", copy.deepcopy(config)
        finally:
            terminate_all([stack.running.pop(lw.name)], grace_s=5)


@contextlib.contextmanager
def instant_upstreams(
    urls: list[str], model: str, logdir: Path, max_events: int = 1, decode: bool = False
) -> Iterator[None]:
    """``upstream.py`` listening on the ports of ``urls`` (the workers', while they are down);
    streams of up to ``max_events`` events, written one at a time with ``decode``."""
    ports = [str(urlsplit(u).port) for u in urls]
    cmd = [sys.executable, str(Path(__file__).resolve().parent / "upstream.py"),
           "--ports", ",".join(ports), "--model", model,
           "--max-events", str(max_events)] + (["--decode"] if decode else [])  # fmt: skip
    with services.started(cmd, int(ports[-1]), "instant upstreams", logdir / "upstream.log"):
        yield


def sglang_version() -> str:
    return version("sglang-router")


@contextlib.contextmanager
def sglang_router(
    worker_urls: list[str], logdir: Path, policy: str = "cache_aware"
) -> Iterator[str]:
    """sglang-router in front of ``worker_urls`` on 127.0.0.1; yields its URL once its
    ``/readiness`` answers 200 (it has probed every worker's health endpoint)."""
    port, metrics = services.free_port(), services.free_port()
    cmd = [
        sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
        "--port", str(port), "--worker-urls", *worker_urls, "--policy", policy,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics),
        # kvpool workers answer /readyz (sglang's default is /health)
        "--health-check-endpoint", "/readyz", "--worker-startup-check-interval", "1",
        "--log-level", "warn",
    ]  # fmt: skip
    logfile = logdir / f"sglang-{policy}-{port}.log"
    with services.started(cmd, port, SGLANG, logfile) as proc:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/readiness", timeout=2).status_code == 200:
                    break
            text = logfile.read_text(errors="replace")
            refused = re.search(r"Health check failed: (HTTP status[^)]*\)[^)]*\))", text)
            if refused or proc.poll() is not None or time.monotonic() > deadline:
                why = (
                    f"it refuses the workers: {refused.group(1)}"
                    if refused
                    else "log:\n" + "\n".join(text.splitlines()[-10:])
                )
                raise RuntimeError(f"{SGLANG} did not become ready; {why}")
            time.sleep(0.2)
        yield url
