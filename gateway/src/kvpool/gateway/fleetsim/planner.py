"""The capacity planner: the smallest fleet whose TTFT p90 meets a target on a given trace.

Why this module exists: "how many instances, and how much DDR each, for this workload?" is the
question a platform engineer asks before buying hardware, and the answer depends on how much of
the workload's KV the fleet can reuse, which depends on the router. The planner runs the fleet
simulator over a grid of instance counts, DDR sizes and policies on one trace window and
reports, per policy and DDR size, the smallest instance count whose TTFT p90 is at most the
target. Pure apart from the simulations it runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvpool.gateway.fleetsim.fleet import FleetConfig, FleetSim
from kvpool.gateway.fleetsim.stats import summarize
from kvpool.gateway.traces.mooncake import TraceRequest

__all__ = ["PlanPoint", "plan", "smallest"]

GIB = 1024**3


@dataclass(frozen=True)
class PlanPoint:
    """One simulated fleet of the sweep and what it measured."""

    policy: str
    instances: int
    ddr_gib: float
    ttft_p90_s: float
    ttft_p50_s: float
    hit_ratio: float
    goodput_share: float
    wall_s: float


def plan(
    base: FleetConfig,
    requests: Sequence[TraceRequest],
    *,
    instances: Sequence[int],
    ddr_gib: Sequence[float],
    policies: Sequence[str],
    time_scale: float = 1.0,
    slo_ttft_s: float | None = None,
    progress: Callable[[PlanPoint], None] | None = None,
) -> list[PlanPoint]:
    """Simulate every (policy, DDR, instances) combination of the grid."""
    points: list[PlanPoint] = []
    for policy in policies:
        for gib in ddr_gib:
            for n in sorted(instances):
                cfg = dataclasses.replace(
                    base, instances=n, ddr_bytes=int(gib * GIB), policy=policy
                )
                run = FleetSim(cfg, time_scale=time_scale).run(requests)
                s = summarize(run.results, slo_ttft_s=slo_ttft_s)
                point = PlanPoint(
                    policy,
                    n,
                    gib,
                    s["ttft_s"]["p90"],
                    s["ttft_s"]["p50"],
                    s["hit_ratio"],
                    s["goodput"]["share"],
                    run.wall_s,
                )
                points.append(point)
                if progress is not None:
                    progress(point)
    return points


def smallest(points: Sequence[PlanPoint], target_p90_s: float) -> dict[str, Any]:
    """Per policy and DDR size: the fewest instances with TTFT p90 <= target (None: none of
    the sweep did), and per policy the fewest instances over every DDR size."""
    table: dict[str, dict[str, int | None]] = {}
    best: dict[str, dict[str, Any] | None] = {}
    for p in points:
        row = table.setdefault(p.policy, {})
        key = f"{p.ddr_gib:g}"
        row.setdefault(key, None)
        have = row[key]
        if p.ttft_p90_s <= target_p90_s and (have is None or p.instances < have):
            row[key] = p.instances
            current = best.get(p.policy)
            if current is None or p.instances < current["instances"]:
                best[p.policy] = {"instances": p.instances, "ddr_gib": p.ddr_gib}
        best.setdefault(p.policy, None)
    return {"target_ttft_p90_s": target_p90_s, "by_ddr": table, "smallest": best}
