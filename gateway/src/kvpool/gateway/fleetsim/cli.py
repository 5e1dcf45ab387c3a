"""``kvpool-gateway simulate`` and ``kvpool-gateway plan``: the fleet simulator's commands.

Why this module exists: a platform engineer asks the simulator two things: how would this
trace run on this fleet under each routing policy (``simulate``), and what is the smallest fleet
that meets a TTFT target (``plan``). Both read any Mooncake-format trace, take the fleet as flags
(a bundled or given performance profile, instances, DDR per instance), print a Markdown table,
write JSON and optionally a plot, and show progress. Bad input is one line naming the flag and
the fix, exit 2.

    kvpool-gateway simulate --trace trace.jsonl --count 2000 --instances 16 --ddr-gib 64 \\
        --policy kv-aware --policy round-robin --policy oracle --out sim.json
    kvpool-gateway plan --trace trace.jsonl --count 2000 --instances 4,8,16,32 \\
        --ddr-gib 32,64 --policy kv-aware,round-robin --target-ttft-p90-ms 2000 --plot plan.png
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from kvpool.gateway.fleetsim.fleet import ORACLE, FleetConfig, FleetSim
from kvpool.gateway.fleetsim.planner import GIB, PlanPoint, plan, smallest
from kvpool.gateway.fleetsim.stats import json_safe, summarize
from kvpool.gateway.routing import POLICIES
from kvpool.gateway.traces.mooncake import TraceError, TraceRequest, Window, read_mooncake
from kvpool.protocol.simcore.profile import (
    PerfProfile,
    ProfileError,
    bundled_profile,
    bundled_profiles,
    parse_profile,
)

EXIT_REFUSED = 2
DEFAULT_PROFILE = "h100-llama-3.1-8b-vllm"


class SimulateError(Exception):
    """Bad flags or input; the message names the flag and the fix."""


def _fleet_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True, help="a Mooncake-format JSONL trace")
    p.add_argument("--start", type=int, default=0, help="skip this many requests of the trace")
    p.add_argument("--count", type=int, default=None, help="replay this many requests")
    p.add_argument("--from-s", type=float, default=None, help="trace window start (seconds)")
    p.add_argument("--to-s", type=float, default=None, help="trace window end (seconds)")
    p.add_argument("--time-scale", type=float, default=1.0, help="replay N times faster")
    p.add_argument(
        "--profile",
        default=DEFAULT_PROFILE,
        help=f"a bundled profile ({', '.join(bundled_profiles())}) or a profile JSON file",
    )
    p.add_argument("--disk-gib", type=float, default=0.0, help="local disk tier per instance")
    p.add_argument("--device-kv-gib", type=float, default=None, help="default: the profile's")
    p.add_argument("--chunk-size", type=int, default=256, help="LMCache chunk size (tokens)")
    p.add_argument("--block-size", type=int, default=16, help="vLLM block size (tokens)")
    p.add_argument("--trace-block", type=int, default=512, help="tokens per trace hash id")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--prefix-weight", type=float, default=1.0)
    p.add_argument("--load-weight", type=float, default=1.0)
    p.add_argument(
        "--pending-ttl", type=float, default=FleetConfig.pending_ttl_s, help="seconds (model time)"
    )
    p.add_argument("--index-lag", type=float, default=0.05, help="admit -> index, seconds")
    p.add_argument("--p2p", action="store_true", help="instances pull from each other")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput's TTFT SLO")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--plot", default=None, help="write a PNG here (needs matplotlib)")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sim = sub.add_parser("simulate", help="replay a trace on a simulated fleet (virtual time)")
    _fleet_flags(sim)
    sim.add_argument("--instances", type=int, required=True)
    sim.add_argument("--ddr-gib", type=float, required=True, help="LMCache DDR per instance")
    sim.add_argument(
        "--policy",
        action="append",
        default=None,
        help=f"repeatable: {', '.join(sorted(POLICIES))} or {ORACLE} (default kv-aware)",
    )
    sim.set_defaults(handler=run_simulate)
    pl = sub.add_parser("plan", help="smallest simulated fleet meeting a TTFT p90 target")
    _fleet_flags(pl)
    pl.add_argument("--instances", required=True, help="comma-separated counts, e.g. 4,8,16")
    pl.add_argument("--ddr-gib", required=True, help="comma-separated GiB per instance")
    pl.add_argument("--policy", default="kv-aware,round-robin", help="comma-separated")
    pl.add_argument("--target-ttft-p90-ms", type=float, required=True)
    pl.set_defaults(handler=run_plan)


# ---------------------------------------------------------------------- shared
def load_profile(spec: str) -> PerfProfile:
    if spec in bundled_profiles():
        return bundled_profile(spec)
    path = Path(spec)
    if not path.is_file():
        raise SimulateError(
            f"--profile: {spec!r} is neither a bundled profile ({', '.join(bundled_profiles())}) "
            "nor a file"
        )
    try:
        return parse_profile(path.read_bytes(), str(path))
    except ProfileError as exc:
        raise SimulateError(f"--profile: {exc}") from None


def load_requests(args: argparse.Namespace) -> list[TraceRequest]:
    try:
        window = Window(args.start, args.count, args.from_s, args.to_s)
        requests = read_mooncake(args.trace, window)
    except (TraceError, ValueError) as exc:
        raise SimulateError(f"--trace: {exc}") from None
    if not requests:
        raise SimulateError("--trace: the window holds no request; widen --count/--from-s/--to-s")
    return requests


def base_config(
    args: argparse.Namespace, instances: int, ddr_gib: float, policy: str
) -> FleetConfig:
    for flag in ("time_scale", "chunk_size", "block_size", "trace_block"):
        if getattr(args, flag) <= 0:
            raise SimulateError(f"--{flag.replace('_', '-')}: must be > 0")
    if instances < 1 or ddr_gib < 0:
        raise SimulateError("--instances must be >= 1 and --ddr-gib >= 0")
    if policy != ORACLE and policy not in POLICIES:
        raise SimulateError(
            f"--policy: {policy!r} is not one of {', '.join(sorted(POLICIES))}, {ORACLE}"
        )
    try:
        return FleetConfig(
            instances=instances,
            profile=load_profile(args.profile),
            ddr_bytes=int(ddr_gib * GIB),
            disk_bytes=int(args.disk_gib * GIB),
            chunk_size=args.chunk_size,
            block_size=args.block_size,
            device_kv_gib=args.device_kv_gib,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            policy=policy,
            prefix_weight=args.prefix_weight,
            load_weight=args.load_weight,
            pending_ttl_s=args.pending_ttl,
            index_lag_s=args.index_lag,
            p2p=args.p2p,
            trace_block_tokens=args.trace_block,
        )
    except ValueError as exc:
        raise SimulateError(str(exc)) from None


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1000:.0f}"


def _write_json(path: str | None, data: dict[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps(json_safe(data), indent=2, sort_keys=True) + "\n")


def _guard(fn: Any, args: argparse.Namespace) -> int:
    try:
        return int(fn(args))
    except SimulateError as exc:
        print(f"kvpool-gateway: {exc}", file=sys.stderr)
        return EXIT_REFUSED


# ---------------------------------------------------------------------- simulate
def run_simulate(args: argparse.Namespace) -> int:
    return _guard(_simulate, args)


def _simulate(args: argparse.Namespace) -> int:
    requests = load_requests(args)
    policies = args.policy or ["kv-aware"]
    slo = args.slo_ttft_ms / 1000 if args.slo_ttft_ms else None
    out: dict[str, Any] = {"requests": len(requests), "instances": args.instances, "runs": {}}
    rows = []
    for policy in policies:
        cfg = base_config(args, args.instances, args.ddr_gib, policy)

        def progress(done: int, total: int, now: float, policy: str = policy) -> None:
            print(f"  {policy}: {done}/{total} done, t={now:.0f} s", file=sys.stderr)

        run = FleetSim(cfg, time_scale=args.time_scale).run(requests, progress)
        s = summarize(run.results, slo_ttft_s=slo)
        s["wall_s"] = run.wall_s
        s["events"] = run.events
        s.pop("per_instance")
        out["runs"][policy] = s
        rows.append((policy, s))
    print(table(rows, args.instances, args.ddr_gib))
    _write_json(args.out, out)
    if args.plot:
        plot_runs(rows, Path(args.plot))
    return 0


def table(rows: list[tuple[str, dict[str, Any]]], instances: int, ddr_gib: float) -> str:
    lines = [
        f"simulated fleet: {instances} instances, {ddr_gib:g} GiB DDR each",
        "",
        "| policy | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | TPOT p50 ms | hit ratio | "
        "goodput | sim wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for policy, s in rows:
        t, tp = s["ttft_s"], s["tpot_s"]
        lines.append(
            f"| {policy} | {_ms(t['p50'])} | {_ms(t['p90'])} | {_ms(t['p99'])} | "
            f"{_ms(tp['p50'])} | {s['hit_ratio']:.3f} | {s['goodput']['share']:.2f} | "
            f"{s['wall_s']:.1f} |"
        )
    return "\n".join(lines)


def plot_runs(rows: list[tuple[str, dict[str, Any]]], path: Path) -> None:
    import matplotlib  # noqa: PLC0415 (optional: only --plot needs it)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(7, 4))
    names = [p for p, _ in rows]
    for i, q in enumerate(("p50", "p90", "p99")):
        ax.bar(
            [x + i * 0.25 for x in range(len(rows))],
            [s["ttft_s"][q] for _, s in rows],
            width=0.25,
            label=f"TTFT {q}",
        )
    ax.set_xticks([x + 0.25 for x in range(len(rows))], names)
    ax.set_ylabel("seconds")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------- plan
def run_plan(args: argparse.Namespace) -> int:
    return _guard(_plan, args)


def _numbers(flag: str, text: str, kind: type[float] | type[int]) -> list[Any]:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SimulateError(
            f"--{flag}: {text!r} is not a comma-separated list of numbers"
        ) from None
    if not values:
        raise SimulateError(f"--{flag}: give at least one value")
    return values


def _plan(args: argparse.Namespace) -> int:
    requests = load_requests(args)
    counts = _numbers("instances", args.instances, int)
    sizes = _numbers("ddr-gib", args.ddr_gib, float)
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    base = base_config(args, counts[0], sizes[0], policies[0])
    for p in policies:
        base_config(args, counts[0], sizes[0], p)  # validate every policy name first

    def progress(point: PlanPoint) -> None:
        print(
            f"  {point.policy} x{point.instances} {point.ddr_gib:g} GiB: TTFT p90 "
            f"{point.ttft_p90_s * 1000:.0f} ms, hit {point.hit_ratio:.3f}",
            file=sys.stderr,
        )

    slo = args.slo_ttft_ms / 1000 if args.slo_ttft_ms else None
    points = plan(
        base,
        requests,
        instances=counts,
        ddr_gib=sizes,
        policies=policies,
        time_scale=args.time_scale,
        slo_ttft_s=slo,
        progress=progress,
    )
    answer = smallest(points, args.target_ttft_p90_ms / 1000)
    lines = [f"smallest fleet with TTFT p90 <= {args.target_ttft_p90_ms:g} ms", ""]
    lines.append("| policy | " + " | ".join(f"{g:g} GiB DDR" for g in sizes) + " |")
    lines.append("|---" * (len(sizes) + 1) + "|")
    for policy, row in answer["by_ddr"].items():
        cells = [str(row.get(f"{g:g}") or "none") for g in sizes]
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    _write_json(args.out, {"points": [vars(p) for p in points], "answer": answer})
    if args.plot:
        plot_plan(points, args.target_ttft_p90_ms / 1000, Path(args.plot))
    return 0


def plot_plan(points: list[PlanPoint], target_s: float, path: Path) -> None:
    import matplotlib  # noqa: PLC0415 (optional: only --plot needs it)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(7, 4))
    for key in sorted({(p.policy, p.ddr_gib) for p in points}):
        xs = [p.instances for p in points if (p.policy, p.ddr_gib) == key]
        ys = [p.ttft_p90_s for p in points if (p.policy, p.ddr_gib) == key]
        ax.plot(xs, ys, marker="o", label=f"{key[0]}, {key[1]:g} GiB DDR")
    ax.axhline(target_s, color="grey", linestyle="--", label="target")
    ax.set_xlabel("instances")
    ax.set_ylabel("TTFT p90 (s)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
