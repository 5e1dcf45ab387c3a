"""Why a chunk of a prompt was cached nowhere when its request was routed. Pure: no I/O.

Why this module exists: "this request missed" has a handful of causes an operator can act on,
and each leaves a different trace in what the pool keeps: the chunk was evicted (the index's
delta stream carried its eviction), it went to an instance whose LMCache was frozen for a
full sync (stores dropped), it was stored by a worker the controller refused for another
domain fingerprint (its KV is never indexed), the prompt is not the one that was cached (it
differs at token N), or nobody ever sent it. The glue (:mod:`kvpool.gateway.explain`) gathers
those traces as :class:`ChunkFacts` and :class:`PoolFacts`; :func:`classify` decides, one
reason per missed chunk, and folds runs of chunks that missed for the same reason.

The order of the checks is the order of certainty: an eviction the controller reported proves
the chunk was stored; a request sent to a frozen or refused instance explains why a store
never reached the index; a divergence names the token; "never stored" is what is left.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

__all__ = [
    "REASONS",
    "ChunkFacts",
    "Divergence",
    "Eviction",
    "MissRun",
    "PoolFacts",
    "Refused",
    "Sent",
    "classify",
]

EVICTED: Final = "evicted"
DROPPED_FROZEN: Final = "dropped-frozen"
OTHER_FINGERPRINT: Final = "other-fingerprint"
PROMPT_DIFFERS: Final = "prompt-differs"
NOT_YET_STORED: Final = "not-yet-stored"
NOT_INDEXED: Final = "not-indexed"
NEVER_STORED: Final = "never-stored"
#: Every reason :func:`classify` gives, most certain first.
REASONS: Final = (
    EVICTED,
    DROPPED_FROZEN,
    OTHER_FINGERPRINT,
    PROMPT_DIFFERS,
    NOT_YET_STORED,
    NOT_INDEXED,
    NEVER_STORED,
)


@dataclass(frozen=True)
class Sent:
    """An earlier request that carried the chunk: routed to ``instance`` at ``at`` (seconds
    since the epoch), whose LMCache was ``frozen`` then (its /readyz said so)."""

    request_id: str
    instance: str
    at: float
    frozen: bool = False


@dataclass(frozen=True)
class Eviction:
    """The index lost the chunk (``op`` evict), or every chunk of a worker of ``instance``
    at ``location`` (``clear``; ``worker_down``: deregistered or purged; location "" = all)."""

    instance: str
    location: str
    at: float
    op: str = "evict"


@dataclass(frozen=True)
class Refused:
    """A registration the controller refused (``instance_id`` of another domain fingerprint),
    ``name`` its configured instance name."""

    instance_id: str
    name: str
    reason: str


@dataclass(frozen=True)
class Divergence:
    """The recent prompt sharing the longest prefix with this one: it was sent by
    ``request_id`` to ``instance`` at ``at`` and differs from this prompt at token ``token``
    (absolute position); ``ours``/``theirs`` are the tokens from ``window_start`` on."""

    request_id: str
    instance: str
    at: float
    token: int
    window_start: int
    ours: tuple[int, ...]
    theirs: tuple[int, ...]


@dataclass(frozen=True)
class ChunkFacts:
    """What the pool remembers of one chunk that no instance held when the request was
    routed: earlier requests that carried it, evictions of it, instances holding it now."""

    chunk: int
    sent: Sequence[Sent] = ()
    evictions: Sequence[Eviction] = ()
    held_now: Sequence[str] = ()


@dataclass(frozen=True)
class PoolFacts:
    """What holds for every chunk: when the request was routed, instance-wide losses (clears
    and workers gone), refused registrations, the leading tokens of this prompt instances
    answered they hold by their own lookup (``holds``, by name: whatever the index says), the
    store-skipped-while-frozen count each worker reports, the closest recent prompt, and how
    many chunks the gateway's record holds."""

    routed_at: float
    chunk_size: int
    instance_events: Sequence[Eviction] = ()
    refused: Sequence[Refused] = ()
    holds: Mapping[str, int] = field(default_factory=dict)
    skipped_frozen_tokens: Mapping[str, float] = field(default_factory=dict)
    divergence: Divergence | None = None
    remembered_chunks: int = 0


