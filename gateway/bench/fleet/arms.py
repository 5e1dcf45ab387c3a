"""One arm of the fleet benchmark: a fresh simulated fleet, a router in front, the trace window.

Why this module exists: every router must meet the same fleet in the same state (cold caches),
the same requests at the same pace, and the same client. So each arm brings the rendered bench
pool up with ``kvpool-operator up --sim-host`` (the operator's render as it would run: the
controller, the sim workers in one host process, kvpool's gateway), starts its router against
the workers' URLs (kvpool's own gateway needs nothing more), replays the window with
``kvpool-gateway replay`` (one subprocess, the same flags for everyone) and brings it all down
again. Dynamo's arms run its own mocker fleet (``peers.dynamo_fleet``) sized like ours.

Times: the replay measures wall seconds; the sim workers run ``speedup`` model seconds per wall
second, so every time of the summary is multiplied by ``speedup`` (model seconds, the unit of
the simulator's predictions and of the profile).
"""

from __future__ import annotations

import contextlib
import copy
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from kvpool.operator.local.stack import LocalStack
from kvpool.operator.local.up import UpProcess, cluster_from_state, render_files

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # gateway/bench: domain.py
import domain
import peers
from sizing import FleetPlan

TEMPLATE = Path(__file__).resolve().parent / "pool.yaml"
#: The served model (the pool's spec.model.name): every router is asked for it by name (a
#: router's own /v1/models may not say; sglang-router answers "unknown").
MODEL = next(
    d["spec"]["model"]["name"]
    for d in yaml.safe_load_all(TEMPLATE.read_text(encoding="utf-8"))
    if d["kind"] == "KVCachePool"
)
TIME_KEYS = ("ttft_s", "tpot_s", "e2e_s")


@dataclass(frozen=True)
class Window:
    """The trace and the requests of it every arm replays."""

    trace: Path
    start: int
    count: int


@dataclass
class ArmResult:
    name: str
    label: str
    summary: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)


def pool_file(plan: FleetPlan, root: Path, *, policy: str, kv_events: bool = False) -> Path:
    """The bench pool (``pool.yaml``) sized by ``plan``, with the gateway's ``policy``."""
    docs = list(yaml.safe_load_all(TEMPLATE.read_text(encoding="utf-8")))
    for doc in docs:
        spec = doc["spec"]
        if doc["kind"] == "KVCachePool":
            spec["chunkSize"] = plan.chunk_size
            spec["blockSize"] = plan.block_size
            spec["tiers"]["cpu"]["size"] = f"{round(plan.ddr_gib * 1024)}Mi"
            spec.setdefault("gateway", {}).setdefault("routing", {})["policy"] = policy
        elif doc["kind"] == "P2PGroup":
            spec["replicas"] = plan.instances
            engine = spec["engine"]
            engine["maxModelLen"] = plan.max_model_len
            sim = engine["sim"]
            sim["speedup"] = round(plan.speedup, 6)
            sim["deviceKVGiB"] = plan.device_kv_gib
            if kv_events:
                engine["kvEvents"] = True
    path = root / f"pool-{policy}{'-events' if kv_events else ''}.yaml"
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False), encoding="utf-8")
    return path


@dataclass
class Fleet:
    """A running bench domain: its endpoints by role."""

    up: UpProcess
    state: dict[str, Any]

    def _named(self, suffix: str) -> list[str]:
        return sorted(n for n in self.state["endpoints"] if n.endswith(suffix))

    @property
    def gateway_url(self) -> str:
        (name,) = self._named("-gateway")
        return str(self.state["endpoints"][name])

    @property
    def controller_url(self) -> str:
        (name,) = self._named("-controller")
        return str(self.state["endpoints"][name])

    @property
    def worker_urls(self) -> list[str]:
        eps = self.state["endpoints"]
        names = [n for n in eps if not n.endswith(("-gateway", "-controller"))]
        return [str(eps[n]) for n in sorted(names, key=_natural)]

    def kv_event_sources(self) -> list[peers.KvEventSource]:
        """Each worker's vLLM KV-event publisher, as its ``GET /kv_event_sources`` says."""
        out = []
        for url in self.worker_urls:
            rank0 = httpx.get(f"{url}/kv_event_sources", timeout=5).json()["0"]
            out.append(peers.KvEventSource(url, rank0["endpoint"], rank0.get("replay_endpoint")))
        return out


def _natural(name: str) -> tuple[str, int]:
    head, _, tail = name.rpartition("-")
    return (head, int(tail)) if tail.isdigit() else (name, -1)


@contextlib.contextmanager
def fleet(pool: Path, root: Path, name: str) -> Iterator[Fleet]:
    """``kvpool-operator up --sim-host`` of ``pool``; down afterwards whatever happens."""
    state_dir = root / f"up-{name}"
    up = UpProcess([str(pool)], state_dir, sim_host=True)
    t0 = time.monotonic()
    with up:
        state = up.start(timeout_s=300)
        peers.log(f"{name}: fleet up in {time.monotonic() - t0:.1f} s")
        yield Fleet(up, state)


