"""What ``kvpool-gateway replay`` measured: the summary, its Markdown table and its plot.

Why this module exists: a replay and the fleet simulator are compared figure by figure, so the
replay's outcomes are summarised by the simulator's own definitions
(:func:`kvpool.gateway.fleetsim.stats.summarize`: TTFT, TPOT, end-to-end percentiles, hit
ratio from usage, SLO goodput, per-instance load), and this module adds what only a run over
sockets has: how late the open loop sent (an overloaded client shows there), the SSE event
rate, errors with a sample message each, requests never sent, and the workers' own counters
before and after. Pure apart from :func:`plot`, which writes a PNG with matplotlib.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvpool.gateway.fleetsim.stats import RequestResult, percentile, summarize
from kvpool.gateway.loadgen import Outcome, ReplayRun

UNKNOWN_INSTANCE = ""  # the endpoint did not say which instance served


def _results(outcomes: Sequence[Outcome]) -> list[RequestResult]:
    return [
        RequestResult(
            index=o.index,
            instance=o.instance or UNKNOWN_INSTANCE,
            arrival_s=o.sent_s,
            prompt_tokens=o.prompt_tokens or 0,
            output_tokens=o.output_tokens,
            cached_tokens=o.cached_tokens or 0,
            ttft_s=o.ttft_s,
            e2e_s=o.e2e_s,
            reason=o.reason or "",
            error=o.error,
        )
        for o in outcomes
    ]


def worker_deltas(
    before: Mapping[str, Mapping[str, float]], after: Mapping[str, Mapping[str, float]]
) -> dict[str, dict[str, float]]:
    """Per worker URL: each counter's increase over the replay, and its share of requests. A
    counter first seen after (a labelled counter has no sample until its first increment)
    started at 0."""
    out = {
        url: {k: v - before[url].get(k, 0.0) for k, v in after[url].items()}
        for url in before
        if url in after
    }
    total = sum(d.get("requests", 0.0) for d in out.values())
    for d in out.values():
        if "requests" in d:
            d["share"] = d["requests"] / total if total else 0.0
    return out


def summarize_run(
    run: ReplayRun,
    *,
    slo_ttft_s: float | None = None,
    slo_tpot_s: float | None = None,
    workers: Mapping[str, Mapping[str, float]] | None = None,
) -> dict[str, Any]:
    """The run's figures (seconds, tokens, ratios); see the module docstring."""
    out = summarize(_results(run.outcomes), slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s)
    per = {k: v for k, v in out["per_instance"].items() if k != UNKNOWN_INSTANCE}
    out["per_instance"] = per
    counts = [v["requests"] for v in per.values()]
    out["load_imbalance"] = max(counts) / (sum(counts) / len(counts)) if counts else None
    if not any(out["reasons"].keys() - {""}):
        out["reasons"] = {}
    ok = [o for o in run.outcomes if o.ok]
    late = [o.lateness_s for o in run.outcomes]
    events = sum(o.events for o in run.outcomes)
    output = sum(o.output_tokens for o in ok)
    span = max(run.duration_s, 1e-9)
    details: dict[str, str] = {}
    for o in run.outcomes:
        if o.error is not None and o.error not in details:
            details[o.error] = o.detail[:300]
    out.update(
        {
            "lateness_s": {
                "p50": percentile(late, 50),
                "p90": percentile(late, 90),
                "p99": percentile(late, 99),
                "max": max(late, default=math.nan),
            },
            "sse_events": events,
            "sse_events_per_s": events / span,
            "output_tokens": output,
            "output_tokens_per_s": output / span,
            "trace_prompt_tokens": sum(o.trace_prompt_tokens for o in ok),
            "missing_usage": sum(1 for o in ok if o.prompt_tokens is None),
            "error_details": details,
            "not_sent": run.not_sent,
            "stopped": run.stopped,
            "workers": dict(workers or {}),
        }
    )
    return out


