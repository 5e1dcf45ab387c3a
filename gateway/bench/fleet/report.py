"""The fleet benchmark's figures, table and plot, from the arms' and the simulator's summaries.

Why this module exists: the JSON keys the issue names (``ratios.ttft_p90_vs_best_peer``,
``metrics.hit_over_oracle``, ``metrics.sim_vs_measured_p90_err``, ``metrics.route_p99_ms_1000``,
``metrics.sim_full_trace_1000_s``) are defined here once, with every other figure of the run,
so run.py only measures. Definitions:

- best peer: the lowest TTFT p90 among sglang-router cache_aware and vllm-router cache_aware
  and kv_aware on the same fleet (Dynamo runs on its own fleet and is reported beside);
- ``hit_over_oracle``: kvpool's measured hit ratio / the most a router could hit with the
  same caches, ignoring load: the fleet's device, DDR and disk capacity pooled as one LRU
  cache serving the window in arrival order (``kvpool.gateway.fleetsim.bound``, whose
  docstring says why not the simulator's ``oracle`` router: sending each request to the
  longest prefix held, whatever the load, sends every request of a trace whose prompts share
  a first block to one instance, and hits less than round-robin);
- ``sim_vs_measured_*_err``: |simulated - measured| / measured, for kvpool's kv-aware arm.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from arms import ArmResult
from sizing import FleetPlan

from kvpool.gateway.fleetsim.fleet import ORACLE

PEERS = ("sglang_cache_aware", "vllm_router_cache_aware", "vllm_router_kv_aware")
OURS = "kvpool_kv_aware"


def _ms(s: dict[str, Any], q: str) -> float:
    value = s["ttft_s"][q]
    return math.nan if value is None else float(value) * 1000.0


def _div(a: float, b: float) -> float:
    return a / b if b and math.isfinite(b) else math.nan


def figures(
    plan: FleetPlan,
    measured: dict[str, ArmResult],
    sim: dict[str, dict[str, Any]],
    extra: dict[str, float],
) -> tuple[dict[str, float], dict[str, float]]:
    """``metrics`` and ``ratios`` of the run (NaN where an arm did not run)."""
    m: dict[str, float] = dict(extra)
    for name, arm in measured.items():
        s = arm.summary
        for q in ("p50", "p90", "p99"):
            m[f"ttft_{q}_ms_{name}"] = _ms(s, q)
        m[f"hit_ratio_{name}"] = float(s["hit_ratio"])
        m[f"tpot_p50_ms_{name}"] = float(s["tpot_s"]["p50"]) * 1000.0
        m[f"errors_{name}"] = float(sum(s["errors"].values()))
        m[f"completed_{name}"] = float(s["completed"])
    for policy, s in sim.items():
        key = policy.replace("-", "_")
        m[f"sim_ttft_p90_ms_{key}"] = _ms(s, "p90")
        m[f"sim_ttft_p50_ms_{key}"] = _ms(s, "p50")
        m[f"sim_hit_ratio_{key}"] = float(s["hit_ratio"])
    m.update(
        {
            "fleet_instances": float(plan.instances),
            "fleet_ddr_gib": plan.ddr_gib,
            "fleet_device_kv_gib": plan.device_kv_gib,
            "fleet_cache_fraction": plan.cache_fraction,
            "fleet_capacity_req_per_s": plan.capacity_req_per_s,
            "offered_load": plan.load,
            "trace_time_scale": plan.time_scale,
            "sim_speedup": plan.speedup,
            "window_requests": float(plan.requests),
        }
    )
    ours = measured.get(OURS)
    nan = math.nan
    bound = m["pooled_cache_hit_ratio"]
    m["hit_over_oracle"] = _div(float(ours.summary["hit_ratio"]), bound) if ours else nan
    m["sim_hit_over_oracle"] = _div(sim["kv-aware"]["hit_ratio"], bound)
    for name, arm in measured.items():
        m[f"hit_over_oracle_{name}"] = _div(float(arm.summary["hit_ratio"]), bound)
    if ours is not None:
        s = ours.summary
        m["sim_vs_measured_p90_err"] = abs(_div(_ms(sim["kv-aware"], "p90") - _ms(s, "p90"),
                                                _ms(s, "p90")))  # fmt: skip
        m["sim_vs_measured_p50_err"] = abs(_div(_ms(sim["kv-aware"], "p50") - _ms(s, "p50"),
                                                _ms(s, "p50")))  # fmt: skip
        m["sim_vs_measured_hit_err"] = abs(
            _div(sim["kv-aware"]["hit_ratio"] - s["hit_ratio"], s["hit_ratio"])
        )
    rr = measured.get("kvpool_round_robin")
    if rr is not None:
        m["sim_vs_measured_p90_err_round_robin"] = abs(
            _div(_ms(sim["round-robin"], "p90") - _ms(rr.summary, "p90"), _ms(rr.summary, "p90"))
        )
    r: dict[str, float] = {}
    peers = {n: _ms(measured[n].summary, "p90") for n in PEERS if n in measured}
    if ours is not None and peers:
        best = min(peers, key=peers.__getitem__)
        r["ttft_p90_vs_best_peer"] = _div(_ms(ours.summary, "p90"), peers[best])
        m["best_peer_is_" + best] = 1.0
        r["hit_ratio_vs_best_peer"] = _div(
            float(ours.summary["hit_ratio"]), float(measured[best].summary["hit_ratio"])
        )
        for n, p90 in peers.items():
            r[f"ttft_p90_vs_{n}"] = _div(_ms(ours.summary, "p90"), p90)
    if ours is not None and rr is not None:
        r["ttft_p90_vs_round_robin"] = _div(_ms(ours.summary, "p90"), _ms(rr.summary, "p90"))
    two = measured.get("kvpool_two_replicas")
    if ours is not None and two is not None:
        r["two_replicas_ttft_p90_vs_one"] = _div(_ms(two.summary, "p90"), _ms(ours.summary, "p90"))
        r["two_replicas_hit_vs_one"] = _div(
            float(two.summary["hit_ratio"]), float(ours.summary["hit_ratio"])
        )
    dkv, drr = measured.get("dynamo_kv"), measured.get("dynamo_round_robin")
    if dkv is not None and drr is not None:
        r["dynamo_kv_ttft_p90_vs_its_round_robin"] = _div(
            _ms(dkv.summary, "p90"), _ms(drr.summary, "p90")
        )
    return m, r


def table(
    plan: FleetPlan,
    measured: dict[str, ArmResult],
    sim: dict[str, dict[str, Any]],
    metrics: dict[str, float],
    ratios: dict[str, float],
    skipped: dict[str, str],
) -> str:
    lines = [
        f"fleet: {plan.instances} sim instances ({plan.profile}), {plan.device_kv_gib:g} GiB "
        f"device KV and {plan.ddr_gib:g} GiB DDR each (DDR = {plan.cache_fraction:.2f} of the "
        f"window's {plan.distinct_chunks:,} distinct chunks); {plan.requests} requests offered "
        f"at {plan.load:.0%} of the fleet's {plan.capacity_req_per_s:.2f} req/s (trace x"
        f"{plan.time_scale:.2f}); times in model seconds",
        "",
        "| router | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | TPOT p50 ms | hit ratio | errors |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm in measured.values():
        s = arm.summary
        lines.append(
            f"| {arm.label} | {_ms(s, 'p50'):.0f} | {_ms(s, 'p90'):.0f} | {_ms(s, 'p99'):.0f} | "
            f"{s['tpot_s']['p50'] * 1000:.1f} | {s['hit_ratio']:.3f} | "
            f"{sum(s['errors'].values())} |"
        )
    for name, why in skipped.items():
        lines.append(f"| {name} | not run: {why.splitlines()[0][:80]} | | | | | |")
    lines += ["", "| simulator (same window and fleet) | TTFT p50 ms | TTFT p90 ms | hit ratio |"]
    lines.append("|---|---|---|---|")
    for policy, s in sim.items():
        label = "oracle router (longest prefix held, ignores load)" if policy == ORACLE else policy
        lines.append(
            f"| {label} | {_ms(s, 'p50'):.0f} | {_ms(s, 'p90'):.0f} | {s['hit_ratio']:.3f} |"
        )
    lines.append(
        f"| bound: the fleet's caches pooled as one LRU (no router) | | | "
        f"{metrics.get('pooled_cache_hit_ratio', math.nan):.3f} |"
    )
    lines.append(
        f"| the window's ideal (unbounded cache) | | | "
        f"{metrics.get('window_ideal_hit_ratio', math.nan):.3f} |"
    )
    lines += ["", "| figure | value | target |", "|---|---|---|"]
    rows = [
        ("ratios.ttft_p90_vs_best_peer", ratios.get("ttft_p90_vs_best_peer"), "<= 0.5"),
        ("metrics.hit_over_oracle", metrics.get("hit_over_oracle"), ">= 0.9"),
        ("metrics.sim_vs_measured_p90_err", metrics.get("sim_vs_measured_p90_err"), "<= 0.15"),
        ("metrics.sim_full_trace_1000_s", metrics.get("sim_full_trace_1000_s"), "<= 60"),
        ("metrics.route_p99_ms_1000", metrics.get("route_p99_ms_1000"), "<= 1"),
        ("ratios.two_replicas_ttft_p90_vs_one", ratios.get("two_replicas_ttft_p90_vs_one"), "~1"),
        (
            "ratios.dynamo_kv_ttft_p90_vs_its_round_robin",
            ratios.get("dynamo_kv_ttft_p90_vs_its_round_robin"),
            "(beside ours: ratios.ttft_p90_vs_round_robin "
            f"{ratios.get('ttft_p90_vs_round_robin', math.nan):.3f})",
        ),
    ]
    for key, value, target in rows:
        shown = "-" if value is None or not math.isfinite(value) else f"{value:.3f}"
        lines.append(f"| {key} | {shown} | {target} |")
    return "\n".join(lines)


def plot(measured: dict[str, ArmResult], sim: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.5))
    names = [a.label for a in measured.values()]
    for i, q in enumerate(("p50", "p90", "p99")):
        ax.barh(
            [y + i * 0.27 for y in range(len(names))],
            [_ms(a.summary, q) for a in measured.values()],
            height=0.27,
            label=f"TTFT {q}",
        )
    ax.set_yticks([y + 0.27 for y in range(len(names))], names, fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("ms (model time)")
    ax.legend(fontsize=7)
    ax.set_title("measured, same fleet and window")
    bx.bar(list(sim), [s["hit_ratio"] for s in sim.values()], color="grey", label="simulated")
    for arm in measured.values():
        bx.axhline(arm.summary["hit_ratio"], linestyle=":", linewidth=0.8)
    bx.set_ylabel("hit ratio")
    bx.set_title("simulator (bars) vs measured (lines)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
