"""The answer to "why did this request miss?": a :class:`kvpool.gateway.explain.Record` and
what the pool knows now, as one JSON report.

Why this module exists: the record says what was true when the request was routed; the
reasons for its misses need more, gathered here at explain time: the prompt history and the
eviction log (in process), what the index holds now, the controller's refused registrations
(``GET /v1/stats``), what each refused instance of the pool holds of the prompt (its
``POST /memory/lookup``) and what a worker counted as dropped while frozen (its ``/metrics``).
Every call is bounded by :data:`CALL_TIMEOUT_S`; one that fails leaves its facts out and says
so in the report's notes. :func:`kvpool.gateway.misses.classify` decides the reasons.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import httpx

from kvpool.gateway.explain import Answer, Record, Step
from kvpool.gateway.explain_view import held_runs, why
from kvpool.gateway.hitgroups import GroupedHits, name_of
from kvpool.gateway.misses import ChunkFacts, PoolFacts, Refused, classify
from kvpool.gateway.promscrape import sample_sums
from kvpool.gateway.state import GatewayState
from kvpool.protocol.http_api import STATS_PATH

__all__ = ["CALL_TIMEOUT_S", "build_report", "step_view"]

CALL_TIMEOUT_S = 2.0
SKIPPED_FROZEN = "kvpool_engine_store_skipped_frozen_tokens"
LOOKUP_PATH = "/memory/lookup"
MAX_ASKED = 8  # instances asked what they hold of the prompt, per report
#: Tokens a chunk of the prompt has, or None when the gateway no longer remembers them.
ChunkTokens = Callable[[int], Sequence[int] | None]


def step_view(step: Step) -> dict[str, Any]:
    out: dict[str, Any] = {
        "role": step.role,
        "instance": step.instance,
        "reason": step.reason,
        "predicted_hit_tokens": step.predicted_hit_tokens,
        "available": step.candidates,
        "candidates": [
            {
                "instance": r.name,
                "score": r.score,
                "hit_chunks": r.hit_chunks,
                "per_location": dict(r.per_location),
                "inflight": r.inflight,
                "queued_prefill_tokens": r.queued,
                "ttft_ms": None if r.ttft_s is None else round(r.ttft_s * 1000, 1),
            }
            for r in step.rows
        ],
        "frozen": list(step.frozen),
        "chosen_frozen": step.chosen_frozen,
        "note": step.note,
    }
    out["why"] = why(out)
    return out


def _groups(answer: Answer | None) -> list[dict[str, Any]]:
    if answer is None:
        return []
    return [
        {"instances": names, "count": len(names), "hit_chunks": chunks, "per_location": dict(pl)}
        for names, chunks, pl in answer.named()
    ]


async def _held_now(state: GatewayState, hashes: Sequence[int]) -> list[tuple[str, int]]:
    """(instance name, leading chunks) of every instance holding a prefix of ``hashes`` now."""
    found = await state.index.lookup(hashes)
    if isinstance(found, GroupedHits):
        groups = tuple((g.instances, g.hit_chunks, g.per_location) for g in found.groups)
        now = Answer("replica", groups, tuple(found.ids))
        return [(name, chunks) for names, chunks, _ in now.named() for name in names]
    return [(name, hit.hit_chunks) for name, hit in (found or {}).items()]


async def _refused(state: GatewayState, notes: list[str]) -> list[Refused]:
    """The controller's latest refused registrations (``GET /v1/stats``)."""
    try:
        resp = await state.http.get(
            state.config.controller_url + STATS_PATH, timeout=CALL_TIMEOUT_S
        )
        resp.raise_for_status()
        refused = dict(resp.json().get("refused") or {})
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        notes.append(f"the controller's refused registrations are unknown ({exc!r:.120})")
        return []
    return [Refused(str(i), name_of(str(i)), str(why)) for i, why in refused.items()]


async def _holds(
    state: GatewayState, names: Sequence[str], tokens: Sequence[int], notes: list[str]
) -> dict[str, int]:
    """What each of ``names`` answers it holds of ``tokens`` by its own lookup (its
    ``POST /memory/lookup``), whatever the index says; at most :data:`MAX_ASKED` asked."""
    out: dict[str, int] = {}
    for name in list(dict.fromkeys(names))[:MAX_ASKED]:
        inst = state.instances.get(name)
        if inst is None or not tokens:
            continue
        try:
            r = await state.http.post(
                inst.url + LOOKUP_PATH, json={"token_ids": list(tokens)}, timeout=CALL_TIMEOUT_S
            )
            if r.status_code == 200:
                out[name] = int(r.json().get("cached_tokens", 0))
            else:
                notes.append(f"{name} answered {r.status_code} to {LOOKUP_PATH}")
        except (httpx.HTTPError, ValueError, TypeError) as exc:
            notes.append(f"{name} could not be asked what it holds ({exc!r:.120})")
    return out


