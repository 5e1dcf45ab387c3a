"""``python -m chaos.freeze`` (from e2e/): the stores LMCache drops in its full-sync freeze
after a controller restart, with LMCache's own full-sync timing (before) and kvpool's (after).

Why this module exists: a controller of one replica that restarts has lost its index, so every
worker resends its keys (LMCache's full sync) and drops every store until a status poll finds
its sync complete (the freeze): those prompts are computed and not kept. kvpool renders a
shorter timing (``spec.controller.fullSync``, 0.5 s and 0.5 s against LMCache's 5 s and 5 s)
and its gateway leaves a worker whose ``/readyz`` says frozen out of the candidates; this
measures what both change on the real domain.

Each arm is one ``kvpool-operator up`` of ``examples/cpu-demo.yaml`` (two P2P reference workers
with the real LMCache 0.5.6, full-sync recovery, the PD pair idle) with one controller replica
(a restart then loses the index) and one gateway: ``after`` with the spec's default timing;
``before`` naming LMCache's timing in ``spec.controller.fullSync`` (a user's spec, rendered as
any other: the render is never patched). A steady stream of mostly new prompts (a tenant's
2-chunk prefix and one of 500 questions per tenant: nearly every request stores a chunk) goes
through the gateway (the chaos suite's client, :mod:`chaos.workload`); after a warm-up the
controller is SIGKILLed (:mod:`chaos.faults`, through ``up``'s state file; ``up`` restarts it)
``--kills`` times, each time waiting until every worker's freeze has ended, then ``--settle``
seconds more. The gateway's ``/readyz`` is sampled every 0.1 s; each worker's log gives its
freezes and skipped stores to the millisecond; :mod:`chaos.freeze_measure` turns them into the
figures. The gateway's avoidance has no switch: it is on in both arms, and what it did is
counted (requests kept off a worker while it was frozen, and after it had thawed, the seconds
it listed a worker frozen) beside what it missed (requests that reached a frozen worker).

Runs in a network namespace of its own like the suite (:mod:`chaos.netns`: the domain's fixed
ports do not meet another checkout's); bench-results/freeze.json and freeze.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from chaos import entry, netns
from chaos import faults as fx
from chaos import freeze_measure as fm
from chaos.suite import LoopThread
from chaos.workload import TIMEOUT_S, StreamSpec, build_stream, write_trace
from kvpool.gateway.loadgen import Replay
from kvpool.operator.api import P2PGroup
from kvpool.operator.loader import load_text
from kvpool.operator.local.plan import workloads
from kvpool.operator.local.up import UpProcess, render_files
from kvpool.operator.render import lmcache_configs

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples" / "cpu-demo.yaml"
CONTROLLER, GATEWAY = "demo-controller", "demo-gateway"
WORKERS = ("demo-p2p-0", "demo-p2p-1")
#: lmcache 0.5.6 FullSyncSender's defaults (full_sync_startup_delay_s, ..._status_poll_interval_s)
LMCACHE_TIMING = {"startupDelaySeconds": 5.0, "statusPollIntervalSeconds": 5.0}
STREAM = StreamSpec("freeze", "demo", GATEWAY, rate=1.0, tenants=4, questions=500,
                    system_blocks=2, question_blocks=2, block=256, output_tokens=8,
                    warm=False)  # fmt: skip
SAMPLE_S = 0.1
PRE_S, WINDOW_S = 20.0, 6.0  # the hit ratio before a kill, and the windows after it

Say = Callable[[str], None]


@dataclass(frozen=True)
class Arm:
    name: str
    what: str
    file: Path


def arms(workdir: Path) -> list[Arm]:
    """Both arms' domain files, written from cpu-demo's: one controller replica (so a restart
    loses the index and needs a full sync; with two the standby takes over without one) and one
    gateway (the one whose /readyz is sampled is the one that routes); ``before`` also names
    LMCache's full-sync timing in ``spec.controller.fullSync``."""
    out = []
    for name, what, timing in (
        ("before", "LMCache's full-sync timing (spec.controller.fullSync 5 s / 5 s)", True),
        ("after", "kvpool's default full-sync timing (cpu-demo's spec)", False),
    ):
        docs = list(yaml.safe_load_all(DEMO.read_text(encoding="utf-8")))
        for doc in docs:
            if doc["kind"] == "KVCachePool":
                spec = doc["spec"]
                spec.setdefault("controller", {})["replicas"] = 1
                spec.setdefault("gateway", {})["replicas"] = 1
                if timing:
                    spec["controller"]["fullSync"] = dict(LMCACHE_TIMING)
        path = workdir / f"cpu-demo-{name}.yaml"
        path.write_text(yaml.safe_dump_all(docs, sort_keys=False), encoding="utf-8")
        out.append(Arm(name, what, path))
    return out


