"""Read a Mooncake-format trace (JSONL: ``timestamp`` ms, ``input_length``, ``output_length``,
``hash_ids``), streaming, with a request window.

Why this module exists: kvpool is judged on real traces, and the tools that replay or simulate
them (``kvpool-gateway replay``, the fleet simulator) must read *any* file of the format
Mooncake's FAST'25 release defines (../shared/traces/README.md), not only the one they were
written against: no assumption about its size, rate, reuse or ordering. So the reader streams
(one row decoded at a time; a gzip file too), keeps nothing but the requests it yields, refuses
a bad row with its file, line and field, ignores keys it does not know, and selects a window by
index and by time. Each request is a frozen :class:`TraceRequest` that says where it came from.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import msgspec

from kvpool.gateway.traces.jsonl import TraceError, Window, decode_row, iter_trace, ms, read_trace

__all__ = [
    "MOONCAKE_BLOCK_TOKENS",
    "TraceError",
    "TraceRequest",
    "TraceStats",
    "Window",
    "dump_row",
    "iter_mooncake",
    "parse_row",
    "read_mooncake",
    "sample_families",
    "trace_stats",
]

#: Mooncake's block size: each hash id stands for this many prompt tokens (the last may be cut).
MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace, as the replay and the fleet simulator consume it.

    ``arrival_s`` is the trace's own clock (``timestamp`` / 1000); a replay shifts it so the
    first request of its window goes out at once. ``hash_ids[i]`` stands for prompt tokens
    ``[i * block, (i + 1) * block)``; equal ids at the same position are a shared prefix.
    """

    index: int  # 0-based row of the file (blank lines not counted)
    line: int  # 1-based line of the file
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session: str | None = None  # Mooncake rows carry none


class _Row(msgspec.Struct):
    timestamp: Annotated[float, msgspec.Meta(ge=0)]
    input_length: Annotated[int, msgspec.Meta(ge=1)]
    output_length: Annotated[int, msgspec.Meta(ge=0)]
    hash_ids: list[int]


_DECODER = msgspec.json.Decoder(_Row)


def parse_row(path: str, index: int, line: int, raw: bytes) -> TraceRequest:
    """One row; a TraceError naming the line and the field when it is not a Mooncake row."""
    row = decode_row(_DECODER, path, line, raw)
    if not math.isfinite(row.timestamp):
        raise TraceError(path, line, f"must be a finite number, got {row.timestamp}", "timestamp")
    return TraceRequest(
        index=index,
        line=line,
        arrival_s=row.timestamp / 1000.0,
        input_length=row.input_length,
        output_length=row.output_length,
        hash_ids=tuple(row.hash_ids),
    )


def iter_mooncake(path: str | Path, window: Window | None = None) -> Iterator[TraceRequest]:
    """The requests of a Mooncake-format file in file order, streaming (the file is never held
    whole); raises TraceError at the first bad row (of those read: reading stops at the end of
    an index window)."""
    return iter_trace(path, parse_row, window)


def read_mooncake(path: str | Path, window: Window | None = None) -> list[TraceRequest]:
    """:func:`iter_mooncake` as a list; a window with no request in it is a TraceError."""
    return read_trace(path, parse_row, window)


def dump_row(req: TraceRequest) -> str:
    """``req`` as one Mooncake JSONL line (timestamps in ms, as read)."""
    row = {
        "timestamp": ms(req.arrival_s),
        "input_length": req.input_length,
        "output_length": req.output_length,
        "hash_ids": list(req.hash_ids),
    }
    return json.dumps(row)


@dataclass(frozen=True, slots=True)
class TraceStats:
    """What a window of a trace asks for: size, span, rate and how much of it can ever hit."""

    requests: int
    span_s: float
    prompt_tokens: int
    output_tokens: int
    blocks: int
    distinct_blocks: int
    ideal_hit_ratio: float  # reusable prompt tokens / prompt tokens, unbounded cache

    @property
    def req_per_s(self) -> float:
        return self.requests / self.span_s if self.span_s > 0 else float("inf")


def trace_stats(requests: Iterable[TraceRequest], block: int = MOONCAKE_BLOCK_TOKENS) -> TraceStats:
    """Figures of a window in arrival order. The ideal hit counts, per request, the tokens of
    its leading blocks already requested before (an unbounded cache, any instance), less the
    last prompt token, which an engine always computes."""
    ordered = sorted(requests, key=lambda r: (r.arrival_s, r.index))
    seen: set[int] = set()
    prompt = output = blocks = hit = 0
    for r in ordered:
        n = 0
        while n < len(r.hash_ids) and r.hash_ids[n] in seen:
            n += 1
        hit += max(0, min(n * block, r.input_length - 1))
        seen.update(r.hash_ids)
        prompt += r.input_length
        output += r.output_length
        blocks += len(r.hash_ids)
    span = ordered[-1].arrival_s - ordered[0].arrival_s if ordered else 0.0
    return TraceStats(
        requests=len(ordered),
        span_s=span,
        prompt_tokens=prompt,
        output_tokens=output,
        blocks=blocks,
        distinct_blocks=len(seen),
        ideal_hit_ratio=hit / prompt if prompt else 0.0,
    )


def sample_families(
    requests: Sequence[TraceRequest], count: int, *, seed: int = 0, key_blocks: int = 2
) -> list[TraceRequest]:
    """About ``count`` of ``requests``, taken as whole *families* chosen at random (seeded):
    requests whose first ``key_blocks`` hash ids are equal (one conversation of a conversation
    trace: its turns share the history). Returned in file order with their own timestamps.

    Why: a trace's reuse builds up over minutes, because a conversation's next turn comes
    minutes after the last; the *first* N requests of a trace are mostly first turns (on
    Mooncake's conversation trace the first 150 could hit 4.5 % of their prompt tokens, the
    first 1,500 27 %). A short benchmark that replays whole families drawn from a long window
    keeps the window's reuse (about its ideal hit ratio) at a fraction of its requests.
    Families are added while they fit in ``count``; a family larger than what is left is
    skipped (the first one is cut to ``count`` if none fits)."""
    if count < 1:
        raise ValueError(f"sample count must be >= 1, got {count}")
    if key_blocks < 1:
        raise ValueError(f"family key must be >= 1 block, got {key_blocks}")
    families: dict[tuple[int, ...], list[TraceRequest]] = {}
    for r in requests:
        families.setdefault(r.hash_ids[:key_blocks], []).append(r)
    keys = list(families)
    random.Random(seed).shuffle(keys)
    out: list[TraceRequest] = []
    for key in keys:
        family = families[key]
        if len(out) + len(family) <= count:
            out += family
        if len(out) == count:
            break
    if not out and keys:
        out = families[keys[0]][:count]
    return sorted(out, key=lambda r: r.index)
