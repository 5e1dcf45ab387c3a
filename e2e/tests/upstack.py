"""Helpers of the end-to-end tests: a domain brought up with ``kvpool-operator up``, and the
HTTP calls the tests make against its processes.

Why a module: ``test_local_stack.py`` and ``test_gateway_e2e.py`` share one way to start the
render (the product command, as a child process) and to ask the controller, the workers and
the gateway what they hold.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from kvpool.operator.local.demo import Reply
from kvpool.operator.local.demo import chat as demo_chat
from kvpool.operator.local.plan import Workload, workloads
from kvpool.operator.local.up import UpProcess, render_files

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cpu-demo.yaml"
READY_S = 600.0  # the whole render on a shared 2-core box
#: What ``up`` may change in the render (state file ``rewrites``): cluster rewrites only.
CLUSTER_REWRITES = re.compile(
    r"^(argv|env|files)\S*: .* -> .*$|"
    r"^env\.\S+: (fieldRef (status\.podIP|metadata\.name|metadata\.namespace)|secretKeyRef \S+) -> "
)
SETTLE_S = 20.0  # admit events reach the controller asynchronously (LMCache batches them)
CHUNK = 256


def poll(what: str, probe: Callable[[], Any], timeout_s: float = SETTLE_S) -> Any:
    """``probe()`` until truthy (returned), or an AssertionError naming ``what``."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(0.25)
    raise AssertionError(f"{what} not seen within {timeout_s:.0f}s (last: {last!r})")


@dataclass
class Domain:
    """The cpu-demo render, up: its rendered workloads and the running processes' state."""

    up: UpProcess
    rendered: dict[str, Workload]
    file: Path = EXAMPLE  # the domain as brought up

    @property
    def state(self) -> dict[str, Any]:
        return self.up.state()

    def url(self, name: str) -> str:
        return str(self.state["endpoints"][name])

    def pgid(self, name: str) -> int:
        return int(self.state["processes"][name]["pgid"])

    def log(self, name: str) -> str:
        return Path(self.state["processes"][name]["log"]).read_text(errors="replace")

    def instance_id(self, name: str) -> str:
        (text,) = self.rendered[name].files.values()
        return str(yaml.safe_load(text)["lmcache_instance_id"])

    def config(self, name: str) -> dict[str, Any]:
        (text,) = self.rendered[name].files.values()
        data: dict[str, Any] = yaml.safe_load(text)
        return data

    def kill(self, name: str, sig: signal.Signals = signal.SIGKILL) -> int:
        """Signal the process group of ``name`` (``up`` restarts it, like a kubelet)."""
        pgid = self.pgid(name)
        os.killpg(pgid, sig)
        return pgid

    def restarted(self, name: str, old_pgid: int, timeout_s: float = READY_S) -> None:
        """Wait until ``up`` restarted ``name`` and its readiness probe answers again."""
        poll(f"{name} restarted", lambda: self.pgid(name) != old_pgid, timeout_s)
        path, _ = self.rendered[name].readiness or ("/readyz", 0)
        poll(
            f"{name} ready again",
            lambda: _status(f"{self.url(name)}{path}") == 200,
            timeout_s,
        )


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.TransportError:
        return None


def bring_up(
    state_dir: Path, *, monitoring: bool = False, controller_replicas: int | None = None
) -> Domain:
    """The cpu-demo render, up (``monitoring``: with ``up --monitoring``'s Prometheus;
    ``controller_replicas``: ``spec.controller.replicas`` set in a copy of the example)."""
    example = EXAMPLE
    if controller_replicas is not None:
        docs = [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]
        docs[0]["spec"].setdefault("controller", {})["replicas"] = controller_replicas
        state_dir.mkdir(parents=True, exist_ok=True)
        example = state_dir / EXAMPLE.name
        example.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    up = UpProcess([str(example)], state_dir, monitoring=monitoring)
    try:
        up.start(READY_S)
    except Exception:
        up.stop()
        raise
    return Domain(up, workloads(render_files([example]).objects), example)


def processes_of(state: dict[str, Any], name: str) -> list[str]:
    """The process names ``up`` runs a rendered workload as: one per replica of a Deployment
    of several (``<name>-0``, ``-1``...), else the workload's own name."""
    return list(state.get("replicas", {}).get(name, [name]))


def messages(topic: str, sentences: int) -> list[dict[str, str]]:
    text = " ".join(
        f"Note {i} on {topic}: the ledger keeps its columns straight." for i in range(sentences)
    )
    return [{"role": "user", "content": text}]


def chat(
    url: str,
    msgs: list[dict[str, str]],
    max_tokens: int = 12,
    headers: dict[str, str] | None = None,
) -> Reply:
    """A streamed, greedy chat completion (the demo's client: TTFT measured over HTTP)."""
    return demo_chat(url, msgs, headers or {}, max_tokens)


def tokens(url: str, msgs: list[dict[str, str]]) -> list[int]:
    out = httpx.post(f"{url}/tokenize", json={"messages": msgs}, timeout=30).json()
    return list(out["tokens"])


def prefix_hits(controller: str, toks: list[int]) -> dict[str, int]:
    out = httpx.post(f"{controller}/v1/prefix_lookup", json={"tokens": toks}, timeout=10).json()
    return {inst: int(v["hit_chunks"]) for inst, v in out["instances"].items()}


def sample(url: str, name: str, labels: str = "") -> float | None:
    """One sample of ``url``'s /metrics (None while it is not exported)."""
    pattern = re.compile(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", re.M)
    m = pattern.search(httpx.get(f"{url}/metrics", timeout=10).text)
    return float(m.group(1)) if m else None


def metric(controller: str, name: str, labels: str = "") -> float:
    """A counter of the controller's /metrics (0 before its first increment)."""
    value = sample(controller, name, labels)
    return 0.0 if value is None else value


def registered(controller: str, instance_id: str) -> bool:
    body = {"instance_id": instance_id}
    resp = httpx.post(f"{controller}/query_worker_info", json=body, timeout=10)
    return resp.status_code == 200 and bool(resp.json()["worker_infos"])