class GatewaySampler(threading.Thread):
    """Every ``SAMPLE_S``: which instances the gateway's ``/readyz`` lists ready and frozen
    (None when it did not answer)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.samples: list[tuple[float, frozenset[str] | None]] = []
        self._halt = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=1.0) as client:
            while not self._halt.is_set():
                t = time.monotonic()
                frozen: frozenset[str] | None = None
                with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
                    insts = client.get(f"{self.url}/readyz").json()["instances"]
                    frozen = frozenset(n for n, i in insts.items() if i["ready"] and i["frozen"])
                self.samples.append((t, frozen))
                self._halt.wait(max(0.0, t + SAMPLE_S - time.monotonic()))

    def stop(self) -> None:
        self._halt.set()
        self.join(5)


def _metric(url: str, pattern: str) -> float | None:
    """The first value of a Prometheus line matching ``pattern`` at ``url``/metrics."""
    with contextlib.suppress(httpx.HTTPError):
        text = httpx.get(f"{url}/metrics", timeout=5).text
        m = re.search(rf"^{pattern}\s+(\S+)$", text, re.MULTILINE)
        return None if m is None else float(m.group(1))
    return None


def _exits(log: Path) -> int:
    return log.read_text(errors="replace").count("Exiting freeze mode")


def _until(cond: Callable[[], bool], timeout_s: float, alive: Callable[[], None]) -> float | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive()
        with contextlib.suppress(OSError, KeyError, ValueError, httpx.HTTPError):
            if cond():
                return time.monotonic()
        time.sleep(0.2)
    return None


@dataclass(frozen=True)
class Bounds:
    warm_s: float
    kills: int
    settle_s: float
    sync_timeout_s: float = 90.0


@dataclass
class Kill:
    """One controller kill on the monotonic clock: when the controller answered its probe
    again, when every worker had thawed, when its window ended; full syncs the restarted
    controller completed by then (its /metrics)."""

    at: float
    back: float | None = None
    synced: float | None = None
    end: float = 0.0
    syncs: float | None = None


class ArmRun:
    """One ``up`` of an arm's file under the stream, ``bounds.kills`` controller kills."""

    def __init__(self, arm: Arm, workdir: Path, bounds: Bounds, say: Say) -> None:
        self.arm, self.bounds, self.say = arm, bounds, say
        self.dir = workdir / arm.name
        self.up = UpProcess([str(arm.file)], self.dir / "up")
        self.rendered = workloads(render_files([arm.file]).objects)
        self.logs: dict[str, Path] = {}
        self.kills: list[Kill] = []

    def execute(self) -> dict[str, Any]:
        arm, t_start = self.arm, time.monotonic()
        load = {"start": os.getloadavg()[0]}
        loop: LoopThread | None = None
        sampler: GatewaySampler | None = None
        replay: Replay | None = None
        try:
            self.say(f"freeze: {arm.name}: {arm.what}: kvpool-operator up -f {arm.file}")
            state = self.up.start(600)
            self.say(f"freeze: {arm.name}: ready after {time.monotonic() - t_start:.0f}s")
            wall_to_mono = time.time() - time.monotonic()
            self.logs = {w: Path(state["processes"][w]["log"]) for w in WORKERS}
            url = state["endpoints"][GATEWAY]
            model = str(httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"])
            trace = write_trace(self.dir / "trace.jsonl", STREAM.rows(1800.0))
            loop = LoopThread()
            replay = build_stream(STREAM, trace, model).start(url)
            run = loop.submit(replay.run())
            sampler = GatewaySampler(url)
            sampler.start()
            self.say(
                f"freeze: {arm.name}: {STREAM.rate} req/s on, warm-up {self.bounds.warm_s:.0f}s"
            )
            time.sleep(self.bounds.warm_s)
            for k in range(self.bounds.kills):
                self._kill(k)
            skipped_metric = {
                w: _metric(state["endpoints"][w], r"kvpool_engine_store_skipped_frozen_tokens\S*")
                for w in WORKERS
            }
            loop.call(replay.finish)
            run.result(timeout=TIMEOUT_S + 30)
            texts = {w: p.read_text(errors="replace") for w, p in self.logs.items()}
        finally:
            if sampler is not None:
                sampler.stop()
            if loop is not None:
                if replay is not None:
                    loop.call(replay.stop)
                loop.close()
            self.say(f"freeze: {arm.name}: stopping every process")
            self.up.stop()
        load["end"] = os.getloadavg()[0]
        wlogs = {
            w: fm.parse_worker_log(t, wall_to_mono, time.monotonic()) for w, t in texts.items()
        }
        reqs = [
            fm.Req(o.instance or "", replay.t0 + o.sent_s, replay.t0 + o.sent_s + (o.ttft_s or 0.0),
               replay.t0 + o.sent_s + (o.e2e_s or 0.0), o.prompt_tokens or 0, o.cached_tokens or 0)
            for o in replay.outcomes if o.error is None and o.prompt_tokens
        ]  # fmt: skip
        known = fm.known_frozen(sampler.samples)
        figures = [self._figures(k, wlogs, known, reqs) for k in self.kills]

        def rel(spans: list[fm.Interval]) -> list[list[float]]:  # seconds from the replay's start
            return [[round(a - replay.t0, 3), round(b - replay.t0, 3)] for a, b in spans]

        return {
            "name": arm.name,
            "what": arm.what,
            "file": str(arm.file),
            "timing": rendered_timing(arm.file),
            "summary": fm.arm_summary(figures),
            "kills": figures,
            "stores_skipped_whole_run": {w: len(x.skipped) for w, x in wlogs.items()},
            "tokens_skipped_metric": skipped_metric,
            "requests_total": len(replay.outcomes),
            "requests": [
                {
                    "instance": o.instance,
                    "sent_s": round(o.sent_s, 3),
                    "ttft_s": o.ttft_s,
                    "e2e_s": o.e2e_s,
                    "error": o.error,
                    "prompt_tokens": o.prompt_tokens,
                    "cached_tokens": o.cached_tokens,
                }
                for o in replay.outcomes
            ],
            "kill_at_s": [round(k.at - replay.t0, 3) for k in self.kills],
            "freezes_s": {w: rel(x.freezes) for w, x in wlogs.items()},
            "skipped_stores": {
                w: [[round(t - replay.t0, 3), n] for t, n in x.skipped] for w, x in wlogs.items()
            },
            "gateway_listed_frozen_s": {w: rel(spans) for w, spans in known.items()},
            "request_errors": dict(Counter(o.error for o in replay.outcomes if o.error)),
            "request_error_examples": {o.error: o.detail[:200] for o in replay.outcomes if o.error},
            "env": {
                "loadavg": load,
                "cpus": os.cpu_count(),
                "duration_s": round(time.monotonic() - t_start, 1),
            },
        }

    def _alive(self) -> None:
        proc = self.up.proc
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"kvpool-operator up exited ({proc.returncode})")

    def _thawed_since(self, exits: dict[str, int]) -> bool:
        return all(_exits(p) > exits[w] for w, p in self.logs.items())

    def _kill(self, k: int) -> None:
        exits = {w: _exits(p) for w, p in self.logs.items()}
        kill = Kill(time.monotonic())
        done = fx.inject(fx.Fault("controller-kill", "kill", (CONTROLLER,)), self.up.state())
        kill.back = _until(
            lambda: fx.is_back(done, self.up.state(), self.rendered), 120.0, self._alive
        )
        kill.synced = _until(
            lambda: self._thawed_since(exits), self.bounds.sync_timeout_s, self._alive
        )
        time.sleep(self.bounds.settle_s)
        kill.end = time.monotonic()
        curl = self.up.state()["endpoints"][CONTROLLER]
        kill.syncs = _metric(curl, r'kvpool_controller_full_syncs_total\{outcome="completed"\}')
        self.kills.append(kill)
        self.say(
            f"freeze: {self.arm.name}: kill {k + 1}: controller back after "
            f"{_after(kill.back, kill.at)}, every worker thawed after "
            f"{_after(kill.synced, kill.at)}, full syncs completed {kill.syncs}"
        )

    @staticmethod
    def _figures(
        k: Kill,
        wlogs: dict[str, fm.WorkerLog],
        known: dict[str, list[fm.Interval]],
        reqs: list[fm.Req],
    ) -> dict[str, Any]:
        f = fm.kill_figures(k.at, k.end, wlogs, known, reqs)
        f.update(fm.dip(reqs, k.at, k.end, PRE_S, WINDOW_S))
        f["controller_back_s"] = None if k.back is None else round(k.back - k.at, 2)
        f["workers_thawed_s"] = None if k.synced is None else round(k.synced - k.at, 2)
        f["controller_full_syncs_completed"] = k.syncs
        return f


