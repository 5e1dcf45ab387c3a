"""The faults the chaos suite injects into a domain that ``kvpool-operator up`` runs.

Why this module exists: each fault is one thing that happens to a pod in production, done to
the real process through ``up``'s state file (every process group, its ports, its log) and
undone the way a cluster would undo it:

- ``kill``: SIGKILL to the process group (no SIGTERM, no deregistration, nothing flushed); ``up``
  restarts it after its backoff with the same command and ports, as a kubelet would;
- ``freeze``: SIGSTOP to the group for ``hold_s`` (a hung node: its sockets stay open, nothing
  answers, its heartbeats stop), then SIGCONT;
- ``cut``: its TCP ports partitioned for ``hold_s`` (:class:`netns.Cut`), then healed.

A fault is back when every target runs (a new process group after a kill) and answers its
rendered readiness probe, or listens on its first port when it has none (Redis, Mooncake).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from chaos.netns import Cut
from kvpool.operator.local.plan import Workload

Kind = Literal["kill", "freeze", "cut"]


@dataclass(frozen=True)
class Fault:
    """One fault: what it does, to which processes (names in ``up``'s state), for how long."""

    name: str
    kind: Kind
    targets: tuple[str, ...]
    hold_s: float = 0.0  # freeze and cut: how long before it is undone
    what: str = ""  # what it stands for, in the report


@dataclass
class Injected:
    """A fault in progress: the groups it hit and what undoes it."""

    fault: Fault
    pgids: dict[str, int]
    cuts: list[Cut] = field(default_factory=list)
    frozen: list[int] = field(default_factory=list)
    ports: dict[str, list[int]] = field(default_factory=dict)


def inject(fault: Fault, state: Mapping[str, Any]) -> Injected:
    """Do ``fault`` to its targets (their current process groups in ``state``)."""
    pgids = {name: int(state["processes"][name]["pgid"]) for name in fault.targets}
    done = Injected(fault, pgids)
    for name, pgid in pgids.items():
        if fault.kind == "kill":
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        elif fault.kind == "freeze":
            os.killpg(pgid, signal.SIGSTOP)
            done.frozen.append(pgid)
        else:
            cut = Cut(name, pgid)
            done.cuts.append(cut)
            done.ports[name] = sorted(cut.cut())
    return done


def heal(done: Injected) -> None:
    """Undo a freeze or a cut (a kill is undone by ``up``); safe to call twice."""
    for pgid in done.frozen:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGCONT)
    done.frozen.clear()
    for cut in done.cuts:
        cut.heal()


def _listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1.0):
        return True
    return False


def _probe(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url, timeout=2.0).status_code == 200
    return False


def ready(name: str, state: Mapping[str, Any], rendered: Mapping[str, Workload]) -> bool:
    """``name`` answers its rendered readiness probe, or listens on its first port."""
    proc = state["processes"].get(name)
    if proc is None:
        return False
    w = rendered.get(name)
    if w is not None and w.readiness is not None:
        path, _ = w.readiness
        return _probe(f"{state['endpoints'][name]}{path}")
    ports = list(proc["ports"].values())
    return bool(ports) and _listening(int(ports[0]))


def is_back(done: Injected, state: Mapping[str, Any], rendered: Mapping[str, Workload]) -> bool:
    """Every target runs again (a new process group after a kill) and is ready."""
    for name, pgid in done.pgids.items():
        proc = state["processes"].get(name)
        if proc is None or (done.fault.kind == "kill" and int(proc["pgid"]) == pgid):
            return False
        if not ready(name, state, rendered):
            return False
    return True


def wait(seconds: float, stop: Any = None) -> None:
    """Sleep in short steps (``stop``: an Event that ends it early)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not (stop is not None and stop.is_set()):
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
