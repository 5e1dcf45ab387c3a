"""``kvpool-operator up -f FILE...`` and ``kvpool-operator down``: a cache domain on this machine.

Why this module exists: the operator's render is what a cluster would run; ``up`` runs exactly
that render as local processes on 127.0.0.1 (Services mapped to local ports, see ``plan``),
plus the services the pool names (its Redis), so a user sees the whole pool work with one
command and the e2e suite and ``make demo`` test the render as it is. The order is a cluster's
(rule 8): named services, the Mooncake parts, the controller, every worker, the gateway last,
each waited on through its rendered readiness probe with progress. ``up`` then supervises
(restarts a process that exits, like a kubelet) until Ctrl-C, SIGTERM or ``down``; the state
file ``<state-dir>/state.json`` records every process group, the endpoints and the log
directory, so ``down`` can stop them from another shell.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from kvpool.operator.api.pool import KVCachePool
from kvpool.operator.loader import load_text
from kvpool.operator.local.balance import balanced_services
from kvpool.operator.local.monitoring import start_prometheus
from kvpool.operator.local.plan import (
    LOOPBACK,
    ClusterMap,
    NamedService,
    Obj,
    StackError,
    named_services,
    replica_name,
)
from kvpool.operator.local.rewrite import sim_hosts
from kvpool.operator.local.services import Backend, LocalServices
from kvpool.operator.local.stack import (
    LocalStack,
    Running,
    pid_alive,
    reap,
    resolve_command,
    stop_group,
    terminate,
    wait_port,
)
from kvpool.operator.render import render_domain
from kvpool.operator.validation import errors, validate_domain

STATE_FILE = "state.json"
DEFAULT_STATE_DIR = ".kvpool/up"
_ORDER = ("controller", "worker", "gateway")


@dataclass
class Rendered:
    """The pools of the given files and every object the operator renders for them."""

    pools: list[KVCachePool]
    objects: list[Obj]

    @property
    def services(self) -> list[NamedService]:
        found: dict[tuple[str, int], NamedService] = {}
        for pool in self.pools:
            for service in named_services(pool):
                found.setdefault(service.key, service)
        return list(found.values())


def render_files(paths: Sequence[str | os.PathLike[str]]) -> Rendered:
    """Load, validate (refusing on errors, like ``render``) and render every domain."""
    pools: list[KVCachePool] = []
    objects: list[Obj] = []
    loaded = None
    for path in paths:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise StackError(f"{path}: cannot read ({exc.strerror})") from None
        loaded = load_text(text, str(path), loaded)
    if loaded is None:
        raise StackError("no file given: kvpool-operator up -f FILE")
    domains = loaded.domains()
    if loaded.errors:
        raise StackError("\n".join(str(e) for e in loaded.errors))
    if not domains:
        raise StackError("no KVCachePool in the given files")
    for domain in domains:
        problems = errors(validate_domain(domain.pool, domain.members))
        if problems:
            raise StackError("\n".join(str(p) for p in problems))
        pools.append(domain.pool)
        objects += render_domain(domain.pool, domain.members)
    return Rendered(pools, objects)


def start_order(stack: LocalStack) -> list[str]:
    """Mooncake parts, controller, workers (by name), gateway: the order a cluster settles in."""

    def rank(name: str) -> tuple[int, str]:
        component = stack.rendered[name].component
        known = _ORDER.index(component) + 1 if component in _ORDER else 0
        return known, name

    for name, w in stack.rendered.items():
        if w.component == "worker" and "vllm" in w.argv:
            raise StackError(
                f"{name} runs --engine vllm (engine.platform ascend or cuda): kvpool-operator up "
                "runs the reference engine only; set engine.platform: cpu to run it here"
            )
    return sorted(stack.rendered, key=rank)


def stages(stack: LocalStack, order: list[str]) -> list[list[str]]:
    """``order`` cut where the component changes: each stage waits for the one before."""
    out: list[list[str]] = []
    for name in order:
        component = stack.rendered[name].component
        if out and stack.rendered[out[-1][0]].component == component:
            out[-1].append(name)
        else:
            out.append([name])
    return out


def write_state(
    state_dir: Path, stack: LocalStack, ready: bool, services: LocalServices | None = None
) -> None:
    """The state file ``down`` and the callers of ``up`` read (written atomically). A
    Deployment of several replicas is listed under ``replicas`` (its processes, each under
    ``processes``), its endpoint is its Service's (the proxy), and ``selected`` says which
    replicas each such Service routes to (the controller's: the leader)."""
    endpoints = stack.endpoints()
    for name in stack.cmap.replicas:
        http = stack.rendered[name].ports.get("http")
        if http is not None:
            endpoints[name] = f"http://{LOOPBACK}:{stack.cmap.ports[http]}"
    state: dict[str, Any] = {
        "up_pid": os.getpid(),
        "ready": ready,
        "endpoints": endpoints,
        "replicas": {
            name: [replica_name(name, i) for i in range(len(maps))]
            for name, maps in stack.cmap.replicas.items()
        },
        "selected": services.selected() if services is not None else {},
        "logs": str(stack.root / "logs"),
        "processes": stack.manifest(),
        "secrets": {f"{name}/{key}": value for (name, key), value in stack.secrets.items()},
        "cluster": {
            "hosts": sorted(stack.cmap.hosts),
            "service_ports": [[h, p, t] for (h, p), t in stack.cmap.service_ports.items()],
            "ports": [[c, p] for c, p in stack.cmap.ports.items()],
            "external": [[h, p, t] for (h, p), t in stack.cmap.external.items()],
        },
    }
    tmp = state_dir / f".{STATE_FILE}.tmp"
    tmp.write_text(json.dumps(state, indent=1), encoding="utf-8")
    tmp.replace(state_dir / STATE_FILE)


def cluster_from_state(state: dict[str, Any]) -> ClusterMap:
    """The address map a running ``up`` uses, to run one more process in its domain."""
    c = state["cluster"]
    return ClusterMap(
        frozenset(c["hosts"]),
        {(h, int(p)): int(t) for h, p, t in c["service_ports"]},
        {int(k): int(v) for k, v in c["ports"]},
        {(h, int(p)): int(t) for h, p, t in c["external"]},
    )


def read_state(state_dir: Path) -> dict[str, Any] | None:
    """The state of a running (or crashed) ``up`` in ``state_dir``, or None."""
    path = state_dir / STATE_FILE
    if not path.exists():
        return None
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def _running(run: Running) -> bool:
    return run.proc.poll() is None


def _start_stage(
    stack: LocalStack,
    stage: list[str],
    services: LocalServices,
    hosts: dict[str, list[str]],
    step: int,
    total: int,
    say: Callable[[str], None],
) -> list[tuple[int, Running]]:
    """Start one stage: each workload in its own process (each replica of a Deployment of
    several in one of its own), except the simulated instances of a host process (``up
    --sim-host``), which start together in it. Returns what to wait on: every process, a
    hosted instance with its host's process and log."""
    runs: list[tuple[int, Running]] = []
    hosted = {name: host for host, names in hosts.items() for name in names}
    for name in stage:
        if name not in hosted:
            for run in start_pods(stack, services, name):
                step += 1
                runs.append((step, run))
                what = f"{run.workload.name} ({run.workload.component})"
                say(f"[{step}/{total}] {what} starting, log {run.log}")
    for host, names in hosts.items():
        mine = [n for n in names if n in stage]
        if not mine:
            continue
        run = stack.start_host(host, [stack.prepare(n) for n in mine])
        say(
            f"[{step + 1}-{step + len(mine)}/{total}] {host} (kvpool-worker host) starting "
            f"{len(mine)} simulated instances in one process, log {run.log}"
        )
        for lw in run.hosts:
            step += 1
            runs.append((step, Running(lw, run.proc, run.log)))
    return runs


def start_pods(stack: LocalStack, services: LocalServices, name: str) -> list[Running]:
    """Start the pods of one workload: one process, or one per replica behind its Service's
    proxy; each is a pod of the API stand-in (its labels) and gets its credentials."""
    w = stack.rendered[name]
    runs = []
    replicas = range(len(stack.cmap.replicas[name])) if name in stack.cmap.replicas else [None]
    for index in replicas:
        lw = stack.prepare(name, replica=index)
        lw.env.update(services.env())
        services.store.add_pod(w.namespace, lw.name, w.labels)
        run = stack.start(lw)
        if index is not None:
            ports = stack.cmap.replicas[name][index]
            services.add(Backend(lw.name, w.namespace, name, ports, lw.readiness))
        runs.append(run)
    return runs


def _serve(
    rendered: Rendered,
    state_dir: Path,
    say: Callable[[str], None],
    stop: threading.Event,
    ready_timeout_s: float,
    skip: Sequence[str],
    sim_host: bool = False,
    monitoring: bool = False,
) -> int:
    """Start the stages (then Prometheus, with ``monitoring``), then supervise until ``stop``;
    every process is stopped on return."""
    with (
        LocalStack(rendered.objects, state_dir, rendered.services) as stack,
        local_services(stack, state_dir) as services,
    ):
        unknown = sorted(set(skip) - set(stack.rendered))
        if unknown:
            raise StackError(
                f"--skip {','.join(unknown)}: not rendered; rendered: "
                f"{', '.join(sorted(stack.rendered))}"
            )
        order = [n for n in start_order(stack) if n not in skip]
        for name in skip:
            ports = {p: stack.cmap.ports[c] for p, c in stack.rendered[name].ports.items()}
            say(f"skipped {name}: run it yourself; its ports here are {ports}")
        for name in order:  # every command exists, before anything starts
            resolve_command(stack.rendered[name].argv[0])
        hosts = sim_hosts(stack.rendered, order) if sim_host else {}
        if sim_host and not hosts:
            say("--sim-host: no simulated instance (engine.sim) in the render to host")
        total = len(rendered.services) + sum(
            len(stack.cmap.replicas.get(name, [name])) for name in order
        )
        step = 0
        for service in rendered.services:
            step += 1
            run = stack.start_service(service)
            port = run.workload.ports["tcp"]
            say(f"[{step}/{total}] {run.workload.name} listening on {LOOPBACK}:{port}")
            write_state(state_dir, stack, False, services)
        for stage in stages(stack, order):  # a stage starts together, like a rollout
            runs = _start_stage(stack, stage, services, hosts, step, total, say)
            step += len(runs)
            write_state(state_dir, stack, False, services)
            for n, run in runs:
                if run.workload.readiness is None:  # no HTTP probe: its first port listening
                    for port in list(run.workload.ports.values())[:1]:
                        wait_port(port, functools.partial(_running, run), run.workload.name)
                        say(f"[{n}/{total}] {run.workload.name} listening on {LOOPBACK}:{port}")
                    continue
                took = stack.wait_ready(run, ready_timeout_s, say, stop.is_set)
                say(f"[{n}/{total}] {run.workload.name} ready after {took:.1f}s at {run.url}")
        if monitoring:  # kvpool.operator.local.monitoring: the chart's scrape config and alerts
            start_prometheus(stack, rendered.objects, ready_timeout_s, say, stop.is_set)
        write_state(state_dir, stack, True, services)
        urls = read_state(state_dir)["endpoints"]  # type: ignore[index]
        for component in ("gateway", "controller"):
            for name in order:
                if stack.rendered[name].component == component:
                    say(f"{component} {name} listens on {urls[name]}")
        say(f"logs: {stack.root / 'logs'}")
        say(f"up: Ctrl-C or `kvpool-operator down --state-dir {state_dir}` stops everything")
        selected = services.selected()
        while not stop.wait(1.0):
            notes = stack.supervise()
            for note in notes:
                say(note)
            now = services.selected()
            for svc, pods in now.items():
                if pods != selected.get(svc):
                    say(f"Service {svc} routes to {', '.join(pods) or 'no replica'}")
            if notes or now != selected:
                write_state(state_dir, stack, True, services)
            selected = now
        say("stopping every process")
    say("stopped")
    return 0


@contextlib.contextmanager
def local_services(
    stack: LocalStack, state_dir: Path, workloads: Collection[str] | None = None
) -> Iterator[LocalServices]:
    """The API stand-in and the proxies of the Services in front of several replicas (only of
    ``workloads`` when given: a caller that runs the others its own way)."""
    namespaces = sorted({w.namespace for w in stack.rendered.values()}) or ["default"]
    balanced = [
        b
        for b in balanced_services(stack.objects, stack.cmap)
        if workloads is None or b.workload in workloads
    ]
    services = LocalServices(state_dir / "services", namespaces[0], balanced)
    services.start()
    try:
        yield services
    finally:
        services.stop()


def up(
    files: Sequence[str],
    state_dir: Path,
    out: TextIO,
    ready_timeout_s: float = 300.0,
    skip: Sequence[str] = (),
    sim_host: bool = False,
    monitoring: bool = False,
) -> int:
    """Run the render until a signal or ``down``; 0 after a clean stop, 1 on a failure.

    ``skip`` names workloads not to start (one you run yourself, e.g. under a debugger: the
    others still address it at its mapped local port, printed at the start). ``sim_host``:
    every simulated instance of a domain runs in one ``kvpool-worker host`` process (each as it
    would run alone; the process is restarted as a whole), not one process per pod.
    ``monitoring``: also a Prometheus on 127.0.0.1 scraping the domain as the chart's
    ServiceMonitors would, with the chart's alerts (``kvpool.operator.local.monitoring``)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    previous = read_state(state_dir)
    if previous is not None and pid_alive(int(previous["up_pid"])):
        raise StackError(
            f"a domain is already up from {state_dir} (pid {previous['up_pid']}): "
            f"kvpool-operator down --state-dir {state_dir}"
        )
    rendered = render_files(files)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())

    def say(line: str) -> None:
        print(line, file=out, flush=True)

    try:
        return _serve(rendered, state_dir, say, stop, ready_timeout_s, skip, sim_host, monitoring)
    finally:  # stopped, failed or interrupted: nothing of this run is up any more
        (state_dir / STATE_FILE).unlink(missing_ok=True)


def down(state_dir: Path, out: TextIO, grace_s: float = 30.0) -> int:
    """Stop the ``up`` recorded in ``state_dir`` and every process group it started."""
    state = read_state(state_dir)
    if state is None:
        print(f"nothing is up from {state_dir} (no {STATE_FILE})", file=out)
        return 0
    terminate(int(state["up_pid"]), grace_s)
    for name, proc in state.get("processes", {}).items():
        pgid = int(proc["pgid"])
        if pid_alive(pgid):
            print(f"stopping {name} (process group {pgid})", file=out)
            stop_group(pgid, 10.0)
    (state_dir / STATE_FILE).unlink(missing_ok=True)
    print(f"down: every process of {state_dir} stopped", file=out)
    return 0


@dataclass
class UpProcess:
    """``kvpool-operator up`` run as a child process, for callers that drive the domain
    (``make demo``, the e2e suite): waits until the state file says ready, then exposes it."""

    files: Sequence[str]
    state_dir: Path
    skip: Sequence[str] = ()
    sim_host: bool = False
    monitoring: bool = False
    proc: subprocess.Popen[bytes] | None = None

    @property
    def output(self) -> Path:
        return self.state_dir / "up.out"

    def start(self, timeout_s: float = 600.0, echo: TextIO | None = None) -> dict[str, Any]:
        """Start ``up``; return its state once every workload is ready (or raise, with the
        tail of its output). ``echo`` receives its progress lines as they come."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "kvpool.operator.cli", "up", "--state-dir"]
        argv += [str(self.state_dir)] + [a for f in self.files for a in ("-f", str(f))]
        argv += [a for name in self.skip for a in ("--skip", name)]
        argv += ["--sim-host"] if self.sim_host else []
        argv += ["--monitoring"] if self.monitoring else []
        with self.output.open("wb") as out:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        deadline = time.monotonic() + timeout_s
        shown = 0
        while time.monotonic() < deadline:
            lines = self.output.read_text(errors="replace").splitlines()
            if echo is not None:
                for line in lines[shown:]:
                    print(line, file=echo, flush=True)
                shown = len(lines)
            if self.proc.poll() is not None:
                tail = "\n".join(lines[-30:])
                raise StackError(f"kvpool-operator up exited with {self.proc.returncode}:\n{tail}")
            state = read_state(self.state_dir)
            if state is not None and state["ready"] and state["up_pid"] == self.proc.pid:
                return state
            time.sleep(0.5)
        self.stop()
        raise StackError(f"kvpool-operator up: not ready within {timeout_s:.0f}s")

    def state(self) -> dict[str, Any]:
        state = read_state(self.state_dir)
        if state is None:
            raise StackError(f"kvpool-operator up is not running from {self.state_dir}")
        return state

    def stop(self) -> int | None:
        """``kvpool-operator down`` for this state dir; the exit code of ``up``."""
        down(self.state_dir, io.StringIO())
        return reap(self.proc, 60)

    def __enter__(self) -> UpProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
