"""Fleet benchmark (``make bench-fleet``): kvpool's KV-aware routing against the routers users
would pick instead, on one simulated fleet and one window of a real trace, in one run; the fleet
simulator validated against it; kvpool's parts at a thousand instances.

Why this shape (issue 14): the claim is a ratio on the same fleet, window and client.

1. Sizes (``sizing.py``): from the window, the fleet's DDR (half of its distinct chunks in all),
   the device KV, the fleet's capacity (the simulator, saturated) and the pace (75 % of it).
2. Arms (``arms.py``), each on a fresh fleet (``kvpool-operator up --sim-host`` of
   ``pool.yaml``: the controller, 16 sim workers, kvpool's gateway): kvpool kv-aware, kvpool
   round-robin, sglang-router 0.3.2 cache_aware, vllm-router 0.1.17 cache_aware and kv_aware
   (on the sims' vLLM KV events), kvpool's gateway as two replicas behind one address (nginx);
   then NVIDIA Dynamo 1.6.1's KV router and its round-robin on Dynamo's own mocker fleet of the
   same size. The client is ``kvpool-gateway replay`` for everyone.
3. The simulator (``kvpool-gateway simulate``'s engine) on the same window and fleet: its
   predicted TTFT and hit ratio per policy against the measured ones, and the oracle (exact
   caches, no load) for ``hit_over_oracle``; the whole trace at 1000 instances (its wall time).
4. Scale (``scale.py``): the controller under 1000 instances' admit/evict stream, the gateway's
   routing decision at 1000 instances, index and replica memory.

Writes ``--out`` (DESIGN.md's JSON shape) and a PNG next to it, prints a Markdown table.

    python gateway/bench/fleet/run.py [--quick] --out bench-results/fleet.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import arms  # noqa: E402
import peers  # noqa: E402
import report  # noqa: E402
import scale  # noqa: E402
import sizing  # noqa: E402

from kvpool.gateway.fleetsim.bound import pooled_hit_ratio  # noqa: E402
from kvpool.gateway.fleetsim.fleet import ORACLE, FleetConfig, FleetSim  # noqa: E402
from kvpool.gateway.fleetsim.stats import json_safe, summarize  # noqa: E402
from kvpool.gateway.traces.mooncake import (  # noqa: E402
    Window,
    dump_row,
    read_mooncake,
    sample_families,
    trace_stats,
)
from kvpool.protocol.simcore.profile import bundled_profile  # noqa: E402

TRACE = HERE.parents[2].parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
PROFILE = "h100-llama-3.1-8b-vllm"
#: Each run's logs and replays (kept for a look afterwards; .kvpool is not committed).
RUNS = HERE.parents[2] / ".kvpool" / "bench-fleet"
PEER_ARMS = ("sglang_cache_aware", "vllm_router_cache_aware", "vllm_router_kv_aware")
SIM_POLICIES = ("kv-aware", "round-robin", "least-load", ORACLE)


@dataclasses.dataclass(frozen=True)
class Settings:
    trace: Path
    start: int
    count: int
    wall_s: float
    quick: bool
    sample: int | None  # replay this many requests, whole families drawn from the window
    seed: int


def settings(args: argparse.Namespace) -> Settings:
    count = args.count or 1500
    sample = args.sample if args.sample is not None else (300 if args.quick else None)
    wall = args.wall_s or (35.0 if args.quick else 240.0)
    return Settings(Path(args.trace), args.start, count, wall, args.quick, sample or None,
                    args.seed)  # fmt: skip


def window_requests(s: Settings, root: Path) -> tuple[list[Any], arms.Window]:
    """The requests every arm replays, and where the replay reads them: the trace's window,
    or (``--sample``) whole conversation families drawn from it, written as a Mooncake-format
    file of their own (``window.jsonl`` in the run's directory) that every arm, the simulator
    and the sizing read alike."""
    requests = read_mooncake(s.trace, Window(start=s.start, count=s.count))
    if s.sample is None:
        return requests, arms.Window(s.trace, s.start, len(requests))
    picked = sample_families(requests, s.sample, seed=s.seed)
    path = root / "window.jsonl"
    path.write_text("".join(dump_row(r) + "\n" for r in picked))
    sampled = read_mooncake(path)
    peers.log(
        f"sample: {len(sampled)} requests in whole families (seed {s.seed}) of the"
        f" {len(requests)} from #{s.start}: ideal hit {trace_stats(sampled).ideal_hit_ratio:.3f}"
        f" (the window's {trace_stats(requests).ideal_hit_ratio:.3f})"
    )
    return sampled, arms.Window(path, 0, len(sampled))


def run_arms(
    plan: sizing.FleetPlan, window: arms.Window, root: Path, only: set[str] | None
) -> tuple[dict[str, arms.ArmResult], dict[str, str]]:
    """Every arm (or ``only`` those); an arm that cannot run is recorded with why."""
    model = arms.MODEL
    plans: list[tuple[str, str, Callable[[], arms.ArmResult]]] = [
        ("kvpool_kv_aware", "kvpool gateway (kv-aware)",
         lambda: arms.run_arm("kvpool_kv_aware", "kvpool gateway (kv-aware)", plan, window, root)),
        ("kvpool_round_robin", "kvpool gateway (round-robin)",
         lambda: arms.run_arm("kvpool_round_robin", "kvpool gateway (round-robin)", plan, window,
                              root, policy="round-robin")),
        ("sglang_cache_aware", "sglang-router 0.3.2 (cache_aware)",
         lambda: arms.run_arm("sglang_cache_aware", "sglang-router 0.3.2 (cache_aware)", plan,
                              window, root, router=lambda f: arms.sglang(f, root))),
        ("vllm_router_cache_aware", "vllm-router 0.1.17 (cache_aware)",
         lambda: arms.run_arm("vllm_router_cache_aware", "vllm-router 0.1.17 (cache_aware)",
                              plan, window, root,
                              router=arms.vllm_router("cache_aware", root, plan, model))),
        ("vllm_router_kv_aware", "vllm-router 0.1.17 (kv_aware)",
         lambda: arms.run_arm("vllm_router_kv_aware", "vllm-router 0.1.17 (kv_aware)", plan,
                              window, root, kv_events=True,
                              router=arms.vllm_router("kv_aware", root, plan, model))),
        ("kvpool_two_replicas", "kvpool gateway x2 behind nginx (kv-aware)",
         lambda: arms.run_arm("kvpool_two_replicas", "kvpool gateway x2 behind nginx", plan,
                              window, root, router=arms.two_gateways(root))),
        ("dynamo_kv", "Dynamo 1.6.1 KV router (own mocker fleet)",
         lambda: arms.dynamo_arm("kv", plan, window, root)),
        ("dynamo_round_robin", "Dynamo 1.6.1 round-robin (own mocker fleet)",
         lambda: arms.dynamo_arm("round-robin", plan, window, root)),
    ]  # fmt: skip
    results: dict[str, arms.ArmResult] = {}
    skipped: dict[str, str] = {}
    for name, label, run in plans:
        if only is not None and name not in only:
            continue
        t0 = time.monotonic()
        peers.log(f"arm {name}: {label}")
        try:
            results[name] = run()
        except peers.PeerUnavailableError as exc:
            skipped[name] = str(exc)
            peers.log(f"arm {name} skipped: {exc}")
        except Exception as exc:  # one broken arm must not lose the others' measurements
            skipped[name] = f"{type(exc).__name__}: {exc}"
            peers.log(f"arm {name} failed:\n{traceback.format_exc()}")
        else:
            s = results[name].summary
            p90 = s["ttft_s"]["p90"]
            peers.log(
                f"arm {name}: TTFT p90 {'-' if p90 is None else f'{p90 * 1000:.0f}'} ms, hit "
                f"{s['hit_ratio']:.3f}, {s['completed']} answered, errors {s['errors']}, "
                f"{time.monotonic() - t0:.0f} s"
            )
    return results, skipped


def simulate(plan: sizing.FleetPlan, requests: list[Any], profile_name: str) -> dict[str, Any]:
    """The simulator on the same window and fleet, each policy and the oracle."""
    profile = bundled_profile(profile_name)
    out: dict[str, Any] = {}
    for policy in SIM_POLICIES:
        cfg = dataclasses.replace(plan.fleet_config(profile), policy=policy)
        run = FleetSim(cfg, time_scale=plan.time_scale).run(requests)
        s = summarize(run.results)
        s.pop("per_instance")
        s["wall_s"] = run.wall_s
        out[policy] = s
    return out


def full_trace_1000(trace: Path, profile_name: str) -> dict[str, float]:
    """The whole trace on 1000 simulated instances (wall seconds of the simulator)."""
    requests = read_mooncake(trace)
    profile = bundled_profile(profile_name)
    cfg = FleetConfig(instances=1000, profile=profile, ddr_bytes=64 << 30)
    run = FleetSim(cfg).run(requests)
    s = summarize(run.results)
    return {
        "sim_full_trace_1000_s": run.wall_s,
        "sim_full_trace_requests": float(len(requests)),
        "sim_full_trace_1000_ttft_p90_s": s["ttft_s"]["p90"],
        "sim_full_trace_1000_hit_ratio": s["hit_ratio"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument(
        "--quick", action="store_true", help="--sample 300 and a 35 s replay; every key kept"
    )
    ap.add_argument("--out", required=True, help="JSON result path")
    ap.add_argument("--trace", default=str(TRACE), help="a Mooncake-format trace")
    ap.add_argument("--start", type=int, default=0, help="first request of the window")
    ap.add_argument("--count", type=int, default=None, help="requests in the window (1500)")
    ap.add_argument(
        "--sample", type=int, default=None,
        help="replay about this many requests: whole conversation families drawn from the window",
    )  # fmt: skip
    ap.add_argument("--seed", type=int, default=0, help="the sample's random seed")
    ap.add_argument(
        "--wall-s", type=float, default=None, help="wall seconds the window takes (240; quick 35)"
    )
    ap.add_argument("--arms", default=None, help="comma-separated subset of the arms")
    ap.add_argument("--no-scale", action="store_true", help="skip the 1000-instance part")
    args = ap.parse_args()
    s = settings(args)
    only = set(args.arms.split(",")) if args.arms else None
    t0 = time.monotonic()
    root = RUNS / time.strftime("%Y%m%d-%H%M%S")
    root.mkdir(parents=True, exist_ok=True)
    peers.log(f"logs and replays of this run: {root}")
    requests, window = window_requests(s, root)
    profile = bundled_profile(PROFILE)
    peers.log(f"window: {len(requests)} requests of {s.trace.name} from #{s.start}")
    plan = sizing.plan_fleet(requests, profile, profile_name=PROFILE, wall_s=s.wall_s)
    peers.log(
        f"fleet: {plan.instances} x ({plan.device_kv_gib:g} GiB device, {plan.ddr_gib:g} GiB DDR);"
        f" capacity {plan.capacity_req_per_s:.2f} req/s, offered {plan.load:.0%}: trace x"
        f"{plan.time_scale:.2f}, sims at {plan.speedup:.3f} model s per wall s"
    )
    sim = simulate(plan, requests, PROFILE)
    load_start = os.getloadavg()[0]
    measured, skipped = run_arms(plan, window, root, only)
    load_end = os.getloadavg()[0]
    scale_m = {} if args.no_scale else scale.measure_scale(s.quick, root / "scale")
    big = full_trace_1000(s.trace, PROFILE)
    bounds = {
        "pooled_cache_hit_ratio": pooled_hit_ratio(requests, plan.fleet_config(profile)),
        "window_ideal_hit_ratio": trace_stats(requests).ideal_hit_ratio,
    }
    metrics, ratios = report.figures(plan, measured, sim, {**scale_m, **big, **bounds})
    result = {
        "component": "fleet",
        "quick": s.quick,
        "metrics": metrics,
        "ratios": ratios,
        "peers": {
            "sglang-router": version("sglang-router"),
            "vllm-router": peers.vllm_router_version(),
            "ai-dynamo": peers.dynamo_version(),
        },
        "env": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "trace": str(s.trace.name),
            "window": {
                "start": s.start,
                "count": s.count,
                "sample": s.sample,
                "seed": s.seed,
                "requests": len(requests),
            },
            "plan": dataclasses.asdict(plan),
            "loadavg_1m_start_end": [load_start, load_end],
            "skipped_arms": skipped,
            "arms": {n: {"label": a.label, "summary": a.summary} for n, a in measured.items()},
            "simulated": sim,
            "wall_s": time.monotonic() - t0,
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(json_safe(result), indent=2, sort_keys=True) + "\n")
    report.plot(measured, sim, out.with_suffix(".png"))
    print(report.table(plan, measured, sim, metrics, ratios, skipped))
    peers.log(f"wrote {out} and {out.with_suffix('.png')} in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
