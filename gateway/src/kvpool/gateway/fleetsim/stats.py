"""What a fleet run measured, summarised the same way for the simulator and a real replay.

Why this module exists: the simulator is judged by comparing its predictions with a run over
real sockets, and routers are compared with each other, so every run must be summarised by one
definition of each figure: TTFT (arrival to first token), TPOT ((end to end - TTFT) / (output
tokens - 1)), end-to-end latency, the hit ratio (cached prompt tokens / prompt tokens, from what
the engines reported), goodput under a TTFT (and optionally TPOT) SLO, and the load of each
instance. Pure.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["RequestResult", "json_safe", "percentile", "summarize"]


@dataclass(frozen=True, slots=True)
class RequestResult:
    """One request's outcome. Times in seconds; ``ttft_s`` None when it never produced a token
    (``error`` says why)."""

    index: int
    instance: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    reason: str = ""
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def percentile(values: Sequence[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN when empty."""
    if not values:
        return math.nan
    data = sorted(values)
    k = (len(data) - 1) * p / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (k - lo)


def _dist(values: Sequence[float]) -> dict[str, float]:
    return {
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "mean": sum(values) / len(values) if values else math.nan,
    }


def summarize(
    results: Iterable[RequestResult],
    *,
    slo_ttft_s: float | None = None,
    slo_tpot_s: float | None = None,
) -> dict[str, Any]:
    """Distributions, hit ratio, goodput and per-instance load of a run."""
    rows = list(results)
    ok = [r for r in rows if r.error is None and r.ttft_s is not None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [t for r in ok if (t := r.tpot_s) is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    start = min((r.arrival_s for r in rows), default=0.0)
    end = max((r.arrival_s + (r.e2e_s or 0.0) for r in rows), default=0.0)
    span = max(end - start, 1e-9)
    good = [
        r
        for r in ok
        if (slo_ttft_s is None or (r.ttft_s or 0.0) <= slo_ttft_s)
        and (slo_tpot_s is None or (r.tpot_s or 0.0) <= slo_tpot_s)
    ]
    per: dict[str, dict[str, float]] = defaultdict(
        lambda: {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0}
    )
    for r in ok:
        row = per[r.instance]
        row["requests"] += 1
        row["prompt_tokens"] += r.prompt_tokens
        row["cached_tokens"] += r.cached_tokens
    counts = [v["requests"] for v in per.values()]
    reasons: dict[str, int] = defaultdict(int)
    for r in ok:
        reasons[r.reason] += 1
    errors: dict[str, int] = defaultdict(int)
    for r in rows:
        if r.error is not None:
            errors[r.error] += 1
    return {
        "requests": len(rows),
        "completed": len(ok),
        "errors": dict(errors),
        "duration_s": span,
        "ttft_s": _dist(ttft),
        "tpot_s": _dist(tpot),
        "e2e_s": _dist(e2e),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_ratio": cached / prompt if prompt else 0.0,
        "goodput": {
            "slo_ttft_s": slo_ttft_s,
            "slo_tpot_s": slo_tpot_s,
            "requests": len(good),
            "share": len(good) / len(rows) if rows else 0.0,
            "req_per_s": len(good) / span,
        },
        "throughput_req_per_s": len(ok) / span,
        "reasons": dict(reasons),
        "per_instance": {k: dict(v) for k, v in sorted(per.items())},
        "load_imbalance": (max(counts) / (sum(counts) / len(counts))) if counts else 0.0,
    }


def json_safe(x: Any) -> Any:
    """NaN and infinities as null (recursively), so a summary is strict JSON."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [json_safe(v) for v in x]
    return x