def replay(
    url: str,
    window: Window,
    plan: FleetPlan,
    out: Path,
    *,
    wrap: Callable[[list[str]], list[str]] = lambda argv: argv,
    worker_metrics: Sequence[str] = (),
    model: str | None = None,
) -> dict[str, Any]:
    """``kvpool-gateway replay`` of the window against ``url``; the summary in model time."""
    exe = str(Path(sys.executable).parent / "kvpool-gateway")
    argv = [
        exe, "replay", "--trace", str(window.trace), "--start", str(window.start),
        "--count", str(window.count), "--time-scale", f"{plan.wall_time_scale:.6g}",
        "--url", url, "--out", str(out), "--progress", "10", "--timeout", "900",
    ]  # fmt: skip
    if model:
        argv += ["--model", model]
    for m in worker_metrics:
        argv += ["--worker-metrics", m]
    done = subprocess.run(wrap(argv), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"replay against {url} failed ({done.returncode}):\n{done.stderr[-3000:]}"
        )
    summary: dict[str, Any] = json.loads(out.read_text())["summary"]
    return to_model_time(summary, plan.speedup)


def to_model_time(summary: dict[str, Any], speedup: float) -> dict[str, Any]:
    """Every time distribution of a replay summary (wall seconds) in model seconds."""
    out = copy.deepcopy(summary)
    for key in TIME_KEYS:
        dist = out.get(key)
        if isinstance(dist, dict):
            out[key] = {
                k: (v * speedup if isinstance(v, int | float) else v) for k, v in dist.items()
            }
    out["wall_speedup"] = speedup
    return out


RouterFactory = Callable[[Fleet], AbstractContextManager[str]]


def run_arm(
    name: str,
    label: str,
    plan: FleetPlan,
    window: Window,
    root: Path,
    *,
    policy: str = "kv-aware",
    router: RouterFactory | None = None,
    kv_events: bool = False,
) -> ArmResult:
    """A fresh fleet, ``router`` in front of it (None: kvpool's rendered gateway), the window."""
    pool = pool_file(plan, root, policy=policy, kv_events=kv_events)
    with fleet(pool, root, name) as f, contextlib.ExitStack() as stack:
        url = stack.enter_context(router(f)) if router is not None else f.gateway_url
        metrics = [f"{u}/metrics" for u in f.worker_urls]
        peers.log(f"{name}: replaying {window.count} requests through {url}")
        summary = replay(
            url, window, plan, root / f"replay-{name}.json", worker_metrics=metrics, model=MODEL
        )
    return ArmResult(name, label, summary)


def two_gateways(root: Path) -> RouterFactory:
    """A router factory: a second replica of the rendered gateway (its own process and index
    replica, the same gateway.yaml and env) next to the one ``up`` started, and nginx in
    front of both (one address, requests in turn)."""

    @contextlib.contextmanager
    def start(f: Fleet) -> Iterator[str]:
        rendered = render_files(list(f.up.files))
        stack = LocalStack(rendered.objects, root / "gw2", cluster=cluster_from_state(f.state))
        (name,) = [n for n, w in stack.rendered.items() if w.component == "gateway"]
        lw = stack.prepare(name, as_name=f"{name}-replica2")
        run = stack.start(lw)
        try:
            stack.wait_ready(run, 120, progress=peers.log)
            second = f"http://127.0.0.1:{lw.ports['http']}"
            with peers.balancer([f.gateway_url, second], root) as url:
                yield url
        finally:
            domain.terminate_all([stack.running.pop(lw.name)], grace_s=5)

    return start


def sglang(fleet_: Fleet, root: Path) -> AbstractContextManager[str]:
    return domain.sglang_router(fleet_.worker_urls, root, "cache_aware")


def vllm_router(policy: str, root: Path, plan: FleetPlan, model: str) -> RouterFactory:
    def start(f: Fleet) -> AbstractContextManager[str]:
        sources = f.kv_event_sources() if policy == "kv_aware" else ()
        return peers.vllm_router(
            f.worker_urls, root, policy, model=model, block_size=plan.block_size, sources=sources
        )

    return start


def dynamo_arm(mode: str, plan: FleetPlan, window: Window, root: Path) -> ArmResult:
    """Dynamo's router on its own mocker fleet, sized like ours: instances, device blocks of
    the same block size, batch limits, speed-up, the same tokenizer and window."""
    blocks = int(plan.device_kv_gib * 2**30 // (plan.kv_bytes_per_token * plan.block_size))
    with peers.dynamo_fleet(
        root,
        instances=plan.instances,
        blocks=blocks,
        block_size=plan.block_size,
        speedup=plan.speedup,
        mode=mode,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_len=plan.max_model_len,
    ) as fleet_:
        peers.log(f"dynamo-{mode}: replaying {window.count} requests")
        summary = replay(
            fleet_.url, window, plan, root / f"replay-dynamo-{mode}.json",
            wrap=fleet_.command, model=fleet_.model,
        )  # fmt: skip
    return ArmResult(f"dynamo_{mode.replace('-', '_')}", f"Dynamo 1.6.1 ({mode})", summary)
