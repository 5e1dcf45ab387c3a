"""What each fault cost the clients: per request, then per fault and stream.

Why this module exists: the suite's verdict must come from what the clients saw, request by
request, not from the components' own accounts. A request belongs to the fault in effect when
it ended (a fault's window runs from its injection to the next one's, so it holds its
after-effects); one that ended before the first fault is the baseline.
Its final fate is one of:

- answered: a complete answer (``[DONE]``, every token asked for), maybe after retries;
- failed: an explicit error the client still held after its retries;
- hung: no complete answer within the client's timeout (never retried);
- lost: neither: the answer ended without an error and without being whole.

An answered request is wrong when its text differs from the fault-free answer to the same prompt
(greedy decoding: the reference engine and the simulated one are deterministic per prompt;
the fault-free answers are those of the baseline, the first of which come before any fault).
Every failed attempt is kept by kind, with whether a retryable status came with Retry-After.
The hit ratio (cached / prompt tokens of answered requests) is compared, in windows of
``window_s`` by send time, with its level over the 20 s before the fault: recovery is the time
from the injection to the first window back at 90 % of that level.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from chaos.workload import TIMEOUT_S, PromptKey, Stream, complete
from kvpool.gateway.loadgen import RETRYABLE_STATUS, Outcome

RECOVERED_AT = 0.9  # of the pre-fault hit ratio
PRE_S = 20.0


@dataclass
class Window:
    """A fault's window on the monotonic clock, and when its targets were back."""

    name: str
    start: float
    end: float
    back: float | None


def life(stream: Stream, o: Outcome) -> tuple[float, float]:
    """(sent, done) of a request on the monotonic clock."""
    assert stream.replay is not None
    t0 = stream.replay.t0
    a = t0 + o.sent_s
    if o.e2e_s is not None:
        return a, a + o.e2e_s
    if o.error == "timeout":
        return a, a + TIMEOUT_S
    last = max((t0 + x.at_s + x.wait_s for x in o.attempts), default=a)
    return a, max(a, last)


def attribute(stream: Stream, windows: Sequence[Window]) -> dict[str, list[Outcome]]:
    """The stream's requests by the fault in effect when each ended (``baseline``: before any)."""
    out: dict[str, list[Outcome]] = {w.name: [] for w in windows}
    out["baseline"] = []
    for o in stream.outcomes:
        _, b = life(stream, o)  # the fault in effect when it ended: the one that could hurt it
        hit = next((w.name for w in windows if w.start <= b < w.end), "baseline")
        out[hit].append(o)
    return out


def fate(stream: Stream, o: Outcome) -> str:
    if complete(stream, o):
        return "answered"
    if o.error == "timeout":
        return "hung"
    if o.error is None or o.error == "no_content":
        return "lost"
    if o.error == "cancelled":
        return "cancelled"
    return "failed"


def references(streams: Iterable[Stream], baseline: Mapping[str, list[Outcome]]) -> tuple[
    dict[PromptKey, str], dict[PromptKey, set[str]]
]:  # fmt: skip
    """The fault-free answer of each prompt, and the prompts answered differently fault-free."""
    seen: dict[PromptKey, Counter[str]] = {}
    for s in streams:
        for o in baseline.get(s.spec.name, []):
            if complete(s, o) and o.text is not None:
                seen.setdefault(s.keys[o.index], Counter())[o.text] += 1
    refs = {k: c.most_common(1)[0][0] for k, c in seen.items()}
    split = {k: set(c) for k, c in seen.items() if len(c) > 1}
    return refs, split


def hit_ratio(stream: Stream, outs: Iterable[Outcome], lo: float, hi: float) -> tuple[float, int]:
    """(hit ratio, answers) of the answered requests sent in [lo, hi) (monotonic clock)."""
    prompt = cached = n = 0
    for o in outs:
        a, _ = life(stream, o)
        if lo <= a < hi and complete(stream, o) and o.prompt_tokens:
            prompt += o.prompt_tokens
            cached += o.cached_tokens or 0
            n += 1
    return (cached / prompt if prompt else 0.0), n


def window_s(stream: Stream) -> float:
    """A hit-ratio window holds about eight requests of the stream, at least 5 s."""
    return max(5.0, 8.0 / stream.spec.rate)


def recovery(
    stream: Stream, start: float, until: float, finished_before: float | None = None
) -> dict[str, Any]:
    """Pre-fault hit ratio, the lowest window after ``start`` and the recovery time (None: not
    back at 90 % before ``until``). ``finished_before``: only requests done by then (online)."""
    outs = list(stream.outcomes)
    pending = [
        life(stream, o)[0]
        for o in outs
        if finished_before is not None
        and ((o.e2e_s is None and o.error is None) or life(stream, o)[1] > finished_before)
    ]
    if pending:  # online: a window counts once every request sent in it has finished
        until = min(until, *pending)
    pre, n = hit_ratio(stream, outs, start - PRE_S, start)
    if n < 5:
        pre, n = hit_ratio(stream, outs, start - 2 * PRE_S, start)
    w = window_s(stream)
    lowest: float | None = None
    recovered: float | None = None
    t = start
    while t + w <= until:
        ratio, m = hit_ratio(stream, outs, t, t + w)
        if m >= 3:
            lowest = ratio if lowest is None else min(lowest, ratio)
            if recovered is None and ratio >= RECOVERED_AT * pre:
                recovered = t - start
                if finished_before is not None:
                    break
        t += 1.0
    return {
        "hit_ratio_pre": round(pre, 4),
        "hit_ratio_min": None if lowest is None else round(lowest, 4),
        "recovery_s": recovered,
        "window_s": w,
    }