@dataclass(frozen=True)
class MissRun:
    """Chunks ``first``..``last`` (inclusive) missed everywhere for ``reason``; ``detail`` says
    it in a sentence, ``facts`` the figures behind it."""

    first: int
    last: int
    reason: str
    detail: str
    facts: Mapping[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "chunks": [self.first, self.last],
            "reason": self.reason,
            "detail": self.detail,
            **({"facts": dict(self.facts)} if self.facts else {}),
        }


def _ago(at: float, routed_at: float) -> str:
    delta = routed_at - at
    return f"{delta:.1f} s before this request" if delta >= 0 else "after this request"


def _evicted(chunk: ChunkFacts, pool: PoolFacts) -> tuple[str, dict[str, Any]] | None:
    """The latest eviction before routing: of the chunk itself, or of everything its last
    holder (an instance it was sent to) had."""
    before = [e for e in chunk.evictions if e.at <= pool.routed_at]
    sent_to = {s.instance: s.at for s in chunk.sent}
    for e in pool.instance_events:
        name = e.instance.split("~", 1)[0]
        if name in sent_to and sent_to[name] <= e.at <= pool.routed_at:
            before.append(e)
    if not before:
        return None
    last = max(before, key=lambda e: e.at)
    where = f"{last.instance} ({last.location})" if last.location else last.instance
    what = {
        "evict": f"evicted from {where}",
        "clear": f"cleared from {where} (every chunk of the worker there)",
        "worker_down": f"lost with {last.instance}'s worker (deregistered or purged)",
    }.get(last.op, f"removed from {where} ({last.op})")
    facts = {"instance": last.instance, "location": last.location, "at": last.at, "op": last.op}
    return f"{what} {_ago(last.at, pool.routed_at)}", facts


def _sent_to(s: Sent, pool: PoolFacts) -> str:
    return f"sent to {s.instance} by request {s.request_id} {_ago(s.at, pool.routed_at)}"


def _sent_reason(chunk: ChunkFacts, pool: PoolFacts) -> tuple[str, str, dict[str, Any]] | None:
    """A reason from the earlier requests that carried the chunk (None: none did)."""
    sent = [s for s in chunk.sent if s.at <= pool.routed_at]
    if not sent:
        return None
    frozen = [s for s in sent if s.frozen]
    if frozen:
        s = frozen[-1]
        skipped = pool.skipped_frozen_tokens.get(s.instance)
        counted = (
            f"; {s.instance} reports {skipped:,.0f} prompt tokens not stored while frozen"
            if skipped
            else ""
        )
        detail = (
            f"{_sent_to(s, pool)} while "
            f"its LMCache was frozen for a full sync with the controller (stores dropped){counted}"
        )
        facts = {"instance": s.instance, "request_id": s.request_id, "at": s.at}
        if skipped is not None:
            facts["skipped_frozen_tokens"] = skipped
        return DROPPED_FROZEN, detail, facts
    refused = {r.name: r for r in pool.refused}
    for s in reversed(sent):
        r = refused.get(s.instance)
        if r is not None:
            detail = (
                f"{_sent_to(s, pool)}; "
                f"the controller refused {r.instance_id} ({r.reason}): what it stores is never "
                "indexed"
            )
            return OTHER_FINGERPRINT, detail, {"instance_id": r.instance_id, "reason": r.reason}
    end = (chunk.chunk + 1) * pool.chunk_size
    for s in reversed(sent):
        held = pool.holds.get(s.instance)
        if held is not None and held >= end:
            detail = (
                f"{_sent_to(s, pool)}; "
                f"{s.instance} holds {held:,} tokens of this prompt by its own lookup, but the "
                "index has them under other chunk hashes: it hashes in another regime than the "
                "domain's (its PYTHONHASHSEED, chunk size or hash algorithm: another domain "
                "fingerprint)"
            )
            return OTHER_FINGERPRINT, detail, {"instance": s.instance, "holds_tokens": held}
    s = sent[-1]
    facts = {"instance": s.instance, "request_id": s.request_id, "at": s.at}
    if chunk.held_now:
        detail = (
            f"{_sent_to(s, pool)}, not "
            f"yet reported stored when this request was routed; held now by "
            f"{', '.join(chunk.held_now)}"
        )
        return NOT_YET_STORED, detail, {**facts, "held_now": list(chunk.held_now)}
    detail = (
        f"{_sent_to(s, pool)}, never "
        "reported stored (the request failed, the instance stores nothing of it, e.g. a PD "
        "prefill, or its store was lost)"
    )
    return NOT_INDEXED, detail, facts


