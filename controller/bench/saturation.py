"""The controller benchmark's socket runs against either controller: saturation with LMCache's
message mix, and P2P lookup latency at an equal offered load.

Why a module of its own: ``run.py`` drives the whole benchmark (LMCache's own tool, capacity,
recovery, the index); these two runs start the load generator's processes
(``loadgen.py``), wait for them and turn their JSON into the figures the issue names.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Protocol

import httpx

HERE = Path(__file__).resolve().parent
PY = sys.executable
ENV = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "PYTHONHASHSEED": "0"}


class Target(Protocol):
    """What the runs need of a controller process (``run.Controller``)."""

    kind: str
    http: int
    ports: dict[str, int]

    def cpu_seconds(self) -> float: ...


def _loadgen(role: str, ctl: Target, extra: list[str]) -> subprocess.Popen[bytes]:
    cmd = [
        PY, str(HERE / "loadgen.py"), "--role", role, "--pull", str(ctl.ports["pull"]),
        "--reply", str(ctl.ports["reply"]), "--heartbeat", str(ctl.ports["heartbeat"]), *extra,
    ]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, env=ENV)


def _result(proc: subprocess.Popen[bytes], timeout: float) -> dict[str, Any]:
    out = proc.communicate(timeout=timeout)[0].decode().strip().splitlines()
    if proc.returncode != 0 or not out:
        raise RuntimeError(f"load generator exited {proc.returncode}")
    return dict(json.loads(out[-1]))


def run_saturated(ctl: Target, params: dict[str, Any], procs: int) -> dict[str, float]:
    """``procs`` blast processes (``loadgen.py``) with LMCache's message mix, all pre-encoded:
    controller-bound msgs/s (a batch counts its events, a lookup its hashes) and its CPU use."""
    start_at = time.time() + (6.0 if params["batches"] < 1000 else 12.0)
    common = [
        "--start-at", str(start_at), "--instances", str(params["instances"]),
        "--keys", str(params["keys"]), "--batch", str(params["batch"]),
        "--batches", str(params["batches"]),
    ]  # fmt: skip
    blasters = [_loadgen("blast", ctl, [*common, "--id", str(i)]) for i in range(procs)]
    while time.time() < start_at:
        time.sleep(0.005)
    cpu0 = ctl.cpu_seconds()
    outs = [_result(b, 900) for b in blasters]
    t0 = min(o["t0"] for o in outs)
    t_done = max(o["t_done"] for o in outs)
    cpu = ctl.cpu_seconds() - cpu0
    msgs = sum(o["msgs"] for o in outs)
    return {
        "msgs_per_s": msgs / (t_done - t0),
        "events_per_s": sum(o["events"] for o in outs) / (t_done - t0),
        "send_msgs_per_s": msgs / (max(o["t_sent"] for o in outs) - t0),
        "controller_cpu_util": cpu / (t_done - t0),
        "msgs_per_controller_cpu_s": msgs / max(cpu, 1e-9),
        "msgs": msgs,
    }


def _server_p2p_p95_ms(ctl: Target) -> float | None:
    """Upper bound of the p95 of our controller's own P2P handling time (its
    ``lookup_seconds{kind="p2p"}`` histogram), to split a client's latency into the
    controller's work and everything around it (sockets, waiting for a CPU)."""
    text = httpx.get(f"http://127.0.0.1:{ctl.http}/metrics", timeout=10).text
    found = re.findall(
        r'kvpool_controller_lookup_seconds_bucket\{kind="p2p",le="([^"]+)"\} ([\d.e+]+)', text
    )
    buckets = [(float(le), float(n)) for le, n in found]
    if not buckets or buckets[-1][1] == 0:
        return None
    total = buckets[-1][1]
    return next(le for le, n in buckets if n >= 0.95 * total) * 1e3


def run_equal_load(
    ctl: Target, params: dict[str, Any], rate: float, lookups_per_s: float, logdir: Path
) -> dict[str, float]:
    """P2P lookup latency at one offered load for every controller: a background process
    offers ``rate`` admit/evict events/s while another paces P2P lookups."""
    start_at = time.time() + 5.0
    stop = logdir / f"stop-eq-{ctl.kind}-{ctl.http}"
    common = [
        "--start-at", str(start_at), "--instances", str(params["instances"]),
        "--keys", str(params["keys"]), "--batch", str(params["batch"]),
    ]  # fmt: skip
    bg = _loadgen(
        "background",
        ctl,
        [*common, "--rate", str(rate), "--duration", str(params["duration"])],
    )
    looker = _loadgen(
        "lookup", ctl, [*common, "--rate", str(lookups_per_s), "--stop-file", str(stop)]
    )
    offered = _result(bg, 600)
    stop.touch()
    looked = _result(looker, 120)
    server = _server_p2p_p95_ms(ctl) if ctl.kind == "ours" else None
    return {
        **({"p2p_lookup_server_p95_ms": server} if server is not None else {}),
        "offered_events_per_s": offered["events_per_s"],
        "p2p_lookup_p50_ms": looked["p50_ms"],
        "p2p_lookup_p95_ms": looked["p95_ms"],
        "p2p_lookup_p99_ms": looked["p99_ms"],
        "lookups": looked["lookups"],
    }