def tally(stream: Stream, outs: Sequence[Outcome], refs: Mapping[PromptKey, str]) -> dict[str, Any]:
    """Fates, wrong answers and every failed attempt of ``outs``."""
    fates = Counter(fate(stream, o) for o in outs)
    kinds: Counter[str] = Counter()
    with_after = without_after = 0
    examples: dict[str, str] = {}
    wrong: list[dict[str, Any]] = []
    unchecked = 0
    for o in outs:
        failures = [(x.error, x.status, x.retry_after) for x in o.attempts]
        if o.error is not None:
            failures.append((o.error, o.status, o.retry_after))
            examples.setdefault(o.error, o.detail[:300])
        for kind, status, after in failures:
            kinds[kind] += 1
            if status in RETRYABLE_STATUS:
                with_after += after is not None
                without_after += after is None
        if not complete(stream, o):
            continue
        ref = refs.get(stream.keys[o.index])
        if ref is None:
            unchecked += 1
        elif o.text != ref:
            wrong.append({"index": o.index, "instance": o.instance, "got": o.text, "want": ref})
    slowest = max((o.e2e_s or 0.0 for o in outs if complete(stream, o)), default=None)
    return {
        "requests": len(outs),
        "answered": fates["answered"],
        "slowest_answer_s": None if slowest is None else round(slowest, 2),
        "retried_ok": sum(1 for o in outs if o.attempts and complete(stream, o)),
        "failed": fates["failed"],
        "hung": fates["hung"],
        "lost": fates["lost"],
        "cancelled": fates["cancelled"],
        "wrong": len(wrong),
        "unchecked": unchecked,
        "errors": dict(sorted(kinds.items())),
        "retryable_with_retry_after": with_after,
        "retryable_without_retry_after": without_after,
        "error_examples": examples,
        "wrong_examples": wrong[:3],
    }


def requests(
    stream: Stream, fault: str, outs: Iterable[Outcome], t0: float
) -> list[dict[str, Any]]:
    """One record per request (the JSONL beside the report): enough to replay what happened."""
    out = []
    for o in outs:
        a, _ = life(stream, o)
        out.append(
            {
                "stream": stream.spec.name,
                "fault": fault,
                "index": o.index,
                "sent_s": round(a - t0, 3),
                "e2e_s": None if o.e2e_s is None else round(o.e2e_s, 3),
                "ttft_s": None if o.ttft_s is None else round(o.ttft_s, 3),
                "fate": fate(stream, o),
                "error": o.error,
                "detail": o.detail[:200] or None,
                "attempts": [[x.error, x.status, x.retry_after] for x in o.attempts],
                "instance": o.instance,
                "reason": o.reason,
                "prompt_tokens": o.prompt_tokens,
                "cached_tokens": o.cached_tokens,
                "output_tokens": o.output_tokens,
            }
        )
    return out


def markdown(doc: Mapping[str, Any]) -> str:
    """The report's table: one row per fault and stream, the baseline first."""
    head = (
        "| fault | stream | requests | answered (after a retry) | errors seen by the client | "
        "retryable status with / without Retry-After | lost | hung | wrong | back (s) | "
        "slowest answer (s) | hit ratio before → lowest | recovery (s) |\n"
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    rows = []
    for fault in [{"name": "baseline", "streams": doc["baseline"]}, *doc["faults"]]:
        back = fault.get("back_s")
        for name, st in fault["streams"].items():
            errors = ", ".join(f"{k} {v}" for k, v in st["errors"].items()) or "-"
            hr = st.get("hit_ratio_pre")
            lowest = st.get("hit_ratio_min")
            ratio = "" if hr is None else f"{hr:.2f} → {'-' if lowest is None else f'{lowest:.2f}'}"
            rec = st.get("recovery_s")
            rec_s = "" if "recovery_s" not in st else ("not back" if rec is None else f"{rec:.0f}")
            rows.append(
                f"| {fault['name']} | {name} | {st['requests']} | {st['answered']} "
                f"({st['retried_ok']}) | {errors} | {st['retryable_with_retry_after']} / "
                f"{st['retryable_without_retry_after']} | {st['lost']} | {st['hung']} | "
                f"{st['wrong']} | {'' if back is None else f'{back:.1f}'} | "
                f"{'' if st['slowest_answer_s'] is None else st['slowest_answer_s']} | {ratio} | "
                f"{rec_s} |"
            )
    m = doc["metrics"]
    total = f"\nlost {m['lost']}, hung {m['hung']}, wrong {m['wrong']} of {m['requests']} requests"
    return head + "\n".join(rows) + total + f" ({doc['env']['duration_s']:.0f} s)\n"