async def _skipped_frozen(
    state: GatewayState, names: set[str], notes: list[str]
) -> dict[str, float]:
    """The store-skipped-while-frozen token count each of ``names`` reports."""
    out: dict[str, float] = {}
    for name in sorted(names):
        inst = state.instances.get(name)
        if inst is None:
            continue
        try:
            resp = await state.http.get(inst.url + "/metrics", timeout=CALL_TIMEOUT_S)
            resp.raise_for_status()
            value = sample_sums(resp.text).get(SKIPPED_FROZEN)
        except (httpx.HTTPError, ValueError) as exc:
            notes.append(f"{name}'s /metrics could not be read ({exc!r:.120})")
            continue
        if value is not None:
            out[name] = value
    return out


def _prompt_tokens(chunk_tokens: ChunkTokens, chunks: int) -> list[int]:
    """The prompt's full chunks as far as their tokens are known."""
    out: list[int] = []
    for k in range(chunks):
        part = chunk_tokens(k)
        if part is None:
            break
        out.extend(part)
    return out


async def _missed(
    state: GatewayState,
    rec: Record,
    chunk_tokens: ChunkTokens,
    notes: list[str],
    facts: dict[str, Any],
) -> list[dict[str, Any]]:
    """The missed chunks' reasons; ``facts`` gets what the pool was asked (refused
    registrations, what instances hold by their own lookup)."""
    book = state.explain
    hashes = rec.hashes
    first = rec.miss_from
    now = await _held_now(state, hashes)
    chunks: list[ChunkFacts] = []
    frozen_to: set[str] = set()
    for k in range(first, len(hashes)):
        h = hashes[k]
        sent = [s for s in book.history.sent(h) if s.request_id != rec.request_id]
        frozen_to |= {s.instance for s in sent if s.frozen}
        held = sorted({name for name, n in now if n > k})
        chunks.append(ChunkFacts(k, sent, book.evictions.of(h), held))
    unsent = [c.chunk for c in chunks if not any(s.at <= rec.at for s in c.sent)]
    divergence = None
    if unsent:
        k0 = unsent[0]
        own = chunk_tokens(k0)
        if own is not None:
            parent = hashes[k0 - 1] if k0 > 0 else None
            divergence = book.history.closest(own, parent, hashes[k0], k0, rec.at)
    tokens = _prompt_tokens(chunk_tokens, len(hashes))
    refused = await _refused(state, notes)
    asked = [s.instance for c in chunks for s in c.sent] + [r.name for r in refused]
    pool = PoolFacts(
        rec.at,
        book.chunk_size,
        tuple(book.evictions.events),
        refused,
        await _holds(state, asked, tokens, notes),
        await _skipped_frozen(state, frozen_to, notes),
        divergence,
        len(book.history),
    )
    facts["refused"] = [{"instance_id": r.instance_id, "reason": r.reason} for r in refused]
    facts["holds"] = dict(pool.holds)
    return [run.as_dict() for run in classify(chunks, pool)]


async def build_report(
    state: GatewayState, rec: Record, chunk_tokens: ChunkTokens, *, dry_run: bool = False
) -> dict[str, Any]:
    """The JSON report of ``rec`` (``chunk_tokens``: the prompt's tokens by chunk)."""
    notes: list[str] = []
    facts: dict[str, Any] = {}
    groups = _groups(rec.answer)
    n = len(rec.hashes)
    missed: list[dict[str, Any]] = []
    if rec.answer is None:
        if n:
            notes.append(
                "the index was not consulted (controller down or replica out of sync): the "
                "router knew nothing of what was cached, so no chunk is classified"
            )
    elif rec.miss_from < n:
        missed = await _missed(state, rec, chunk_tokens, notes, facts)
    return {
        "request_id": rec.request_id,
        "dry_run": dry_run,
        "at": rec.at,
        "endpoint": rec.endpoint,
        "session": rec.session,
        "prompt_tokens": rec.prompt_tokens,
        "chunk_size": state.explain.chunk_size,
        "chunks": n,
        "routing": [step_view(s) for s in rec.steps],
        "index": {"mode": rec.index_mode, "groups": groups},
        "held": held_runs(groups, n),
        "missed": missed,
        "pool": facts,
        "notes": notes,
    }
