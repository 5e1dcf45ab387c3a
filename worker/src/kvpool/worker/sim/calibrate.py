"""``kvpool-worker calibrate``: fit a simulated-engine profile from the reference engine here.

Why this module exists: the sim's profiles (``kvpool.protocol.simcore.profile``) cite published
benchmarks of GPUs and NPUs; nothing tied the performance model to an engine that runs on this
machine, so nothing showed that its functional form describes a real engine at all. This runs
the reference engine's own step (``ModelRunner.execute``: the paged model's forward and
sampling, real model math on CPU) and LMCache's real store and retrieve over a bounded sweep,
fits the sim's step model by non-negative least squares on relative error, and writes a
profile file whose provenance (machine, model, date, load, sweep, residuals) stands in place of
a citation. Steps never in the fit (mixed prefill and decode batches, other lengths) are timed
too and reported as the model's prediction error.

What is measured: prefills of uncached prompts and chunked prefills after a computed prefix;
decode steps of ``B`` sequences at context ``c``; each shape once per round, rounds shuffled,
the fastest (``min``: the least interference from other jobs) or the median kept. A decode's
context is set up without computing it (a CPU step's time does not depend on the KV values).
``request_s``: TTFT through ``ReferenceEngine`` minus the step. Links: LMCache 0.5.6 stores,
DDR and disk retrieves; P2P and remote are not measured (set to the slower local link).
"""

from __future__ import annotations

import asyncio
import datetime
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvpool.protocol.simcore.profile import GIB, Link, ModelShape, PerfProfile, Source, StepModel
from kvpool.protocol.simcore.profile import parse_profile as parse
from kvpool.worker.engine.factory import build
from kvpool.worker.engine.model import slot_mapping
from kvpool.worker.engine.runner import DEFAULT_PREFILL_THREADS, ModelRunner
from kvpool.worker.engine.scheduler import ScheduledSeq, Sequence
from kvpool.worker.engine_api import GenerationRequest, ReferenceEngineOptions, SamplingParams

__all__ = ["SWEEPS", "CalibrationError", "Sweep", "calibrate", "nnls"]

STEP_TERMS = ("overhead_s", "prefill_overhead_s", "prefill_token_s", "attn_s", "decode_seq_s",
              "decode_ctx_s")  # fmt: skip
CHUNK = 256  # LMCache chunk size of the link measurements (the operator's default)
Array = npt.NDArray[np.float64]
STATISTICS: dict[str, Callable[[list[float]], float]] = {"min": min, "median": statistics.median}


class CalibrationError(Exception):
    """The calibration cannot give a valid profile; the message says why and what to do."""


@dataclass(frozen=True)
class Sweep:
    """What is timed. ``chunked``: (computed prefix, new tokens); ``mixed`` (validation only):
    (prefill tokens, decodes, their context each)."""

    prefill: tuple[int, ...]
    chunked: tuple[tuple[int, int], ...]
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    rounds: int
    budget_s: float  # rounds stop after this many seconds (at least one round runs)
    links: tuple[int, ...]  # tokens per LMCache store/retrieve (whole chunks); () skips LMCache
    holdout: tuple[int, ...] = ()
    mixed: tuple[tuple[int, int, int], ...] = ()
    request_tokens: int = 64


SWEEPS: dict[str, Sweep] = {
    "tiny": Sweep((16, 32, 64, 128, 256, 512), ((256, 64),), (1, 2, 4), (64, 512), 5, 20.0,
                  (256, 512, 1024, 2048), (384,), ((64, 2, 256),)),
    "quick": Sweep((16, 64, 128, 256, 512, 1024, 2048), ((1024, 256), (2048, 512)), (1, 2, 4, 8),
                   (128, 1024, 3072), 9, 60.0, (256, 1024, 2048, 4096), (384, 1536),
                   ((256, 4, 1024), (512, 8, 512), (64, 2, 2048))),
    "full": Sweep((16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192),
                  ((1024, 256), (2048, 512), (4096, 1024), (6144, 2048)), (1, 2, 4, 8),
                  (64, 256, 1024, 2048, 3840), 9, 600.0, (256, 512, 1024, 2048, 4096, 8192),
                  (384, 1536, 3072), ((256, 4, 1024), (512, 8, 512), (64, 2, 2048),
                                      (1024, 4, 3072))),
}  # fmt: skip


