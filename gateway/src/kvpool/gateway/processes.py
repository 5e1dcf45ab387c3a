"""``kvpool-gateway serve --workers N``: N gateway processes on one port, one per core.

Why this module exists: one Python process serves one core's worth of requests; a Rust
router in front of the same pool uses every core. With ``--workers N`` the command starts N
processes that each bind the port with ``SO_REUSEPORT`` (the kernel spreads connections over
their accept queues) and each build their whole state: their own index replica following the
controller's delta stream, their own probes, breakers, load and admission counts. The parent
only supervises: it forwards SIGTERM/SIGINT to every process and waits for them; if one dies,
it stops the others and exits with its code (the pod restarts, as with one process). A
supervisor killed outright takes its processes with it (Linux's parent-death signal).

What is per process with ``N > 1``: ``limits.maxInflight``/``maxQueue`` and the rate limit
(each process admits its own share), ``/metrics`` (a scrape sees the process that answered)
and the session memory of ``/memory`` (a session's latest prompt is known to the process that
served it). PD pairs need one process: LMCache's senders notify a pair's one proxy port.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import socket
import sys
from collections.abc import Callable
from multiprocessing.connection import wait
from types import FrameType

#: What a worker process runs: ``serve_on(sock)`` serves on the bound socket until stopped.
ServeOn = Callable[[socket.socket], None]


def workers_for(requested: int) -> int:
    """``--workers``: a positive count, or 0 for one per CPU core."""
    if requested < 0:
        raise ValueError(f"--workers: {requested} is not a process count (0: one per core)")
    return requested or os.cpu_count() or 1


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` with ``SO_REUSEPORT`` (not yet listening)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def check_port_free(host: str, port: int) -> None:
    """Raise ``OSError`` naming the port when something listens there already (a plain bind,
    so another group of ``SO_REUSEPORT`` sockets is not joined silently)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise OSError(f"--port {port}: cannot bind {host}:{port} ({exc.strerror})") from None


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent(parent: int) -> None:
    """On Linux, have the kernel send SIGTERM to this process when the supervisor dies: a
    supervisor killed with SIGKILL (no chance to forward it) leaves no process serving the port
    behind it. Elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        return
    if os.getppid() != parent:  # the supervisor died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def _run_worker(serve_on: ServeOn, host: str, port: int, parent: int) -> None:
    _die_with_parent(parent)
    serve_on(reuse_port_socket(host, port))


def supervise(serve_on: ServeOn, host: str, port: int, workers: int) -> int:
    """Run ``workers`` processes serving ``host:port``; the exit code of the first that
    stopped unasked (0 when every one stopped after SIGTERM/SIGINT)."""
    check_port_free(host, port)
    ctx = multiprocessing.get_context("spawn")  # no event loop, threads or sockets inherited
    procs = [
        ctx.Process(
            target=_run_worker, args=(serve_on, host, port, os.getpid()), name=f"gateway-{n}"
        )
        for n in range(workers)
    ]
    stopping = False

    def stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        for p in procs:
            if p.pid is not None and p.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for p in procs:
            p.start()
        code = 0
        alive = list(procs)
        while alive:
            ready = wait([p.sentinel for p in alive])
            for p in [p for p in alive if p.sentinel in ready]:
                p.join()
                alive.remove(p)
                if not stopping:  # one died: the others stop too, the pod restarts
                    code = p.exitcode or 1
                    print(
                        f"kvpool-gateway: process {p.name} exited with {p.exitcode}; stopping",
                        file=sys.stderr,
                    )
                    stop(signal.SIGTERM, None)
        return code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
