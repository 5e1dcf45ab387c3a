"""Fixtures that start real processes on free 127.0.0.1 ports and always stop them.

- ``controllers``: a factory of our controller as a subprocess (``python -m
  kvpool.controller.main``), restartable on the same ports, killed in teardown.
- ``redis_server``: Debian's ``redis-server`` on a free port, no persistence, killed in teardown.
- ``lmcache_procs``: stock LMCache worker processes (``lmcache_side.py``), SIGKILL-able.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest


def _disarm_lmcache_otel_handler() -> None:
    """LMCache adds OpenTelemetry's ``LoggingHandler`` to every logger it creates. With no
    provider configured it forwards nothing, but its non-reentrant lock deadlocks when a
    garbage-collected LMCache object (a ``MemoryObj`` or a pending task) logs from a finaliser
    that runs inside another emit — seen here as a hang at the end of the session. Tests
    replace the class before LMCache is imported; the console handler stays.
    """
    try:
        import opentelemetry.sdk._logs as otel_logs
    except ImportError:
        return

    class _Inert(logging.NullHandler):
        def __init__(self, level: int = logging.NOTSET, logger_provider: Any = None) -> None:
            super().__init__(level)

    otel_logs.LoggingHandler = _Inert  # type: ignore[misc, assignment]


_disarm_lmcache_otel_handler()

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
PYTHON = sys.executable
ENV = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "PYTHONHASHSEED": "0"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(pred: Any, timeout: float = 15.0, every: float = 0.05, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or pred}")
        time.sleep(every)


class ControllerProc:
    """Our controller in a subprocess; ``restart`` reuses the same ports."""

    def __init__(
        self, extra: list[str], tmp: Path, heartbeat: bool = True, env: dict[str, str] | None = None
    ) -> None:
        self.env = {**ENV, **(env or {})}
        self.ports = {"pull": free_port(), "reply": free_port()}
        if heartbeat:
            self.ports["heartbeat"] = free_port()
        self.http_port = free_port()
        self.extra = extra
        self.log = tmp / f"controller-{self.http_port}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = f"http://127.0.0.1:{self.http_port}"

    def start(self) -> ControllerProc:
        args = [
            PYTHON, "-m", "kvpool.controller.main", "--host", "127.0.0.1",
            "--port", str(self.http_port), "--monitor-ports", json.dumps(self.ports), *self.extra,
        ]  # fmt: skip
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        wait_until(self._ready, 20.0, what=f"controller on {self.url} (log {self.log})")
        return self

    def _ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"controller exited: {self.log.read_text()[-2000:]}")
        try:
            return httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def terminate(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(15)

    def post(self, path: str, body: dict[str, Any]) -> Any:
        r = httpx.post(f"{self.url}{path}", json=body, timeout=10)
        r.raise_for_status()
        return r.json()

    def hits(self, hashes: list[int]) -> dict[str, int]:
        out = self.post("/v1/prefix_lookup", {"hashes": hashes})["instances"]
        return {inst: v["hit_chunks"] for inst, v in out.items()}

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and not line.startswith("#"):
                total += float(line.rsplit(" ", 1)[1])
        return total


@pytest.fixture
def controllers(tmp_path: Path) -> Iterator[Any]:
    started: list[ControllerProc] = []

    def make(
        *extra: str, heartbeat: bool = True, env: dict[str, str] | None = None
    ) -> ControllerProc:
        c = ControllerProc(list(extra), tmp_path, heartbeat, env)
        started.append(c)
        return c.start()

    yield make
    for c in started:
        c.kill()


def start_redis(port: int, workdir: Path) -> subprocess.Popen[bytes]:
    """Debian's redis-server on 127.0.0.1:port without persistence; waits until it answers."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip

    def ping() -> bool:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
        return False

    wait_until(ping, 10.0, what="redis-server")
    return proc


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[dict[str, Any]]:
    port = free_port()
    info: dict[str, Any] = {"url": f"redis://127.0.0.1:{port}/0", "port": port, "dir": tmp_path}
    info["proc"] = start_redis(port, tmp_path)
    yield info
    info["proc"].kill()
    info["proc"].wait(10)


@pytest.fixture
def lmcache_procs(tmp_path: Path) -> Iterator[Any]:
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(instance: str, ports: dict[str, int], admit: list[int]) -> subprocess.Popen[bytes]:
        log = open(tmp_path / f"worker-{instance}.log", "wb")  # noqa: SIM115 - closed by the process end
        proc = subprocess.Popen(
            [PYTHON, str(HERE / "lmcache_side.py"), "--instance", instance, "--ports",
             json.dumps(ports), "--worker-port", str(free_port()),
             "--admit", ",".join(map(str, admit))],
            stdout=subprocess.PIPE, stderr=log, env=ENV,
        )  # fmt: skip
        procs.append(proc)
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        line = proc.stdout.readline() if ready else b"(no output in 60 s)"
        assert line.strip() == b"READY", (tmp_path / f"worker-{instance}.log").read_text()[-3000:]
        return proc

    yield spawn
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
