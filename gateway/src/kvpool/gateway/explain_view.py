"""How an explanation reads: why the winner won, which chunks were held where, and the whole
report as text for ``kvpool-gateway explain``. Pure: no I/O.

Why this module exists: the explain endpoint answers JSON (what a program reads) and the CLI
prints it for a person; both say the same things, and the sentences (why a candidate won, what
a run of chunks was) are written once, here, from the report's own fields.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["held_runs", "render_text", "why"]

_FALLBACK = {
    "fallback-session": "by session affinity",
    "fallback-least-load": "by least load",
}
TEXT_NAMES = 8  # instance names printed per group before "and N more"


def _load(row: Mapping[str, Any]) -> str:
    ttft = row.get("ttft_ms")
    slow = f", recent TTFT {ttft:.0f} ms" if isinstance(ttft, int | float) else ""
    return f"{row['inflight']} in flight, {row['queued_prefill_tokens']:,} tokens queued{slow}"


def why(step: Mapping[str, Any]) -> str:
    """One sentence: why ``step['instance']`` won (from the step's reason and candidates)."""
    reason = str(step["reason"])
    rows: Sequence[Mapping[str, Any]] = step.get("candidates") or []
    winner = next((r for r in rows if r["instance"] == step["instance"]), None)
    holder = max(rows, key=lambda r: r["hit_chunks"], default=None)
    if step.get("note"):
        return str(step["note"])
    if reason == "pinned":
        return "the request named its instance (x-kvpool-instance)"
    if reason in _FALLBACK:
        return (
            "the index could not be trusted (controller down or replica out of sync): routed "
            + _FALLBACK[reason]
        )
    if reason.startswith("pd-decode"):
        return "the decode instance is chosen by load: the prompt's KV arrives by transfer"
    if winner is None:
        return f"chosen by the {reason} policy"
    if reason == "imbalance-guard" and holder is not None:
        best = max(rows, key=lambda r: r["score"] if r["score"] is not None else -1e300)
        return (
            f"{best['instance']} scored highest but carried {best['inflight']} requests in "
            f"flight, past the imbalance bound; {winner['instance']} was the best eligible "
            f"({_load(winner)})"
        )
    if reason in ("kv-hit", "kv-miss-least-load"):
        held = (
            f"held {winner['hit_chunks']} leading chunks"
            if winner["hit_chunks"]
            else "held nothing of the prompt"
        )
        text = f"highest score {winner['score']:,.1f}: {held} at load {_load(winner)}"
        if holder is not None and holder["hit_chunks"] > winner["hit_chunks"]:
            text += (
                f"; {holder['instance']} held more ({holder['hit_chunks']} chunks) but its "
                f"load cost more (score {holder['score']:,.1f}: {_load(holder)})"
            )
        return text
    return f"chosen by the {reason} policy ({_load(winner)})"


def held_runs(groups: Sequence[Mapping[str, Any]], chunks: int) -> list[dict[str, Any]]:
    """Runs of chunks by who held them when routed: ``{"chunks": [a, b], "holders": n,
    "groups": [index of each group holding them]}``, from the groups' hit chunks."""
    ends = sorted({int(g["hit_chunks"]) for g in groups if g["hit_chunks"] > 0})
    out: list[dict[str, Any]] = []
    start = 0
    for held in ends:
        end = min(held, chunks)
        if end <= start:
            continue
        holding = [i for i, g in enumerate(groups) if g["hit_chunks"] >= end]
        out.append(
            {
                "chunks": [start, end - 1],
                "holders": sum(int(groups[i]["count"]) for i in holding),
                "groups": holding,
            }
        )
        start = end
    return out


def _names(names: Sequence[str], count: int) -> str:
    shown = ", ".join(names[:TEXT_NAMES])
    more = count - min(len(names), TEXT_NAMES)
    return shown + (f" and {more} more" if more > 0 else "")


def _chunks(pair: Sequence[int]) -> str:
    a, b = pair
    return f"chunk {a}" if a == b else f"chunks {a}-{b}"


def _when(at: float) -> str:
    return dt.datetime.fromtimestamp(at, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def render_text(report: Mapping[str, Any]) -> str:
    """The report as the CLI prints it."""
    lines = []
    head = f"request {report['request_id']}"
    if report.get("at") is not None:
        head += f" at {_when(report['at'])}"
    if report.get("dry_run"):
        head += " (dry run: what the gateway would do now)"
    lines.append(head)
    session = f", session {report['session']}" if report.get("session") else ""
    lines.append(
        f"  {report['endpoint']}{session}: {report['prompt_tokens']:,} prompt tokens, "
        f"{report['chunks']} full chunks of {report['chunk_size']}"
    )
    for step in report.get("routing", []):
        lines.append(
            f"{step['role']}: {step['instance']} ({step['reason']}, "
            f"{step['predicted_hit_tokens']:,} tokens expected cached; "
            f"{step['available']} candidates)"
        )
        lines.append(f"  why: {step['why']}")
        for row in step.get("candidates", []):
            mark = "*" if row["instance"] == step["instance"] else " "
            score = f"{row['score']:>12,.1f}" if row["score"] is not None else f"{'-':>12}"
            tiers = ", ".join(f"{k} {v}" for k, v in sorted(row["per_location"].items()))
            lines.append(
                f"   {mark} {row['instance']:<24} score {score}  holds {row['hit_chunks']:>4} "
                f"chunks{f' ({tiers})' if tiers else ''}; {_load(row)}"
            )
        if step.get("frozen"):
            lines.append(f"  frozen (full sync) then: {', '.join(step['frozen'])}")
    index = report["index"]
    lines.append(f"index ({index['mode']}): {len(index['groups'])} distinct answers")
    for i, g in enumerate(index["groups"]):
        tiers = ", ".join(f"{k} {v}" for k, v in sorted(g["per_location"].items()))
        lines.append(
            f"  [{i}] {g['count']} instance(s) {_names(g['instances'], g['count'])}: "
            f"{g['hit_chunks']} chunks ({tiers or 'tiers unknown'})"
        )
    for run in report.get("held", []):
        lines.append(
            f"  {_chunks(run['chunks'])}: held by {run['holders']} instance(s) "
            f"(groups {', '.join(str(g) for g in run['groups'])})"
        )
    missed = report.get("missed", [])
    if not missed and report["chunks"]:
        lines.append("every full chunk was held somewhere")
    for run in missed:
        lines.append(f"  {_chunks(run['chunks'])}: missed everywhere: {run['reason']}")
        lines.append(f"    {run['detail']}")
    pool = report.get("pool") or {}
    for r in pool.get("refused", []):
        lines.append(f"refused by the controller: {r['instance_id']} ({r['reason']})")
    for name, held in sorted((pool.get("holds") or {}).items()):
        lines.append(f"{name} holds {held:,} tokens of this prompt by its own lookup")
    for note in report.get("notes", []):
        lines.append(f"note: {note}")
    return "\n".join(lines) + "\n"