@dataclass
class Point:
    """One timed step shape and its samples (seconds)."""

    kind: str  # prefill | chunked | decode | mixed | holdout
    prefill: tuple[int, int] = (0, 0)  # (already computed, new tokens) of one prefill
    decodes: int = 0
    context: int = 0
    samples: list[float] = field(default_factory=list)
    statistic: str = "min"  # which of STATISTICS stands for the samples

    @property
    def row(self) -> list[float]:
        """The step model's terms for this step (``StepModel.step_s``'s arguments)."""
        m, n = self.prefill
        pre = 1.0 if n else 0.0
        return [1.0, pre, float(n), n * (m + n / 2), float(self.decodes),
                float(self.decodes * self.context)]  # fmt: skip

    @property
    def label(self) -> str:
        m, n = self.prefill
        parts = [f"prefill {n}" + (f" after {m}" if m else "")] if n else []
        parts += [f"{self.decodes} decodes at {self.context}"] if self.decodes else []
        return " + ".join(parts)

    @property
    def value(self) -> float:
        return STATISTICS[self.statistic](self.samples)


def nnls(a: Array, b: Array) -> Array:
    """Non-negative least squares (Lawson and Hanson): argmin ||a x - b|| with x >= 0."""
    n = a.shape[1]
    x: Array = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    for _ in range(3 * n + 3):
        w = a.T @ (b - a @ x)
        if passive.all() or w[~passive].max() <= 1e-12 * max(1.0, float(np.abs(w).max())):
            break
        passive[int(np.argmax(np.where(passive, -np.inf, w)))] = True
        while True:
            z: Array = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = float(np.min(x[neg] / (x[neg] - z[neg])))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
    return x


def fit_steps(points: list[Point]) -> StepModel:
    """The step model's coefficients: NNLS on relative error (each row divided by its time),
    columns scaled to unit norm so tiny and huge terms weigh alike."""
    y = np.array([p.value for p in points])
    a = np.array([p.row for p in points]) / y[:, None]
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    coef = nnls(a / scale, np.ones(len(points))) / scale
    model = StepModel(**{k: float(v) for k, v in zip(STEP_TERMS, coef, strict=True)})
    if model.overhead_s <= 0 or model.prefill_token_s <= 0:
        raise CalibrationError(
            f"the fit found no per-step or per-token cost ({model}); the timings are too noisy: "
            "rerun with --sweep full, or when the machine is quieter"
        )
    return model


def predict(model: StepModel, p: Point) -> float:
    m, n = p.prefill
    return model.step_s(n, n * (m + n / 2), p.decodes, p.decodes * p.context)


def residuals(model: StepModel, points: list[Point]) -> dict[str, Any]:
    """Per point: measured and predicted ms and relative error; RMS and worst per kind."""
    rows: list[dict[str, Any]] = []
    errs: dict[str, list[float]] = {}
    for p in points:
        pred = predict(model, p)
        err = (pred - p.value) / p.value
        errs.setdefault(p.kind, []).append(err)
        rows.append({"kind": p.kind, "step": p.label, "measured_ms": round(p.value * 1e3, 3),
                     "predicted_ms": round(pred * 1e3, 3), "rel_err": round(err, 3),
                     "spread_ms": [round(min(p.samples) * 1e3, 3),
                                   round(max(p.samples) * 1e3, 3)]})  # fmt: skip
    summary = {k: {"rms_rel_err": round(float(np.sqrt(np.mean(np.square(v)))), 3),
                   "max_abs_rel_err": round(float(np.max(np.abs(v))), 3), "points": len(v)}
               for k, v in errs.items()}  # fmt: skip
    return {"summary": summary, "points": rows}


def fit_link(
    samples: dict[int, list[float]], kv_bytes: int, statistic: str = "min"
) -> tuple[Link, dict[str, Any]]:
    """``latency + bytes / GB/s`` through each size's statistic (NNLS on relative error)."""
    toks = sorted(samples)
    y = np.array([STATISTICS[statistic](samples[t]) for t in toks])
    nbytes = np.array([t * kv_bytes for t in toks], dtype=float)
    a = np.stack([np.ones_like(nbytes), nbytes], axis=1) / y[:, None]
    scale = np.linalg.norm(a, axis=0)
    latency, per_byte = nnls(a / scale, np.ones(len(toks))) / scale
    if per_byte <= 0:
        raise CalibrationError("a KV link's time did not grow with its bytes: rerun the sweep")
    link = Link(gbps=round(1e-9 / float(per_byte), 3), latency_s=round(float(latency), 6))
    pts = [{"tokens": t, "measured_ms": round(float(m) * 1e3, 3),
            "predicted_ms": round(link.seconds(float(b)) * 1e3, 3)}
           for t, m, b in zip(toks, y, nbytes, strict=True)]  # fmt: skip
    return link, {"points": pts}