def _held_elsewhere(chunk: int, pool: PoolFacts) -> tuple[str, dict[str, Any]] | None:
    """A refused instance that answered it holds this chunk of the prompt."""
    end = (chunk + 1) * pool.chunk_size
    for r in pool.refused:
        held = pool.holds.get(r.name)
        if held is not None and held >= end:
            detail = (
                f"{r.name} holds {held:,} tokens of this prompt, but the controller refused its "
                f"registration as {r.instance_id} ({r.reason}): a worker of another domain "
                "fingerprint, whose KV the pool never indexes"
            )
            return detail, {"instance_id": r.instance_id, "reason": r.reason, "holds_tokens": held}
    return None


def _differs(d: Divergence) -> tuple[str, dict[str, Any]]:
    detail = (
        f"the prompt differs at token {d.token:,} from the one request {d.request_id} sent to "
        f"{d.instance}: from token {d.window_start:,} ours {list(d.ours)}, theirs "
        f"{list(d.theirs)}"
    )
    facts = {
        "token": d.token,
        "request_id": d.request_id,
        "instance": d.instance,
        "at": d.at,
        "window_start": d.window_start,
        "ours": list(d.ours),
        "theirs": list(d.theirs),
    }
    return detail, facts


def _one(chunk: ChunkFacts, pool: PoolFacts, first_unsent: int | None) -> MissRun:
    k = chunk.chunk
    evicted = _evicted(chunk, pool)
    if evicted is not None:
        return MissRun(k, k, EVICTED, *evicted)
    by_sent = _sent_reason(chunk, pool)
    if by_sent is not None:
        return MissRun(k, k, *by_sent)
    elsewhere = _held_elsewhere(k, pool)
    if elsewhere is not None:
        return MissRun(k, k, OTHER_FINGERPRINT, *elsewhere)
    d = pool.divergence
    if d is not None and first_unsent is not None and d.token < (k + 1) * pool.chunk_size:
        return MissRun(k, k, PROMPT_DIFFERS, *_differs(d))
    detail = (
        "never stored: no recent request this gateway routed carried this prefix (its record "
        f"holds {pool.remembered_chunks:,} recent chunks)"
    )
    return MissRun(k, k, NEVER_STORED, detail)


def classify(chunks: Sequence[ChunkFacts], pool: PoolFacts) -> list[MissRun]:
    """One reason per missed chunk (in chunk order), consecutive chunks with the same reason
    and detail folded into one run. A prompt that differs from a recent one at token N gives
    that reason to every unseen chunk from N's on (their hashes chain from it)."""
    ordered = sorted(chunks, key=lambda c: c.chunk)
    unsent = [c.chunk for c in ordered if not any(s.at <= pool.routed_at for s in c.sent)]
    first_unsent = unsent[0] if unsent else None
    runs: list[MissRun] = []
    for chunk in ordered:
        run = _one(chunk, pool, first_unsent)
        prev = runs[-1] if runs else None
        if (
            prev is not None
            and prev.last + 1 == run.first
            and (prev.reason, prev.detail) == (run.reason, run.detail)
        ):
            runs[-1] = MissRun(prev.first, run.last, prev.reason, prev.detail, prev.facts)
        else:
            runs.append(run)
    return runs