def _ms(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{x * 1e3:,.1f}"


def markdown(s: Mapping[str, Any]) -> str:
    """The summary as Markdown tables (latencies in ms)."""
    good = s["goodput"]
    slo = ", ".join(
        f"{name} ≤ {v * 1e3:g} ms"
        for name, v in (("TTFT", good["slo_ttft_s"]), ("TPOT", good["slo_tpot_s"]))
        if v is not None
    )
    lines = [
        "| requests | completed | errors | not sent | req/s | output tok/s | hit ratio "
        "| goodput req/s | goodput share |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {s['requests']} | {s['completed']} | {sum(s['errors'].values())} | {s['not_sent']} "
        f"| {s['throughput_req_per_s']:.2f} | {s['output_tokens_per_s']:,.0f} "
        f"| {s['hit_ratio']:.3f} | "
        + (f"{good['req_per_s']:.2f} | {good['share']:.3f} |" if slo else "- | - |"),
        "",
        "| ms | p50 | p90 | p99 | mean |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, key in (("TTFT", "ttft_s"), ("TPOT", "tpot_s"), ("end to end", "e2e_s")):
        d = s[key]
        lines.append(
            f"| {label} | {_ms(d['p50'])} | {_ms(d['p90'])} | {_ms(d['p99'])} | {_ms(d['mean'])} |"
        )
    late = s["lateness_s"]
    lines.append(
        f"| send lateness | {_ms(late['p50'])} | {_ms(late['p90'])} | "
        f"{_ms(late['p99'])} | max {_ms(late['max'])} |"
    )
    notes = [
        f"hit ratio = {s['cached_tokens']:,} cached / {s['prompt_tokens']:,} prompt tokens "
        f"(usage; the trace asked for {s['trace_prompt_tokens']:,})",
        f"{s['sse_events']:,} SSE events, {s['sse_events_per_s']:,.0f}/s; "
        f"{s['duration_s']:.1f} s from first send to last answer",
    ]
    if slo:
        notes.append(f"goodput: completed with {slo}")
    if s["missing_usage"]:
        notes.append(f"{s['missing_usage']} answers carried no usage (not in the hit ratio)")
    if s["stopped"]:
        notes.append("stopped early (interrupted)")
    lines += ["", *(f"- {n}" for n in notes)]
    if s["errors"]:
        lines += ["", "| error | count | first message |", "|---|---:|---|"]
        for kind, n in sorted(s["errors"].items(), key=lambda kv: -kv[1]):
            msg = s["error_details"].get(kind, "").replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {kind} | {n} | {msg[:120]} |")
    if s["per_instance"]:
        lines += [
            "",
            "| instance (x-kvpool-instance) | requests | share | prompt tokens | hit ratio |",
            "|---|---:|---:|---:|---:|",
        ]
        total = sum(v["requests"] for v in s["per_instance"].values()) or 1
        for name, v in s["per_instance"].items():
            hit = v["cached_tokens"] / v["prompt_tokens"] if v["prompt_tokens"] else 0.0
            lines.append(
                f"| {name} | {v['requests']:.0f} | {v['requests'] / total:.3f} "
                f"| {v['prompt_tokens']:,.0f} | {hit:.3f} |"
            )
    if s["workers"]:
        lines += [
            "",
            "| worker (its /metrics, during the replay) | requests | share "
            "| prompt tokens | prefix hit tokens |",
            "|---|---:|---:|---:|---:|",
        ]
        for url, d in s["workers"].items():
            cells = [f"{d[k]:,.0f}" if k in d else "-" for k in ("requests",)]
            cells.append(f"{d['share']:.3f}" if "share" in d else "-")
            cells += [
                f"{d[k]:,.0f}" if k in d else "-" for k in ("prompt_tokens", "prefix_hit_tokens")
            ]
            lines.append(f"| {url} | {' | '.join(cells)} |")
    return "\n".join(lines)


def plot(run: ReplayRun, s: Mapping[str, Any], path: Path, title: str) -> None:
    """TTFT distribution, TTFT and send lateness over the run, load per instance (PNG)."""
    import matplotlib  # noqa: PLC0415 (optional: only --plot needs it)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    ok = [o for o in run.outcomes if o.ok and o.ttft_s is not None]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    for label, values in (
        ("TTFT", sorted(o.ttft_s * 1e3 for o in ok if o.ttft_s is not None)),
        ("end to end", sorted(o.e2e_s * 1e3 for o in ok if o.e2e_s is not None)),
    ):
        if values:
            ax.step(
                values,
                [(i + 1) / len(values) for i in range(len(values))],
                where="post",
                label=label,
            )
    if s["goodput"]["slo_ttft_s"] is not None:
        ax.axvline(s["goodput"]["slo_ttft_s"] * 1e3, color="red", ls="--", label="TTFT SLO")
    ax.set_xscale("log")
    ax.set_xlabel("ms (log scale)")
    ax.set_ylabel("fraction of completed requests")
    ax.legend(loc="lower right")
    ax.grid(True, which="both", alpha=0.3)
    ax = axes[1]
    ax.scatter(
        [o.sent_s for o in ok],
        [o.ttft_s * 1e3 for o in ok if o.ttft_s is not None],
        s=4,
        label="TTFT",
    )
    ax.scatter(
        [o.sent_s for o in run.outcomes],
        [o.lateness_s * 1e3 for o in run.outcomes],
        s=4,
        label="send lateness",
    )
    failed = [o for o in run.outcomes if not o.ok]
    if failed:
        ax.scatter(
            [o.sent_s for o in failed],
            [1.0] * len(failed),
            s=10,
            marker="x",
            color="red",
            label="error",
        )
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_xlabel("sent at (s into the replay)")
    ax.set_ylabel("ms")
    ax.legend(loc="upper left")
    ax.grid(True, alpha=0.3)
    ax = axes[2]
    per = s["per_instance"] or {
        url: {"requests": d.get("requests", 0.0)} for url, d in s["workers"].items()
    }
    if per:
        names = list(per)
        ax.bar(range(len(names)), [per[n]["requests"] for n in names])
        ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=7)
        ax.set_ylabel("requests served")
    else:
        ax.text(
            0.5,
            0.5,
            "the endpoint named no instance\n(no --worker-metrics)",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
        ax.set_axis_off()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
