"""Run a cache domain, exactly as the operator renders it, as local processes (no cluster).

Why this module exists: the operator's render is the contract between kvpool's components
(the controller's and the workers' command lines, their environment, the LMCache YAML each
worker mounts). Unit tests of each side cannot show that the two halves of that contract
fit. This launcher takes the rendered objects, changes only what a cluster would provide
and a laptop does not, and starts the controller and worker processes on 127.0.0.1:

- Service and pod DNS names → ``127.0.0.1``; bind address ``0.0.0.0`` → ``127.0.0.1``;
- container ports → free local ports (one map for the whole domain, so every reference to a
  port, in flags, JSON flags, env and LMCache YAML, moves together);
- ConfigMap mounts → temporary files, and the env that points at them;
- ``valueFrom: fieldRef status.podIP`` → ``127.0.0.1``; ``resources.requests.cpu`` →
  ``OMP_NUM_THREADS`` (what the pod's CPU share would do to torch).

``check_rewrite`` then diffs the rendered and the local form independently of the rewrite
code and refuses any change that is not one of those. Anything else a test needs to change
is a named :class:`Deviation` (a known gap in a component, see ``KNOWN_GAPS``), applied only
when the caller allows it and recorded in :attr:`LocalStack.deviations`.

Processes run in their own process group with logs in files; readiness is polled with a
bounded timeout on the rendered readiness probe; ``LocalStack.close`` (also on failure)
sends SIGTERM to every group, then SIGKILL after a grace period. This module is the core of
the future ``make demo``; it lives with the e2e tests until then. What to start (the
rendered workloads, the cluster map, the rewrite and its check) is planned, purely, in
``localplan``; this module adds the known gaps and the processes.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from localplan import (
    LOOPBACK,
    ClusterMap,
    LocalWorkload,
    Obj,
    StackError,
    Workload,
    check_rewrite,
    cluster_map,
    localize,
    render_file,
    workloads,
)

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- known gaps
@dataclass(frozen=True)
class Deviation:
    """A change beyond the cluster rewrites, made only because a component lacks something.

    ``present`` says whether the gap still exists (probed against the installed component,
    so a fixed gap turns the deviation off by itself); ``apply`` edits one local workload.
    """

    key: str
    component: str
    what: str
    present: Callable[[LocalWorkload], bool]
    apply: Callable[[LocalWorkload], None]


def _unknown_controller_flags(lw: LocalWorkload) -> list[str]:
    from kvpool.controller.main import build_parser

    _, unknown = build_parser().parse_known_args(lw.argv[1:])
    return [a for a in unknown if a.startswith("--")]


def _drop_flags(lw: LocalWorkload, flags: Sequence[str]) -> None:
    """Remove each ``--flag value`` pair named in ``flags``."""
    drop = {i + k for i, a in enumerate(lw.argv) if a in flags for k in (0, 1)}
    lw.argv[:] = [a for i, a in enumerate(lw.argv) if i not in drop]


def _worker_refuses_platform(lw: LocalWorkload) -> bool:
    from pydantic import ValidationError

    from kvpool.worker.settings import WorkerSettings

    if "--platform" not in lw.argv:
        return False
    try:
        WorkerSettings(platform=lw.argv[lw.argv.index("--platform") + 1])
    except ValidationError:
        return True
    return False


def _config(lw: LocalWorkload) -> tuple[str, dict[str, Any]]:
    path = lw.env.get("LMCACHE_CONFIG_FILE", "")
    return path, yaml.safe_load(lw.files.get(path, "{}")) or {}


def _set_config(lw: LocalWorkload, **values: Any) -> None:
    path, data = _config(lw)
    data.update(values)
    lw.files[path] = yaml.safe_dump(data, sort_keys=True)


def _reference_refuses_async_loading(lw: LocalWorkload) -> bool:
    """The reference engine's LMCache offload refuses ``enable_async_loading`` (checked in
    ``LMCacheOffload.__init__`` before any engine is built: cheap to probe)."""
    if not _config(lw)[1].get("enable_async_loading"):
        return False
    from kvpool.worker.engine.offload.lmcache_offload import (
        LMCacheOffload,
        OffloadConfigError,
    )

    try:
        LMCacheOffload(
            {"chunk_size": 16, "local_cpu": False, "enable_async_loading": True},
            instance_id="probe",
            num_layers=1,
            num_kv_heads=1,
            head_dim=1,
            block_size=1,
            dtype="none",  # refused right after the async check: no engine is ever built
            model_name="probe",
        )
    except OffloadConfigError as exc:
        return "enable_async_loading" in str(exc)
    return False


def _p2p_without_nixl(lw: LocalWorkload) -> bool:
    import importlib.util

    cfg = _config(lw)[1]
    return bool(cfg.get("enable_p2p")) and importlib.util.find_spec("nixl") is None


KNOWN_GAPS: tuple[Deviation, ...] = (
    Deviation(
        "controller-flags",
        "controller",
        "kvpool-controller does not accept flags the operator renders; they are dropped",
        lambda lw: lw.component == "controller" and bool(_unknown_controller_flags(lw)),
        lambda lw: _drop_flags(lw, _unknown_controller_flags(lw)),
    ),
    Deviation(
        "worker-platform-cpu",
        "worker",
        "kvpool-worker refuses the rendered '--platform cpu' (it knows ascend|cuda); dropped "
        "(the reference engine does not read it)",
        lambda lw: lw.component == "worker" and _worker_refuses_platform(lw),
        lambda lw: _drop_flags(lw, ["--platform"]),
    ),
    Deviation(
        "worker-async-loading",
        "worker",
        "the reference engine refuses the rendered 'enable_async_loading: true' (which the "
        "operator requires for upstream P2P); set to false",
        lambda lw: lw.component == "worker" and _reference_refuses_async_loading(lw),
        lambda lw: _set_config(lw, enable_async_loading=False),
    ),
    Deviation(
        "p2p-needs-nixl",
        "worker",
        "the rendered 'enable_p2p: true' with transfer_channel nixl needs the nixl package, "
        "absent here (and the reference engine's sync lookups cannot use LMCache's async-only P2P "
        "backend); set enable_p2p: false",
        lambda lw: lw.component == "worker" and _p2p_without_nixl(lw),
        lambda lw: _set_config(lw, enable_p2p=False),
    ),
)


def present_gaps(lw: LocalWorkload) -> list[Deviation]:
    return [g for g in KNOWN_GAPS if g.present(lw)]


# --------------------------------------------------------------------------- processes
def base_env() -> dict[str, str]:
    """This process's env without anything a pod's rendered env decides."""
    drop = ("LMCACHE_", "KVPOOL_", "VLLM_", "PYTHONHASHSEED", "POD_IP", "OMP_NUM_THREADS")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def resolve_command(argv0: str) -> str:
    """The console script next to this interpreter (the venv's), else from PATH."""
    local = Path(sys.executable).parent / argv0
    found = str(local) if local.exists() else shutil.which(argv0)
    if found is None:
        raise StackError(f"command {argv0!r} not found: install its component (make install)")
    return found


@dataclass
class Running:
    workload: LocalWorkload
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.workload.ports['http']}"

    def wait_log(self, needle: str, timeout_s: float = 60.0) -> bool:
        """Wait until ``needle`` appears in the log (True) or the process exits without it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            exited = self.proc.poll() is not None
            if needle in self.log.read_text(errors="replace"):
                return True
            if exited:
                return False
            time.sleep(0.2)
        raise StackError(f"{self.workload.name}: {needle!r} not logged within {timeout_s:.0f}s")

    def log_tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""


@dataclass
class LocalStack:
    """A rendered domain run locally. Use as a context manager: ``close`` always runs."""

    objects: list[Obj]
    allow: frozenset[str] = frozenset()  # keys of KNOWN_GAPS the caller accepts
    cluster: ClusterMap | None = None  # share another stack's addresses (same namespace)
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvpool-stack-")))
    cmap: ClusterMap = field(init=False)
    rendered: dict[str, Workload] = field(init=False)
    rewrites: dict[str, list[str]] = field(default_factory=dict)
    deviations: dict[str, list[str]] = field(default_factory=dict)
    running: dict[str, Running] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rendered = workloads(self.objects)
        self.cmap = self.cluster or cluster_map(self.objects)

    def __enter__(self) -> LocalStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def prepare(
        self,
        name: str,
        *,
        edit: Callable[[Workload], None] | None = None,
        gaps: bool = True,
        as_name: str | None = None,
    ) -> LocalWorkload:
        """The local form of one workload, checked against the render.

        ``edit`` changes the rendered form first (a test simulating a hand-edited pod), so
        the rewrite check still covers everything else; ``gaps=False`` applies no deviation
        (to show a gap's failure); ``as_name`` runs it under another process name.
        """
        if name not in self.rendered:
            raise StackError(f"no workload {name!r}; rendered: {sorted(self.rendered)}")
        w = copy.deepcopy(self.rendered[name])
        if edit is not None:
            edit(w)
        lw = localize(w, self.cmap, self.root / (as_name or name))
        lw.name = as_name or name
        self.rewrites[lw.name] = check_rewrite(w, lw, self.cmap)
        applied = []
        for gap in present_gaps(lw) if gaps else []:
            if gap.key not in self.allow:
                raise StackError(
                    f"{name}: known gap {gap.key} ({gap.component}): {gap.what}. "
                    "Pass allow={...} to run with this deviation"
                )
            gap.apply(lw)
            applied.append(f"{gap.key}: {gap.what}")
        self.deviations[lw.name] = applied
        if w.cpu is not None and w.cpu.isdigit():
            lw.env.setdefault("OMP_NUM_THREADS", w.cpu)
        return lw

    def start(self, lw: LocalWorkload) -> Running:
        """Write its files, start it in its own process group, log to ``<root>/<name>.log``."""
        for path, text in lw.files.items():
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text, encoding="utf-8")
        log = self.root / f"{lw.name}.log"
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
        run = Running(lw, proc, log)
        self.running[lw.name] = run
        logger.info("started %s (pid %d), log %s", lw.name, proc.pid, log)
        return run

    def wait_ready(self, run: Running, timeout_s: float = 120.0) -> None:
        """Poll the rendered readiness probe until it answers 200 (bounded).

        A probe path the component does not serve (404/405) fails at once: in a cluster that
        pod would never become Ready.
        """
        if run.workload.readiness is None:
            raise StackError(f"{run.workload.name}: no readiness probe rendered")
        path, port = run.workload.readiness
        deadline = time.monotonic() + timeout_s
        with httpx.Client(base_url=f"http://{LOOPBACK}:{port}", timeout=2.0) as client:
            while time.monotonic() < deadline:
                if run.proc.poll() is not None:
                    raise StackError(
                        f"{run.workload.name} exited with {run.proc.returncode} before it was "
                        f"ready; log {run.log}:\n{run.log_tail()}"
                    )
                with contextlib.suppress(httpx.TransportError):
                    code = client.get(path).status_code
                    if code == 200:
                        return
                    if code in (404, 405):
                        raise StackError(
                            f"{run.workload.name}: the rendered readinessProbe GET {path} "
                            f"answers {code}: {run.workload.component} does not serve it"
                        )
                time.sleep(0.25)
        raise StackError(
            f"{run.workload.name} not ready within {timeout_s:.0f}s; log {run.log}:\n"
            f"{run.log_tail()}"
        )

    def stop(self, name: str, grace_s: float = 15.0) -> int | None:
        """SIGTERM the process group, SIGKILL after ``grace_s``; returns the exit code."""
        run = self.running.pop(name, None)
        if run is None:
            return None
        if run.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(run.proc.pid, signal.SIGTERM)
            try:
                run.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                logger.warning("%s ignored SIGTERM for %.0fs: killing", name, grace_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.proc.pid, signal.SIGKILL)  # stragglers of the group, too
        with contextlib.suppress(subprocess.TimeoutExpired):
            run.proc.wait(timeout=5)
        return run.proc.returncode

    def close(self) -> None:
        for name in reversed(list(self.running)):
            self.stop(name)

    def manifest(self) -> dict[str, Any]:
        """What ran and how it differs from the render: for logs, READMEs and reports."""
        return {
            name: {
                "argv": run.workload.argv,
                "rewrites": self.rewrites.get(name, []),
                "deviations": self.deviations.get(name, []),
                "log": str(run.log),
            }
            for name, run in self.running.items()
        }


def main(argv: Sequence[str] | None = None) -> int:
    """``python e2e/tests/localstack.py -f examples/cpu-demo.yaml``: run until Ctrl-C."""
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("-f", "--filename", required=True, help="KVCachePool (+ members) YAML")
    ap.add_argument(
        "--only",
        default="",
        help="comma-separated workloads (default: controller and every P2P instance)",
    )
    ap.add_argument("--allow-known-gaps", action="store_true", help="apply KNOWN_GAPS deviations")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    allow = frozenset(g.key for g in KNOWN_GAPS)
    try:
        with LocalStack(
            render_file(args.filename), allow=allow if args.allow_known_gaps else frozenset()
        ) as stack:
            names = [n for n in args.only.split(",") if n] or [
                n
                for n, w in stack.rendered.items()
                if w.component == "controller" or (w.component == "worker" and "wrk-0" in w.ports)
            ]
            for name in names:
                run = stack.start(stack.prepare(name))
                stack.wait_ready(run)
                print(f"{name} ready at {run.url}", flush=True)
            print(json.dumps(stack.manifest(), indent=1), flush=True)
            print("running; Ctrl-C stops every process", flush=True)
            stop = threading.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: stop.set())
            while not stop.wait(1.0):
                pass
    except StackError as exc:
        print(f"localstack: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
