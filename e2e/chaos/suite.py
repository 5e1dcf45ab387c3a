"""The chaos run: bring the domains up, keep the load on, inject each fault in turn, measure.

Why this module exists: the order of a run is the experiment. ``kvpool-operator up`` runs the
domain files as it would for a user; every stream's replay runs on one event loop in a thread
of its own, open loop, while this thread drives the faults one at a time, each after the
previous one is over:

1. warm-up: every stream's prompts once, then ``steady_s`` of steady load (the hit ratio
   every fault is compared with, and the fault-free answers);
2. per fault: inject, hold (freeze, cut), undo, wait until the targets are back (bounded by
   ``back_timeout_s``), then until every stream of the fault's domains is back at 90 % of its
   pre-fault hit ratio (bounded by ``recovery_cap_s``), then ``gap_s`` of quiet;
3. the replays stop sending and what is in flight answers; prompts that were never answered
   outside a fault get one fault-free request each;
4. the verdict (:mod:`chaos.measure`), the JSON and the table.

Whatever happens (an error, Ctrl-C, SIGTERM), a frozen process is thawed, a cut healed, the
replays stopped and ``up`` brought down with everything it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import platform
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from chaos import faults as fx
from chaos import measure
from chaos.workload import (
    RETRIES,
    TIMEOUT_S,
    Stream,
    StreamSpec,
    build_stream,
    write_trace,
)
from kvpool.gateway.loadgen import ReplayRun
from kvpool.operator.local.plan import Workload, workloads
from kvpool.operator.local.up import UpProcess, render_files


@dataclass(frozen=True)
class Plan:
    """One run: the domains, the load, the faults in order, and the bounds."""

    files: tuple[Path, ...]
    streams: tuple[StreamSpec, ...]
    faults: tuple[fx.Fault, ...]
    fault_domains: dict[str, tuple[str, ...]]  # fault name -> domains whose streams it hits
    steady_s: float = 15.0
    back_timeout_s: float = 180.0
    recovery_cap_s: float = 45.0
    gap_s: float = 3.0
    reduced: bool = False
    sim_trace: Path | None = None  # a Mooncake file for the simulated fleet's stream
    sim_time_scale: float = 1.0


Say = Callable[[str], None]


class LoopThread:
    """An asyncio loop in a daemon thread: the replays run there, this thread drives."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def submit(self, coro: Any) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, fn: Callable[[], None]) -> None:
        self.loop.call_soon_threadsafe(fn)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _model(url: str) -> str:
    return str(httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"])


def _controllers(state: dict[str, Any], domains: Sequence[str]) -> dict[str, Any]:
    """Each domain controller's /readyz body (workers, chunk-locations, Redis), or the error."""
    out: dict[str, Any] = {}
    for d in domains:
        url = state["endpoints"].get(f"{d}-controller")
        try:
            out[d] = httpx.get(f"{url}/readyz", timeout=3).json()
        except (httpx.HTTPError, ValueError, TypeError) as exc:
            out[d] = f"{type(exc).__name__}: {exc}"
    return out


class Run:
    """One chaos run (see the module docstring); ``execute`` returns the report."""

    def __init__(self, plan: Plan, workdir: Path, say: Say) -> None:
        self.plan = plan
        self.workdir = workdir
        self.say = say
        self.up = UpProcess([str(f) for f in plan.files], workdir / "up")
        self.rendered: dict[str, Workload] = workloads(render_files(plan.files).objects)
        self.streams: list[Stream] = []
        self.runs: dict[str, Future[ReplayRun]] = {}
        self.loop: LoopThread | None = None
        self.active: fx.Injected | None = None
        self.windows: list[measure.Window] = []
        self.records: list[dict[str, Any]] = []

    # -- the run --------------------------------------------------------------------------

    def execute(self) -> dict[str, Any]:
        t_start = time.monotonic()
        try:
            self.say(f"chaos: kvpool-operator up -f {' -f '.join(map(str, self.plan.files))}")
            state = self.up.start(600)
            t_up = time.monotonic() - t_start
            self.say(f"chaos: every workload ready after {t_up:.0f}s")
            self._start_load(state)
            warm = max(s.spec.warmup_s for s in self.streams) + self.plan.steady_s
            self.say(f"chaos: load on, warm-up {warm:.0f}s")
            self._sleep(warm)
            for fault in self.plan.faults:
                self._phase(fault)
            self._finish_load()
            verified = self._verify()
        finally:
            self._teardown()
        return self._report(time.monotonic() - t_start, t_up, verified)

    def _start_load(self, state: dict[str, Any]) -> None:
        self.loop = LoopThread()
        horizon = 1800.0  # trace rows beyond what any run sends: finish() ends the replays
        for spec in self.plan.streams:
            url = state["endpoints"][spec.gateway]
            if spec.domain.endswith("sim") and self.plan.sim_trace is not None:
                stream = build_stream(
                    replace(spec, warm=False), self.plan.sim_trace, _model(url),
                    time_scale=self.plan.sim_time_scale, max_output=spec.output_tokens,
                )  # fmt: skip
            else:
                trace = write_trace(self.workdir / f"{spec.name}.jsonl", spec.rows(horizon))
                stream = build_stream(spec, trace, _model(url))
            self.streams.append(stream)
            self.runs[spec.name] = self.loop.submit(stream.start(url).run())

    def _phase(self, fault: fx.Fault) -> None:
        domains = self.plan.fault_domains[fault.name]
        state = self.up.state()
        before = _controllers(state, domains)
        self.say(f"chaos: {fault.name}: {fault.kind} {', '.join(fault.targets)}")
        t0 = time.monotonic()
        self.active = injected = fx.inject(fault, state)
        if fault.hold_s:
            self._sleep(fault.hold_s)
            fx.heal(injected)
        back = self._until_back(injected)
        streams = [s for s in self.streams if s.spec.domain in domains and s.spec.warm]
        if back is not None:
            self._until_recovered(streams, t0, back)
        end = time.monotonic()
        self.active = None
        self.windows.append(measure.Window(fault.name, t0, end, back))
        back_s = None if back is None else back - t0
        self.records.append(
            {
                **asdict(fault),
                "domains": list(domains),
                "back_s": None if back_s is None else round(back_s, 2),
                "window_s": round(end - t0, 2),
                "ports_cut": injected.ports or None,
                "controllers_before": before,
                "controllers_after": _controllers(self.up.state(), domains),
            }
        )
        shown = "never" if back_s is None else f"after {back_s:.1f}s"
        self.say(f"chaos: {fault.name}: back {shown}, window {end - t0:.0f}s")
        self._sleep(self.plan.gap_s)

    def _until_back(self, done: fx.Injected) -> float | None:
        deadline = time.monotonic() + self.plan.back_timeout_s
        while time.monotonic() < deadline:
            self._alive()
            with contextlib.suppress(OSError, KeyError, ValueError):
                if fx.is_back(done, self.up.state(), self.rendered):
                    return time.monotonic()
            time.sleep(0.5)
        return None

    def _until_recovered(self, streams: list[Stream], t0: float, back: float) -> None:
        """Until every stream's hit ratio is back (seen on requests already answered), at least
        one hit-ratio window after the targets were back, at most ``recovery_cap_s``."""
        cap = back + self.plan.recovery_cap_s
        least = back + max((measure.window_s(s) for s in streams), default=0.0) + 2.0
        while time.monotonic() < cap:
            now = time.monotonic()
            if now >= least and all(
                measure.recovery(s, t0, now, finished_before=now)["recovery_s"] is not None
                for s in streams
            ):
                return
            self._alive()
            time.sleep(1.0)

    def _alive(self) -> None:
        if self.up.proc is not None and self.up.proc.poll() is not None:
            raise RuntimeError(f"kvpool-operator up exited ({self.up.proc.returncode})")

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self._alive()
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))

    def _finish_load(self) -> None:
        assert self.loop is not None
        for s in self.streams:
            if s.replay is not None:
                self.loop.call(s.replay.finish)
        bound = TIMEOUT_S * (RETRIES + 1) + 60.0
        for name, fut in self.runs.items():
            fut.result(timeout=bound)
            self.say(f"chaos: {name}: {len(self._stream(name).outcomes)} requests")

    def _stream(self, name: str) -> Stream:
        return next(s for s in self.streams if s.spec.name == name)

    def _verify(self) -> dict[str, int]:
        """One fault-free request per prompt not answered in the baseline (``verify-`` jobs)."""
        assert self.loop is not None
        refs, _ = measure.references(self.streams, self._by_fault()["baseline"])
        counts: dict[str, int] = {}
        state = self.up.state()
        for s in list(self.streams):
            todo: dict[Any, Any] = {}
            for o in s.outcomes:
                key = s.keys[o.index]
                if key not in refs and key not in todo:
                    todo[key] = next(j for j in s.jobs if j.index == o.index)
            counts[s.spec.name] = len(todo)
            if not todo:
                continue
            jobs = [replace(j, at_s=0.0) for j in todo.values()]
            check = Stream(replace(s.spec, headers={}), jobs, s.keys, s.max_tokens)
            run = self.loop.submit(check.start(state["endpoints"][s.spec.gateway]).run())
            run.result(timeout=TIMEOUT_S * (RETRIES + 1) + 60.0)
            self.streams.append(replace(check, spec=replace(s.spec, name=f"verify-{s.spec.name}")))
            self.say(f"chaos: {s.spec.name}: {len(jobs)} prompts checked fault-free at the end")
        return counts

    def _teardown(self) -> None:
        if self.active is not None:
            fx.heal(self.active)
        if self.loop is not None:
            for s in self.streams:
                if s.replay is not None:
                    self.loop.call(s.replay.stop)
            with contextlib.suppress(Exception):
                for fut in self.runs.values():
                    fut.result(timeout=15)
            self.loop.close()
        self.say("chaos: stopping every process")
        self.up.stop()

    # -- the verdict ----------------------------------------------------------------------

    def _attribution(self) -> list[measure.Window]:
        """Each fault counts what happens until the next one starts (its after-effects too);
        the last one until the load stopped."""
        return [
            replace(w, end=nxt.start if nxt is not None else float("inf"))
            for w, nxt in zip(self.windows, [*self.windows[1:], None], strict=True)
        ]

    def _by_fault(self) -> dict[str, dict[str, list[Any]]]:
        """Requests by fault and stream: ``baseline`` before the first fault, ``verify`` the
        fault-free check at the end."""
        windows = self._attribution()
        out: dict[str, dict[str, list[Any]]] = {"baseline": {}}
        out.update({w.name: {} for w in windows})
        out["verify"] = {}
        for s in self.streams:
            if s.spec.name.startswith("verify-"):
                out["verify"][s.spec.name] = list(s.outcomes)
                continue
            for fault, outs in measure.attribute(s, windows).items():
                out[fault][s.spec.name] = outs
        return out

    def requests(self) -> list[dict[str, Any]]:
        """Every request of the run, with the fault it is counted under."""
        t0 = min((s.replay.t0 for s in self.streams if s.replay is not None), default=0.0)
        return [
            r
            for fault, per in self._by_fault().items()
            for s in self.streams
            for r in measure.requests(s, fault, per.get(s.spec.name, []), t0)
        ]

    def _report(self, duration: float, t_up: float, verified: dict[str, int]) -> dict[str, Any]:
        by = self._by_fault()
        refs, split = measure.references(self.streams, {**by["baseline"], **by["verify"]})
        ends = {w.name: w.end for w in self._attribution()}
        end_of_load = max((measure.life(s, o)[1] for s in self.streams for o in s.outcomes
                           if not s.spec.name.startswith("verify-")), default=0.0)  # fmt: skip
        baseline = {n: measure.tally(self._stream(n), outs, refs)
                    for n, outs in {**by["baseline"], **by["verify"]}.items()}  # fmt: skip
        metrics: dict[str, float] = {}
        faults = []
        for w, rec in zip(self.windows, self.records, strict=True):
            streams = {}
            for s in self.streams:
                outs = by[w.name].get(s.spec.name)
                if not outs:
                    continue
                st = measure.tally(s, outs, refs)
                if s.spec.warm:  # the hit ratio of a stream that routes by KV
                    st.update(measure.recovery(s, w.start, min(ends[w.name], end_of_load)))
                streams[s.spec.name] = st
            rec["streams"] = streams
            faults.append(rec)
            mine = [n for n in streams if self._stream(n).spec.domain in rec["domains"]]
            recs = [streams[n]["recovery_s"] for n in mine if "recovery_s" in streams[n]]
            if recs and all(r is not None for r in recs):
                metrics[f"recovery_s.{w.name}"] = max(recs)
            if rec["back_s"] is not None:
                metrics[f"back_s.{w.name}"] = rec["back_s"]
        every = [*baseline.values(), *(st for f in faults for st in f["streams"].values())]
        for key in (
            "requests",
            "answered",
            "retried_ok",
            "failed",
            "lost",
            "hung",
            "wrong",
            "unchecked",
            "retryable_with_retry_after",
            "retryable_without_retry_after",
        ):
            metrics[key] = sum(st[key] for st in every)  # fmt: skip
        metrics["wrong"] += len(split)
        metrics["not_back"] = sum(1 for f in faults if f["back_s"] is None)
        metrics["not_recovered"] = sum(
            1
            for f in faults
            if f"recovery_s.{f['name']}" not in metrics and f["back_s"] is not None
        )
        return {
            "component": "chaos",
            "quick": self.plan.reduced,
            "metrics": metrics,
            "ratios": {},
            "peers": {},
            "env": {
                "duration_s": round(duration, 1),
                "up_s": round(t_up, 1),
                "python": platform.python_version(),
                "files": [str(f) for f in self.plan.files],
                "client": {"timeout_s": TIMEOUT_S, "retries": RETRIES},
                "streams": [asdict(s.spec) for s in self.streams],
                "verified_at_end": verified,
                "nondeterministic_prompts": len(split),
            },
            "baseline": baseline,
            "faults": faults,
        }