def _after(t: float | None, t0: float) -> str:
    return "never" if t is None else f"{t - t0:.1f}s"


def rendered_timing(file: Path) -> dict[str, float]:
    """The full-sync keys of the first P2P worker's rendered LMCache config (extra_config)."""
    loaded = load_text(file.read_text(encoding="utf-8"), file.name)
    for domain in loaded.domains():
        for member in domain.members:
            if isinstance(member, P2PGroup):
                extra = next(iter(lmcache_configs(domain.pool, member).values()))["extra_config"]
                return {k: float(v) for k, v in extra.items() if k.startswith("full_sync_")}
    raise LookupError(f"{file}: no P2PGroup, so no LMCache config that full-syncs")


def _parser() -> argparse.ArgumentParser:
    doc = (__doc__ or "").split("\n\n")[0]
    p = argparse.ArgumentParser(prog="python -m chaos.freeze", description=doc)
    p.add_argument("--out", type=Path, default=Path("../bench-results/freeze.json"))
    p.add_argument("--workdir", type=Path, help="state and logs (default: a temporary dir)")
    p.add_argument("--kills", type=int, default=3, help="controller kills per arm (default 3)")
    p.add_argument("--warm", type=float, default=25.0, help="seconds of load before a kill")
    p.add_argument("--settle", type=float, default=8.0, help="seconds after every worker thawed")
    p.add_argument("--arm", choices=("before", "after"), action="append",
                   help="this arm (repeatable, in order; default both, before first)")  # fmt: skip
    p.add_argument("--no-netns", action="store_true", help="stay in this network namespace")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    status = entry.enter_namespace(
        "chaos.freeze", argv, args.no_netns, {"LMCACHE_TRACK_USAGE": "false"}
    )
    if status is not None:
        return status
    if netns.in_namespace():
        netns.setup(with_lan=True)
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    entry.interrupt_on_sigterm()
    bounds = Bounds(warm_s=args.warm, kills=args.kills, settle_s=args.settle)
    out = args.out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"component": "freeze", "arms": [], "stream": STREAM.__dict__}
    with tempfile.TemporaryDirectory(prefix="kvpool-freeze-") as tmp:
        workdir = (args.workdir or Path(tmp)).resolve()
        workdir.mkdir(parents=True, exist_ok=True)
        by_name = {a.name: a for a in arms(workdir)}
        for name in args.arm or list(by_name):  # in the order given: the box's load drifts
            arm = by_name[name]
            try:
                doc["arms"].append(ArmRun(arm, workdir, bounds, entry.say).execute())
            except KeyboardInterrupt:
                entry.say("freeze: interrupted; every process stopped")
                return 130
            # each arm as it ends: a later arm that fails leaves this one's figures
            out.write_text(json.dumps(doc, indent=1, default=str) + "\n", encoding="utf-8")
    table = fm.markdown(doc["arms"])
    out.with_suffix(".md").write_text(table, encoding="utf-8")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
