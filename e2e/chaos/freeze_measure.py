"""What the freeze bench counts, from what it recorded: pure functions, no I/O.

Why this module exists: the freeze window is measured from three records that do not share a
clock or a format: each worker's log (LMCache's "Entering freeze mode" / "Exiting freeze
mode" lines and kvpool's "store of N tokens skipped", wall-clock stamped to the millisecond),
the gateway's ``/readyz`` sampled every 0.1 s (which instances it knows frozen), and the
client's requests (monotonic clock, the instance that answered). Here they become intervals on
one clock and, per controller kill, the figures of the report (bench-results/freeze.json and
its table); :mod:`chaos.freeze` does the running.

A request is stored twice by the worker that answers it: its prompt when the prefill ends
(``sent + ttft``) and prompt and answer when it ends (``sent + e2e``); the worker's skipped-store
count is of those calls. A request *reached a frozen worker* when its prompt's store fell in a
freeze of that worker, and its *KV was not kept* when the store at its end did too (that one
covers the prompt's chunks); so skipped store calls = reached + not kept, give or take the
client's view of when the prefill ended (its first token). It was *kept off* a frozen worker
when it was sent while the gateway listed another worker frozen and went elsewhere (while that
worker was frozen, or after it had thawed and the gateway's probe had not yet seen it).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

Interval = tuple[float, float]

_STAMP = re.compile(r"(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d[,.]\d{3})")
_ENTER = "Entering freeze mode"
_EXIT = "Exiting freeze mode"
_SKIPPED = re.compile(r"store of (\d+) tokens skipped: LMCache is frozen")


@dataclass
class WorkerLog:
    """One worker's freezes (closed intervals; an open one ends at ``until``) and skipped
    stores (time, tokens), on the monotonic clock."""

    freezes: list[Interval] = field(default_factory=list)
    skipped: list[tuple[float, int]] = field(default_factory=list)


def _stamp(line: str, wall_to_mono: float) -> float | None:
    m = _STAMP.search(line)
    if m is None:
        return None
    wall = datetime.strptime(m.group(1).replace("T", " ").replace(",", "."), "%Y-%m-%d %H:%M:%S.%f")
    return wall.timestamp() - wall_to_mono


def parse_worker_log(text: str, wall_to_mono: float, until: float) -> WorkerLog:
    """The freezes and skipped stores in a worker's log; ``wall_to_mono``: ``time.time() -
    time.monotonic()`` measured on the same host (the log's stamps are local wall time)."""
    out = WorkerLog()
    start: float | None = None
    for line in text.splitlines():
        if _ENTER in line or _EXIT in line or "tokens skipped" in line:
            t = _stamp(line, wall_to_mono)
            if t is None:
                continue
            if _ENTER in line:
                start = t
            elif _EXIT in line and start is not None:
                out.freezes.append((start, t))
                start = None
            elif (m := _SKIPPED.search(line)) is not None:
                out.skipped.append((t, int(m.group(1))))
    if start is not None:
        out.freezes.append((start, until))
    return out


def known_frozen(
    samples: Sequence[tuple[float, frozenset[str] | None]],
) -> dict[str, list[Interval]]:
    """Per instance, when the gateway's ``/readyz`` listed it frozen: from the first sample
    that did to the first that did not (a failed sample ends nothing)."""
    out: dict[str, list[Interval]] = {}
    since: dict[str, float] = {}
    for t, frozen in samples:
        if frozen is None:
            continue
        for name in frozen:
            since.setdefault(name, t)
        for name in [n for n in since if n not in frozen]:
            out.setdefault(name, []).append((since.pop(name), t))
    if samples:
        for name, t0 in since.items():
            out.setdefault(name, []).append((t0, samples[-1][0]))
    return out


def _inside(t: float, spans: Iterable[Interval]) -> bool:
    return any(a <= t < b for a, b in spans)


def _clip(spans: Iterable[Interval], lo: float, hi: float) -> list[Interval]:
    return [(max(a, lo), min(b, hi)) for a, b in spans if b > lo and a < hi]


def _overlap(xs: Iterable[Interval], ys: Sequence[Interval]) -> float:
    return sum(max(0.0, min(b, d) - max(a, c)) for a, b in xs for c, d in ys)


@dataclass(frozen=True)
class Req:
    """One answered request: the instance, when it was sent, its prefill ended (its prompt's
    store) and it ended (the store of prompt and answer), on the monotonic clock; prompt and
    cached tokens."""

    instance: str
    sent: float
    prefilled: float
    done: float
    prompt: int
    cached: int


def kill_figures(
    kill: float,
    end: float,
    logs: Mapping[str, WorkerLog],
    known: Mapping[str, list[Interval]],
    reqs: Sequence[Req],
) -> dict[str, Any]:
    """One controller kill's figures over [kill, end): per worker its freezes (seconds, and
    how long after the kill each began), skipped stores, and what the gateway knew; the
    requests that reached a frozen worker or were kept off one."""
    workers: dict[str, Any] = {}
    frozen: dict[str, list[Interval]] = {}
    for name, log in sorted(logs.items()):
        spans = _clip(log.freezes, kill, end)
        frozen[name] = spans
        seen = _clip(known.get(name, []), kill, end)
        skipped = [n for t, n in log.skipped if kill <= t < end]
        workers[name] = {
            "freezes": len(spans),
            "frozen_s": round(sum(b - a for a, b in spans), 3),
            "freeze_starts_after_kill_s": [round(a - kill, 2) for a, _ in spans],
            "gateway_listed_frozen_s": round(sum(b - a for a, b in seen), 3),
            "gateway_listed_while_frozen_s": round(_overlap(seen, spans), 3),
            "stores_skipped": len(skipped),
            "tokens_skipped": sum(skipped),
        }
    mine = [r for r in reqs if kill <= r.sent < end]
    met = [r for r in mine if _inside(r.prefilled, frozen.get(r.instance, []))]
    # both stores inside one freeze: nothing of the request was kept (the store at its end
    # covers the prompt's chunks, so a dropped prompt store alone is made good then)
    lost = [
        r
        for r in met
        if any(a <= r.prefilled and r.done < b for a, b in frozen.get(r.instance, []))
    ]
    # sent while the gateway listed another worker frozen (and not the one that answered)
    steered = {
        id(r): [w for w, spans in known.items() if w != r.instance and _inside(r.sent, spans)]
        for r in mine
        if not _inside(r.sent, known.get(r.instance, []))
    }
    kept_off = [r for r in mine if steered.get(id(r))]
    while_frozen = [
        r for r in kept_off if any(_inside(r.sent, frozen.get(w, [])) for w in steered[id(r)])
    ]
    return {
        "requests": len(mine),
        "reached_frozen_worker": len(met),
        "kv_not_kept": len(lost),
        "kept_off_frozen_worker": len(while_frozen),
        "kept_off_thawed_worker": len(kept_off) - len(while_frozen),
        "workers": workers,
    }


def hit_ratio(reqs: Iterable[Req], lo: float, hi: float) -> tuple[float | None, int]:
    """Cached / prompt tokens of the requests sent in [lo, hi), and how many there were."""
    chosen = [r for r in reqs if lo <= r.sent < hi]
    prompt = sum(r.prompt for r in chosen)
    return (sum(r.cached for r in chosen) / prompt if prompt else None), len(chosen)


def dip(
    reqs: Sequence[Req], kill: float, end: float, pre_s: float, window_s: float
) -> dict[str, Any]:
    """The hit ratio over ``pre_s`` before the kill and the lowest over ``window_s`` windows
    (1 s steps, at least 3 requests each) after it."""
    pre, _ = hit_ratio(reqs, kill - pre_s, kill)
    lowest: float | None = None
    t = kill
    while t + window_s <= end:
        ratio, n = hit_ratio(reqs, t, t + window_s)
        if ratio is not None and n >= 3:
            lowest = ratio if lowest is None else min(lowest, ratio)
        t += 1.0
    return {"hit_ratio_pre": _r(pre), "hit_ratio_lowest": _r(lowest)}


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def arm_summary(kills: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """An arm's kills added up: freezes and frozen seconds per worker, stores and tokens
    skipped, requests that reached or were kept off a frozen worker, the hit ratio's dip."""
    per: dict[str, dict[str, Any]] = {}
    for k in kills:
        for name, w in k["workers"].items():
            acc = per.setdefault(
                name, {"freezes": 0, "frozen_s": [], "listed_s": 0.0, "listed_frozen_s": 0.0}
            )
            acc["freezes"] += w["freezes"]
            acc["frozen_s"].append(w["frozen_s"])
            acc["listed_s"] += w["gateway_listed_frozen_s"]
            acc["listed_frozen_s"] += w["gateway_listed_while_frozen_s"]
    frozen_total = sum(sum(a["frozen_s"]) for a in per.values())
    listed_total = sum(a["listed_s"] for a in per.values())
    listed_frozen = sum(a["listed_frozen_s"] for a in per.values())
    return {
        "kills": len(kills),
        "full_syncs": sum(k["controller_full_syncs_completed"] or 0 for k in kills),
        "freezes": sum(a["freezes"] for a in per.values()),
        "frozen_s_per_worker_per_kill": {n: a["frozen_s"] for n, a in per.items()},
        "stores_skipped": sum(w["stores_skipped"] for k in kills for w in k["workers"].values()),
        "tokens_skipped": sum(w["tokens_skipped"] for k in kills for w in k["workers"].values()),
        "requests": sum(k["requests"] for k in kills),
        "reached_frozen_worker": sum(k["reached_frozen_worker"] for k in kills),
        "kv_not_kept": sum(k["kv_not_kept"] for k in kills),
        "kept_off_frozen_worker": sum(k["kept_off_frozen_worker"] for k in kills),
        "kept_off_thawed_worker": sum(k["kept_off_thawed_worker"] for k in kills),
        "frozen_s": round(frozen_total, 2),
        "gateway_listed_while_frozen_s": round(listed_frozen, 2),
        "gateway_listed_after_thaw_s": round(listed_total - listed_frozen, 2),
        "hit_ratio": [(k["hit_ratio_pre"], k["hit_ratio_lowest"]) for k in kills],
    }


def markdown(arms: Sequence[Mapping[str, Any]]) -> str:
    """Before vs after, one row per arm."""
    head = (
        "| arm | full-sync delay / poll (s) | controller kills | full syncs (freezes seen) | "
        "frozen s per worker, each kill | store calls skipped (tokens) | requests in the kill "
        "windows | reached a frozen worker (KV not kept) | kept off a frozen worker / off a "
        "thawed one | "
        "gateway listed a worker frozen: s while frozen of s frozen / s after it thawed | "
        "hit ratio before → lowest, each kill | answered / sent, whole run | load avg |\n"
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---|---:|---|\n"
    )
    rows = []
    for arm in arms:
        s = arm["summary"]
        frozen = "; ".join(
            f"{n.rsplit('-', 1)[-1]}: {', '.join(f'{x:.2f}' for x in v)}"
            for n, v in s["frozen_s_per_worker_per_kill"].items()
        )
        hits = ", ".join(f"{_f(a)} → {_f(b)}" for a, b in s["hit_ratio"])
        load = arm["env"]["loadavg"]
        t = arm["timing"]
        rows.append(
            f"| {arm['name']} | {t['full_sync_startup_delay_s']:g} / "
            f"{t['full_sync_status_poll_interval_s']:g} | {s['kills']} | "
            f"{s['full_syncs']:g} ({s['freezes']}) | {frozen} | {s['stores_skipped']} "
            f"({s['tokens_skipped']:,}) | {s['requests']} | {s['reached_frozen_worker']} "
            f"({s['kv_not_kept']}) | "
            f"{s['kept_off_frozen_worker']} / {s['kept_off_thawed_worker']} | "
            f"{s['gateway_listed_while_frozen_s']:.1f} of {s['frozen_s']:.1f} / "
            f"{s['gateway_listed_after_thaw_s']:.1f} | {hits} | "
            f"{arm['requests_total'] - sum(arm['request_errors'].values())} / "
            f"{arm['requests_total']} | {load['start']:.1f} → {load['end']:.1f} |"
        )
    notes = [
        f"\n{arm['name']}: only {ok} of {arm['requests_total']} requests answered (load "
        f"average {arm['env']['loadavg']['end']:.1f}): its counts of requests and stores are low"
        for arm in arms
        if (ok := arm["requests_total"] - sum(arm["request_errors"].values()))
        < 0.9 * arm["requests_total"]
    ]
    return head + "\n".join(rows) + "\n" + "".join(n + "\n" for n in notes)


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"
