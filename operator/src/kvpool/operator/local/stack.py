"""Processes of a locally run cache domain: start, probe, supervise, stop.

Why this module exists: ``kvpool-operator up`` turns the planned local workloads (``plan``)
into processes the way a kubelet would: each in its own process group with its log in one
directory, readiness polled on the rendered HTTP probe, a process that exits restarted with a
backoff (``restartPolicy: Always``), and every group stopped with SIGTERM, then SIGKILL, on
the way out. Components are started by their console scripts (``kvpool-controller``,
``kvpool-worker``, ``kvpool-gateway``): the operator never imports them.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpool.operator.local.plan import (
    LOOPBACK,
    ClusterMap,
    NamedService,
    Obj,
    StackError,
    Workload,
    cluster_map,
    replica_name,
    workloads,
)
from kvpool.operator.local.rewrite import (
    LocalWorkload,
    check_rewrite,
    host_instances,
    localize,
    pod_fields,
)

logger = logging.getLogger(__name__)
_POD_ENV = ("LMCACHE_", "KVPOOL_", "VLLM_", "PYTHONHASHSEED", "POD_IP", "OMP_NUM_THREADS", "UCX_")


def free_port() -> int:
    """A TCP port the OS just handed out on 127.0.0.1 (never a fixed port)."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def base_env() -> dict[str, str]:
    """This process's env without anything a pod's rendered env decides."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_POD_ENV)}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def resolve_command(argv0: str) -> str:
    """The console script next to this interpreter (the venv's), else from PATH."""
    local = Path(sys.executable).parent / argv0
    found = str(local) if local.exists() else shutil.which(argv0)
    if found is None:
        raise StackError(f"command {argv0!r} not found: install its component (make install)")
    return found


def http_status(port: int, path: str, timeout_s: float = 2.0) -> int | None:
    """The status of ``GET http://127.0.0.1:port/path``; None when nothing answers."""
    try:
        with urllib.request.urlopen(f"http://{LOOPBACK}:{port}{path}", timeout=timeout_s) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (OSError, ValueError):
        return None


def wait_port(port: int, alive: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Until something accepts TCP on 127.0.0.1:port (for services without an HTTP probe)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            raise StackError(f"{what} exited before it listened on {LOOPBACK}:{port}")
        with contextlib.suppress(OSError), socket.create_connection((LOOPBACK, port), 0.2):
            return
        time.sleep(0.1)
    raise StackError(f"{what} did not listen on {LOOPBACK}:{port} within {timeout_s:.0f}s")


@dataclass
class Running:
    """One started process: its workload, Popen handle, log and restart count; ``hosts``: the
    simulated instances a ``kvpool-worker host`` process serves (empty for any other)."""

    workload: LocalWorkload
    proc: subprocess.Popen[bytes]
    log: Path
    restarts: int = 0
    exited_at: float | None = None
    hosts: list[LocalWorkload] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.workload.ports['http']}"

    def log_tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""


@dataclass
class LocalStack:
    """A rendered domain run locally. As a context manager, ``close`` always runs."""

    objects: list[Obj]
    root: Path
    services: list[NamedService] = field(default_factory=list)
    cluster: ClusterMap | None = None  # share another stack's addresses (same namespace)
    cmap: ClusterMap = field(init=False)
    rendered: dict[str, Workload] = field(init=False)
    rewrites: dict[str, list[str]] = field(default_factory=dict)
    running: dict[str, Running] = field(default_factory=dict)
    secrets: dict[tuple[str, str], str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # processes run with cwd=root and are handed paths under it: never relative ones
        self.root = Path(self.root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.rendered = workloads(self.objects)
        for w in self.rendered.values():  # a cluster's Secrets: a fresh value per key, here
            for ref in w.secret_env.values():
                self.secrets.setdefault(ref, secrets.token_hex(16))
        self.cmap = self.cluster or cluster_map(self.objects, free_port, self.services)

    def __enter__(self) -> LocalStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def prepare(
        self,
        name: str,
        *,
        edit: Callable[[Workload], None] | None = None,
        as_name: str | None = None,
        fields: Mapping[str, str] | None = None,
        replica: int | None = None,
    ) -> LocalWorkload:
        """The local form of one workload, checked against the render by ``check_rewrite``.

        ``edit`` changes the rendered form first (a hand-edited pod), so the rewrite check
        still covers everything else; ``as_name`` runs it under another process name;
        ``replica``: one replica of a Deployment of several (its own ports, named
        ``<name>-<replica>``); ``fields``: the downward API (default: ``pod_fields``).
        """
        if name not in self.rendered:
            raise StackError(f"no workload {name!r}; rendered: {sorted(self.rendered)}")
        w = copy.deepcopy(self.rendered[name])
        if edit is not None:
            edit(w)
        cmap = self.cmap
        if replica is not None:
            cmap = self.cmap.for_replica(name, replica)
            as_name = as_name or replica_name(name, replica)
        pod = as_name or name
        if fields is None:
            fields = pod_fields(pod, w.namespace)
        lw = localize(w, cmap, self.root / pod, self.secrets, fields)
        lw.name = pod
        self.rewrites[lw.name] = check_rewrite(w, lw, cmap)
        if w.cpu is not None and w.cpu.isdigit():
            lw.env.setdefault("OMP_NUM_THREADS", w.cpu)  # what the pod's CPU share does to torch
        return lw

    def start(
        self, lw: LocalWorkload, restarts: int = 0, hosts: Sequence[LocalWorkload] = ()
    ) -> Running:
        """Write its files, start it in its own process group, log to ``<root>/logs/<name>.log``
        (``hosts``: the instances it serves, whose files are written too)."""
        for path, text in [(p, t) for w in (lw, *hosts) for p, t in w.files.items()]:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text, encoding="utf-8")
        log = self.root / "logs" / f"{lw.name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        argv = [resolve_command(lw.argv[0]), *lw.argv[1:]]
        with log.open("ab") as out:  # a restart appends: the history stays
            proc = subprocess.Popen(
                argv,
                env={**base_env(), **lw.env},
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.root,
                start_new_session=True,
            )
        run = Running(lw, proc, log, restarts, hosts=list(hosts))
        self.running[lw.name] = run
        logger.info("started %s (pid %d), log %s", lw.name, proc.pid, log)
        return run

    def update_files(self, lw: LocalWorkload) -> list[str]:
        """Write those of ``lw``'s files whose content changed, each replaced at once (a
        reader sees the old or the new file, never half of one); returns their paths."""
        changed = []
        for path, text in lw.files.items():
            target = Path(path)
            with contextlib.suppress(OSError):
                if target.read_text(encoding="utf-8") == text:
                    continue
            target.parent.mkdir(parents=True, exist_ok=True)
            staged = target.with_name(f".{target.name}.new")
            staged.write_text(text, encoding="utf-8")
            os.replace(staged, target)
            changed.append(path)
        return changed

    def start_host(self, name: str, instances: Sequence[LocalWorkload]) -> Running:
        """One ``kvpool-worker host`` process serving the simulated ``instances``, each with the
        argv, env and files ``prepare`` gave it to run alone; ``kvpool-worker`` parses and
        checks each one as ``serve`` would (``rewrite.host_instances``)."""
        path = str(self.root / name / "instances.json")
        argv = ["kvpool-worker", "host", "--instances", path]
        files = {path: host_instances(instances)}
        host = LocalWorkload(name, "worker", argv, {}, files, {}, {}, None)
        return self.start(host, hosts=instances)

    def start_service(self, service: NamedService) -> Running:
        """Start a service the pool names (its Redis) on its mapped local port."""
        port = self.cmap.external[service.key]
        name = f"{service.kind}-{service.host}-{service.port}"
        argv = ["redis-server", "--bind", LOOPBACK, "--port", str(port), "--save", ""]
        argv += ["--appendonly", "no"]
        lw = LocalWorkload(name, service.kind, argv, {}, {}, {}, {"tcp": port}, None)
        if shutil.which("redis-server") is None:
            raise StackError(
                f"{service.named_by} names Redis at {service.host}:{service.port}, and "
                "redis-server is not installed: apt-get install -y redis-server"
            )
        run = self.start(lw)
        wait_port(port, lambda: run.proc.poll() is None, name)
        return run

    def wait_ready(
        self,
        run: Running,
        timeout_s: float = 180.0,
        progress: Callable[[str], None] | None = None,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> float:
        """Poll the rendered readiness probe until it answers 200; returns the seconds taken.

        A probe path the component does not serve (404/405) fails at once: in a cluster that
        pod would never become Ready.
        """
        if run.workload.readiness is None:
            raise StackError(f"{run.workload.name}: no readiness probe rendered")
        path, port = run.workload.readiness
        t0 = time.monotonic()
        last_note = t0
        while time.monotonic() - t0 < timeout_s:
            if cancelled():
                raise StackError(f"interrupted while waiting for {run.workload.name}")
            if run.proc.poll() is not None:
                raise StackError(
                    f"{run.workload.name} exited with {run.proc.returncode} before it was "
                    f"ready; log {run.log}:\n{run.log_tail()}"
                )
            code = http_status(port, path)
            if code == 200:
                return time.monotonic() - t0
            if code in (404, 405):
                raise StackError(
                    f"{run.workload.name}: the rendered readinessProbe GET {path} answers "
                    f"{code}: {run.workload.component} does not serve it"
                )
            if progress is not None and time.monotonic() - last_note >= 5:
                last_note = time.monotonic()
                state = "starting" if code is None else f"probe answers {code}"
                progress(f"  ... {run.workload.name}: {state} ({last_note - t0:.0f}s)")
            time.sleep(0.25)
        raise StackError(
            f"{run.workload.name} not ready within {timeout_s:.0f}s; log {run.log}:\n"
            f"{run.log_tail()}"
        )

    def supervise(self, backoff_s: float = 2.0, cap_s: float = 30.0) -> list[str]:
        """One kubelet pass (``restartPolicy: Always``): restart processes that exited, after a
        backoff doubling per restart. Returns a line per exit or restart."""
        notes = []
        now = time.monotonic()
        for name, run in list(self.running.items()):
            if run.proc.poll() is None:
                continue
            if run.exited_at is None:
                run.exited_at = now
                notes.append(f"{name} exited with {run.proc.returncode}; log {run.log}")
            if now - run.exited_at >= min(cap_s, backoff_s * 2**run.restarts):
                self.start(run.workload, run.restarts + 1, run.hosts)
                notes.append(f"{name} restarted (restart {run.restarts + 1})")
        return notes

    def stop(self, name: str, grace_s: float = 15.0) -> int | None:
        """SIGTERM the process group, SIGKILL after ``grace_s``; returns the exit code."""
        run = self.running.pop(name, None)
        if run is None:
            return None
        return stop_group(run.proc.pid, grace_s, run.proc)

    def close(self, grace_s: float = 30.0) -> None:
        """Stop every process group, the reverse of the start order one component at a time
        (gateway, workers, controller, services: a worker still reaches the controller to
        deregister), the groups of one component together (SIGTERM, SIGKILL after
        ``grace_s``)."""
        runs = list(self.running.values())
        self.running.clear()
        waves: list[list[Running]] = []
        for run in reversed(runs):
            if waves and waves[-1][0].workload.component == run.workload.component:
                waves[-1].append(run)
            else:
                waves.append([run])
        for wave in waves:
            for run in wave:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(run.proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and any(r.proc.poll() is None for r in wave):
                time.sleep(0.1)
            for run in wave:
                if run.proc.poll() is None:
                    logger.warning(
                        "%s ignored SIGTERM for %.0fs: killing", run.workload.name, grace_s
                    )
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(run.proc.pid, signal.SIGKILL)  # stragglers of the group, too
                with contextlib.suppress(subprocess.TimeoutExpired):
                    run.proc.wait(timeout=5)

    def manifest(self) -> dict[str, Any]:
        """What runs (pid, process group, ports, log) and every rewrite of the render; an
        instance a host process serves is listed with that process's ids and log."""
        out: dict[str, Any] = {}
        for name, run in self.running.items():
            for lw in [run.workload, *run.hosts]:
                out[lw.name] = {
                    "pid": run.proc.pid,
                    "pgid": run.proc.pid,
                    "component": lw.component,
                    "argv": lw.argv,
                    "ports": lw.ports,
                    "log": str(run.log),
                    "rewrites": self.rewrites.get(lw.name, []),
                }
                if lw is not run.workload:
                    out[lw.name]["hosted_by"] = name
            if run.hosts:
                out[name]["hosts"] = [lw.name for lw in run.hosts]
        return out

    def endpoints(self) -> dict[str, str]:
        """``name -> http://127.0.0.1:port`` for every workload with an HTTP port (an instance
        a host process serves, by its own port)."""
        return {
            lw.name: f"http://{LOOPBACK}:{lw.ports['http']}"
            for run in self.running.values()
            for lw in [run.workload, *run.hosts]
            if "http" in lw.ports
        }


def pid_alive(pid: int) -> bool:
    """Whether a process (or process group leader) with this id runs. A zombie (exited, not
    yet reaped by its parent: an ``up`` started by ``UpProcess`` until it is waited on) does
    not: ``down`` would otherwise wait its whole grace period for a process that is gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    except OSError:  # no procfs: signal 0 is all there is to go by
        return True
    return stat.rpartition(")")[2].split()[:1] != ["Z"]


def terminate(pid: int, grace_s: float) -> None:
    """SIGTERM one process (a supervisor: it stops its own children) and wait up to
    ``grace_s`` for it to exit."""
    if not pid_alive(pid):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)


def reap(proc: subprocess.Popen[bytes] | None, timeout_s: float) -> int | None:
    """The exit code of a supervisor told to stop (SIGKILL after ``timeout_s``)."""
    if proc is None:
        return None
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(timeout=10)


def stop_group(
    pgid: int, grace_s: float = 15.0, proc: subprocess.Popen[bytes] | None = None
) -> int | None:
    """SIGTERM a process group, SIGKILL it after ``grace_s``; the leader's exit code if ours."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            break
        if proc is None and not pid_alive(pgid):
            break
        time.sleep(0.1)
    else:
        logger.warning("process group %d ignored SIGTERM for %.0fs: killing", pgid, grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)  # stragglers of the group, too
    if proc is None:
        return None
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
    return proc.returncode