Progress = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(f"calibrate: {msg}", file=sys.stderr, flush=True)


class _Stepper:
    """Builds the sequences of one step shape in the runner's cache and times ``execute``."""

    def __init__(self, runner: ModelRunner, num_blocks: int, block_size: int, seed: int) -> None:
        self.runner, self.num_blocks, self.block_size = runner, num_blocks, block_size
        self.rng = random.Random(seed)

    def _seq(self, start_block: int, computed: int, total: int, out: int) -> Sequence:
        tokens = [self.rng.randrange(5, 8192) for _ in range(total)]
        nb = -(-total // self.block_size)
        req = GenerationRequest(f"calibrate-{start_block}", tokens, SamplingParams(max_tokens=1))
        return Sequence(req, tokens, total - out, 0.0, None, list(range(start_block,
                        start_block + nb)), num_computed=computed, needs_lookup=False,
                        num_output=out)  # fmt: skip

    def fits(self, p: Point) -> bool:
        m, n = p.prefill
        need = -(-(m + n) // self.block_size) + p.decodes * -(-(p.context + 1) // self.block_size)
        return need <= self.num_blocks

    def time(self, p: Point) -> float:
        items, block = [], 0
        for _ in range(p.decodes):
            items.append(ScheduledSeq(self._seq(block, p.context, p.context + 1, 1), 1, False))
            block += len(items[-1].seq.block_table)
        m, n = p.prefill
        if n:
            items.append(ScheduledSeq(self._seq(block, m, m + n, 0), n, False))
        started = time.perf_counter()
        self.runner.execute(items)
        return time.perf_counter() - started


def sweep_points(sweep: Sweep) -> tuple[list[Point], list[Point]]:
    """(fitted, held out) step shapes of a sweep."""
    fitted = [Point("prefill", (0, n)) for n in sweep.prefill]
    fitted += [Point("chunked", mn) for mn in sweep.chunked]
    fitted += [Point("decode", decodes=b, context=c) for b in sweep.batches for c in sweep.contexts]
    held = [Point("holdout", (0, n)) for n in sweep.holdout]
    held += [Point("mixed", (0, n), b, c) for n, b, c in sweep.mixed]
    return fitted, held


def time_steps(
    stepper: _Stepper, fitted: list[Point], held: list[Point], sweep: Sweep, say: Progress
) -> tuple[int, StepModel]:
    """Rounds over every shape in shuffled order: ``sweep.rounds``, then more while the fit is
    not valid (a burst of load can hide a term), until the time budget is spent."""
    stepper.time(Point("prefill", (0, 128)))  # warm-up: allocator, rope table, kernels
    stepper.time(Point("decode", decodes=2, context=256))
    deadline = time.monotonic() + sweep.budget_s
    order, done = fitted + held, 0
    while True:
        stepper.rng.shuffle(order)
        for p in order:
            p.samples.append(stepper.time(p))
        done += 1
        say(f"steps: round {done}/{sweep.rounds} of {len(order)} shapes")
        if done < sweep.rounds and time.monotonic() < deadline:
            continue
        try:
            return done, fit_steps(fitted)
        except CalibrationError:
            if time.monotonic() > deadline:
                raise
            say("steps: the fit is not valid yet (a term hidden by load): one more round")


async def _request_ttft(options: ReferenceEngineOptions, tokens: int, n: int) -> list[float]:
    from kvpool.worker.engine import ReferenceEngine  # noqa: PLC0415 (the engine's loop)

    engine = ReferenceEngine(options)
    await engine.start()
    rng, out = random.Random(7), []
    try:
        for i in range(n):
            ids = [rng.randrange(5, 8192) for _ in range(tokens)]
            req = GenerationRequest(f"calibrate-ttft-{i}", ids, SamplingParams(max_tokens=1))
            async for ev in engine.generate(req):
                if ev.ttft_s is not None:
                    out.append(ev.ttft_s)
    finally:
        await engine.shutdown(5.0)
    return out


def time_links(
    runner: ModelRunner, options: ReferenceEngineOptions, sweep: Sweep, rounds: int, say: Progress
) -> dict[str, dict[int, list[float]]]:
    """LMCache 0.5.6 stores (into DDR), DDR retrieves, disk retrieves (DDR copy evicted)."""
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")
    from kvpool.worker.engine.offload import LMCacheOffload  # noqa: PLC0415 (heavy import)

    shape = runner.model.shape
    caches, bs = runner.kv_caches, options.block_size
    need_gb = max(sweep.links) * shape.kv_bytes_per_token * 3 / 1e9  # one prompt at a time
    out: dict[str, dict[int, list[float]]] = {"store": {}, "ddr": {}, "disk": {}}
    rng = random.Random(11)
    with tempfile.TemporaryDirectory(prefix="kvpool-calibrate-") as disk:
        size = need_gb + 0.05
        config = {"chunk_size": CHUNK, "local_cpu": True, "max_local_cpu_size": size,
                  "local_disk": f"file://{disk}/", "max_local_disk_size": size}  # fmt: skip
        off = LMCacheOffload(
            config,
            instance_id=f"calibrate-{os.getpid()}",
            num_layers=shape.num_layers,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            block_size=bs,
            dtype=options.dtype,
            model_name=options.model_name,
        )
        try:
            for r in range(rounds):
                for n in sweep.links:
                    tokens = [rng.randrange(5, 8192) for _ in range(n)]
                    slots = slot_mapping(range(-(-n // bs)), bs, 0, n)
                    t0 = time.perf_counter()
                    off.store(tokens, caches, slots)
                    t1 = time.perf_counter()
                    hit = off.lookup(tokens)
                    got = off.retrieve(tokens, hit, caches, slots)
                    t2 = time.perf_counter()
                    if got != n:
                        raise CalibrationError(f"LMCache loaded {got} of {n} stored tokens")
                    out["store"].setdefault(n, []).append(t1 - t0)
                    out["ddr"].setdefault(n, []).append(t2 - t1)
                    if off.flush(10.0):
                        off.evict(token_ids=tokens, locations=["local_cpu"])
                        t3 = time.perf_counter()
                        got = off.retrieve(tokens, off.lookup(tokens), caches, slots)
                        if got == n:
                            out["disk"].setdefault(n, []).append(time.perf_counter() - t3)
                    off.evict(token_ids=tokens)
                say(f"links: round {r + 1}/{rounds}")
        finally:
            off.close(10.0)
    return {k: v for k, v in out.items() if v}


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": DEFAULT_PREFILL_THREADS,
            "hostname": platform.node(), "python": platform.python_version(),
            "torch": str(torch.__version__), "system": platform.platform()}  # fmt: skip


def calibrate(
    sweep: Sweep,
    *,
    name: str,
    options: ReferenceEngineOptions | None = None,
    statistic: str = "min",
    say: Progress = _stderr,
) -> PerfProfile:
    """Time the reference engine over ``sweep`` and return the fitted, validated profile."""
    opts = options or ReferenceEngineOptions()
    started, load0 = time.monotonic(), os.getloadavg()
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    say(f"building the reference engine ({opts.model_name}, {opts.num_kv_blocks} blocks)")
    runner = build(opts, None, {}).runner
    stepper = _Stepper(runner, opts.num_kv_blocks, opts.block_size, seed=5)
    fitted, held = sweep_points(sweep)
    if sweep.request_tokens not in sweep.prefill:
        fitted.append(Point("prefill", (0, sweep.request_tokens)))
    for p in fitted + held:
        p.statistic = statistic
    fitted, held = [p for p in fitted if stepper.fits(p)], [p for p in held if stepper.fits(p)]
    rounds, model = time_steps(stepper, fitted, held, sweep, say)
    fit_res, held_res = residuals(model, fitted), residuals(model, held)
    say(f"step fit: {model}")
    say(f"residuals: fitted {fit_res['summary']}, held out {held_res['summary']}")
    say(f"request overhead: {max(3, rounds)} prompts of {sweep.request_tokens} tokens")
    ttft = asyncio.run(_request_ttft(opts, sweep.request_tokens, max(3, rounds)))
    step = next(p for p in fitted if p.prefill == (0, sweep.request_tokens)).value
    request_s = max(0.0, STATISTICS[statistic](ttft) - step)
    kv_bytes = runner.model.shape.kv_bytes_per_token
    links: dict[str, Link] = {}
    link_fit: dict[str, Any] = {}
    samples: dict[str, dict[int, list[float]]] = {}
    for attempt in range(3 if sweep.links else 0):  # more rounds while a fit is not valid
        for tier, got in time_links(runner, opts, sweep, rounds, say).items():
            for n, xs in got.items():
                samples.setdefault(tier, {}).setdefault(n, []).extend(xs)
        try:
            for tier, by_size in samples.items():
                links[tier], link_fit[tier] = fit_link(by_size, kv_bytes, statistic)
            break
        except CalibrationError:
            if attempt == 2:
                raise
            say("links: a fit is not valid yet (a burst of load): more rounds")
    for tier, k in links.items():
        say(f"{tier} link: {k.gbps} GB/s + {k.latency_s * 1e3:.3f} ms")
    if "ddr" not in links or "store" not in links:
        raise CalibrationError("no DDR link measured (LMCache): the profile needs one")
    slow = min((links[t] for t in ("ddr", "disk") if t in links), key=lambda k: k.gbps)
    measured = sorted(t for t in links if t != "store")
    load = {t: links.get(t, slow) for t in ("ddr", "disk", "p2p", "remote")}
    dtype, ms = opts.dtype, runner.model.shape
    shape = ModelShape(opts.model_name, ms.num_layers, ms.num_kv_heads, ms.head_dim, dtype)
    host = machine()
    where = f"this machine: {host['cpu']}, {host['cores']} cores, {host['system']}, {when}"
    sources = [
        Source(f"kvpool-worker calibrate: {len(fitted)} step shapes of the reference engine's "
               f"ModelRunner.execute (forward and sampling, torch {host['torch']}), {statistic} of "
               f"{rounds} rounds, NNLS on relative error; load average "
               f"{load0[0]:.1f} at start", where, "step"),
        Source(f"{statistic} TTFT of {len(ttft)} {sweep.request_tokens}-token prompts through "
               f"ReferenceEngine minus their {statistic} step (no HTTP, no tokenizing)", where,
               f"request_s {request_s:.6f}"),
        Source(f"LMCache 0.5.6 store and lookup + retrieve ({statistic} of {rounds} rounds) of "
               f"{', '.join(map(str, sweep.links))} tokens (chunk {CHUNK}), bytes counted as "
               f"tokens x {kv_bytes} B (the sim's kv_bytes_per_token)", where,
               f"measured: store, {', '.join(measured)}"),
        Source("p2p and remote were not measured (they need a peer instance or a server)",
               "assumption", f"set to the slowest measured local link ({slow.gbps} GB/s)"),
        Source("device KV, batch and token budget: the reference engine's defaults",
               "kvpool.worker.engine_api.ReferenceEngineOptions",
               f"{opts.num_kv_blocks} blocks x {opts.block_size} tokens"),
    ]  # fmt: skip
    profile = PerfProfile(
        name=name,
        description=f"kvpool's reference engine ({opts.model_name}, {dtype}, CPU) on "
        f"{host['cpu']} ({host['cores']} cores), fitted by kvpool-worker calibrate on {when} "
        f"({statistic} of {rounds} rounds, load average {load0[0]:.1f}): this machine only.",
        chip=f"{host['cpu']} ({host['cores']} cores)",
        engine="kvpool-reference",
        sources=tuple(sources),
        model=shape,
        step=model,
        request_s=round(request_s, 6),
        load=load,
        store=links["store"],
        device_kv_gib=opts.num_kv_blocks * opts.block_size * kv_bytes / GIB,
        max_num_seqs=opts.max_num_seqs,
        max_num_batched_tokens=opts.max_model_len,
        block_size=opts.block_size,
        fit={
            "method": "kvpool-worker calibrate",
            "date": when,
            "machine": host,
            "loadavg": {
                "start": [round(x, 2) for x in load0],
                "end": [round(x, 2) for x in os.getloadavg()],
            },
            "seconds": round(time.monotonic() - started, 1),
            "statistic": statistic,
            "sweep": {
                "rounds": rounds,
                "prefill": sweep.prefill,
                "chunked": sweep.chunked,
                "batches": sweep.batches,
                "contexts": sweep.contexts,
                "links": sweep.links,
            },
            "residuals": fit_res,
            "validation": held_res,
            "links": link_fit,
            "ttft_ms": [round(t * 1e3, 3) for t in ttft],
        },
    )
    return parse(profile.to_json(), f"calibrated profile {name}")


def run(
    out: str, sweep_name: str, name: str, model: str, model_dir: str | None, statistic: str
) -> int:
    """``kvpool-worker calibrate``: exit 0 with the profile written, 2 on bad flags (nothing
    measured), 1 when the measurement cannot give a valid profile."""
    target = Path(out)
    if not target.parent.is_dir():
        print(f"kvpool-worker: calibrate --out: {target.parent} is not a directory; create it "
              "or name a file in an existing one", file=sys.stderr)  # fmt: skip
        return 2
    opts = ReferenceEngineOptions(model_name=model, model_dir=model_dir)
    try:
        profile = calibrate(SWEEPS[sweep_name], name=name, options=opts, statistic=statistic)
    except CalibrationError as exc:
        print(f"kvpool-worker: calibrate: {exc}", file=sys.stderr)
        return 1
    target.write_text(profile.to_json(), encoding="utf-8")
    _stderr(f"wrote {target}: use it with kvpool-worker serve --engine sim --sim-profile {target}")
    return 0
