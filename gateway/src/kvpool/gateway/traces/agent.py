"""kvpool's agent trace: a deterministic shared-prefix, multi-tenant chat workload, generated
or read from JSONL.

Why this module exists: routing quality is only visible on a workload whose requests share KV
the way agent traffic does. Here: several tenants, each with a long system prompt that every
one of its sessions starts with, one tenant more popular than the rest (its extra sessions
come last, so they run together: a hot prefix); multi-turn sessions whose every turn repeats
the whole conversation so far (each turn extends the previous turn's prompt); and RAG sessions
whose user turns carry documents retrieved from the tenant's corpus in a per-request order, so
two requests with the same documents share KV only up to the first document that differs in
place. The assistant replies are scripted (the trace is replayed, not generated), so every
router under test receives byte-identical requests in the same order. The gateway benchmark
and ``kvpool-gateway replay`` both replay it (one trace, one client: :mod:`kvpool.gateway.loadgen`).

Timing: every turn of the k-th session (in replay order) may be sent at
k × ``session_interval_ms`` (0: all at once) and not before the session's previous turn has
answered: sessions run concurrently, turns in order.

A file holds one request per line (:func:`dump_row`, :func:`read_agent`):
``{"timestamp": ms, "session", "tenant", "turn", "messages": [{"role", "content"}], "max_tokens"}``.

Pure apart from reading a file: no clock, no global random state; the same
:class:`TraceConfig` always gives the same trace. ``gateway/tests/unit/test_agent_trace.py``
checks that and the shape.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated

import msgspec

from kvpool.gateway.traces.jsonl import (
    Window,
    decode_row,
    iter_trace,
    ms,
    read_trace,
    select,
)

_WORDS = (
    "the", "each", "one", "that", "this", "every", "in", "many", "these", "some", "few", "all",
    "and", "before", "after", "along", "across", "over", "through", "on", "under", "into",
    "near", "because", "while", "until", "but", "so", "they", "she", "it", "since", "said",
    "we", "once", "never", "answered", "as", "an", "asked", "is", "are", "often", "long", "of",
    "request", "to", "from", "still", "again", "full", "warm", "answer", "twice", "soon",
    "first", "story", "then", "secret", "already", "careful", "plain", "stone", "fell",
    "silver", "idle", "empty", "missing", "grey", "or", "wrong", "data", "please", "closed",
    "distant", "rich", "always", "wooden", "common", "with", "reads", "together", "sudden",
    "hidden", "values", "about", "holds", "deep", "stale", "humble", "iron", "bright",
    "certain", "rose", "bold", "whole", "proud", "poor", "loud", "light", "rare", "low", "fast",
    "honest", "golden", "river", "market", "ledger", "invoice", "policy", "refund", "order",
    "account", "shipment", "contract", "report", "customer", "manager", "budget", "review",
)  # fmt: skip
_QUESTIONS = ("What", "Why", "How", "When", "Which", "Where")

Message = dict[str, str]


@dataclass(frozen=True)
class TraceConfig:
    """Size of the trace. Word counts, not tokens: the tokenizer decides the token counts."""

    seed: int = 0
    tenants: int = 3
    sessions_per_tenant: int = 2
    hot_sessions: int = 0  # extra sessions of tenant t0: one popular tenant (a hot prefix)
    turns: int = 3
    system_words: int = 700
    docs_per_tenant: int = 6
    doc_words: int = 160
    docs_per_turn: int = 3
    rag_every: int = 2  # every n-th session of a tenant is a RAG session (0: none)
    user_words: int = 24
    reply_words: int = 20
    max_tokens: int = 8
    session_interval_ms: float = 0.0  # session k may start at k x this (0: all at once)

    def __post_init__(self) -> None:
        for name in ("tenants", "sessions_per_tenant", "turns", "system_words", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"TraceConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("hot_sessions", "docs_per_tenant", "doc_words", "docs_per_turn",
                     "rag_every", "user_words", "reply_words", "session_interval_ms"):  # fmt: skip
            if getattr(self, name) < 0:
                raise ValueError(f"TraceConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.rag_every and self.docs_per_turn > self.docs_per_tenant:
            raise ValueError(
                f"TraceConfig.docs_per_turn ({self.docs_per_turn}) exceeds docs_per_tenant "
                f"({self.docs_per_tenant}): a RAG turn cannot retrieve more documents than exist"
            )


@dataclass(frozen=True)
class AgentRequest:
    """One chat completion of the trace: the full conversation up to this user turn."""

    session: str
    tenant: str
    turn: int
    messages: tuple[Message, ...]
    max_tokens: int
    arrival_s: float = 0.0  # earliest send time; also after the session's previous turn
    index: int = 0  # position in replay order (generated) or row of the file (read)
    line: int = 0  # line of the file (0: generated)

    def body(self, model: str, *, stream: bool = True) -> dict[str, object]:
        """The OpenAI chat body sent for this request (greedy, usage in the stream)."""
        body: dict[str, object] = {
            "model": model,
            "messages": [dict(m) for m in self.messages],
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "stream": stream,
            "user": self.session,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body


@dataclass(frozen=True)
class Session:
    id: str
    tenant: str
    rag: bool
    requests: tuple[AgentRequest, ...]


@dataclass(frozen=True)
class Trace:
    config: TraceConfig
    sessions: tuple[Session, ...] = field(default_factory=tuple)

    @property
    def requests(self) -> list[AgentRequest]:
        """Every request in replay order: sessions interleaved across tenants, turns in order."""
        return [r for s in self.sessions for r in s.requests]


def filler(rng: random.Random, n: int) -> str:
    """``n`` words of plain text with a sentence end every twelve words."""
    words = []
    for i in range(n):
        word = rng.choice(_WORDS)
        words.append(word.capitalize() if i % 12 == 0 else word)
        if i % 12 == 11:
            words[-1] += "."
    return " ".join(words)


def _system_prompt(rng: random.Random, tenant: str, n: int) -> str:
    return (
        f"You are the assistant of tenant {tenant}. Follow the house rules below exactly.\n"
        + filler(rng, n)
    )


def _user_turn(
    rng: random.Random, words: int, docs: list[tuple[int, str]] | None, turn: int
) -> str:
    question = f"{rng.choice(_QUESTIONS)} {filler(rng, words)}?"
    if docs is None:
        return f"Turn {turn}. {question}"
    context = "\n\n".join(f"[document {i}]\n{text}" for i, text in docs)
    return f"Context (retrieved, ranked by relevance):\n{context}\n\nTurn {turn}. {question}"


def generate(cfg: TraceConfig) -> Trace:
    """The trace for ``cfg``: same config, same trace (byte for byte)."""
    rng = random.Random(cfg.seed)
    tenants = [f"t{i}" for i in range(cfg.tenants)]
    systems = {t: _system_prompt(rng, t, cfg.system_words) for t in tenants}
    corpora = {t: [filler(rng, cfg.doc_words) for _ in range(cfg.docs_per_tenant)] for t in tenants}
    per_tenant: dict[str, list[Session]] = {t: [] for t in tenants}
    for t in tenants:
        for k in range(cfg.sessions_per_tenant + (cfg.hot_sessions if t == tenants[0] else 0)):
            sid = f"{t}-s{k}"
            rag = bool(cfg.rag_every) and k % cfg.rag_every == cfg.rag_every - 1
            history: list[Message] = [{"role": "system", "content": systems[t]}]
            requests = []
            for turn in range(cfg.turns):
                docs = None
                if rag:
                    picked = rng.sample(range(cfg.docs_per_tenant), cfg.docs_per_turn)
                    docs = [(i, corpora[t][i]) for i in picked]  # sample order = rank order
                history.append(
                    {"role": "user", "content": _user_turn(rng, cfg.user_words, docs, turn)}
                )
                requests.append(AgentRequest(sid, t, turn, tuple(dict(m) for m in history),
                                             cfg.max_tokens))  # fmt: skip
                history.append({"role": "assistant", "content": filler(rng, cfg.reply_words)})
            per_tenant[t].append(Session(sid, t, rag, tuple(requests)))
    # interleave tenants so concurrent sessions belong to different tenants, until only the
    # hot tenant has sessions left: its burst then runs alone
    rounds = max(len(v) for v in per_tenant.values())
    order = [per_tenant[t][k] for k in range(rounds) for t in tenants if k < len(per_tenant[t])]
    index = 0
    timed = []
    for k, s in enumerate(order):
        at = k * cfg.session_interval_ms / 1000.0
        reqs = []
        for r in s.requests:
            reqs.append(replace(r, arrival_s=at, index=index))
            index += 1
        timed.append(replace(s, requests=tuple(reqs)))
    return Trace(cfg, tuple(timed))


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def ideal_hit_tokens(prompts: list[list[int]], chunk: int) -> list[int]:
    """Per prompt (in replay order): the tokens an ideal pool could serve from cache, i.e. the
    longest prefix shared with any earlier prompt, rounded down to whole chunks (a chunk's
    hash covers its whole prefix), less the last token, which the engine always computes.
    An upper bound for any router (a partial last chunk of an exact repeat is not counted)."""
    out = []
    for i, p in enumerate(prompts):
        best = max((common_prefix(p, q) for q in prompts[:i]), default=0)
        out.append(max(0, min(best // chunk * chunk, len(p) - 1)))
    return out


class _Message(msgspec.Struct):
    role: str
    content: str


class _Row(msgspec.Struct):
    session: str
    turn: Annotated[int, msgspec.Meta(ge=0)]
    messages: Annotated[list[_Message], msgspec.Meta(min_length=1)]
    max_tokens: Annotated[int, msgspec.Meta(ge=1)]
    tenant: str = ""
    timestamp: Annotated[float, msgspec.Meta(ge=0)] = 0.0


_DECODER = msgspec.json.Decoder(_Row)


def parse_row(path: str, index: int, line: int, raw: bytes) -> AgentRequest:
    """One agent-trace row; a TraceError naming the line and the field when it is not one."""
    row = decode_row(_DECODER, path, line, raw)
    messages = tuple({"role": m.role, "content": m.content} for m in row.messages)
    return AgentRequest(row.session, row.tenant, row.turn, messages, row.max_tokens,
                        row.timestamp / 1000.0, index, line)  # fmt: skip


def iter_agent(path: str | Path, window: Window | None = None) -> Iterator[AgentRequest]:
    """The requests of an agent-trace file in file order, streaming, ``window`` applied."""
    return iter_trace(path, parse_row, window)


def read_agent(path: str | Path, window: Window | None = None) -> list[AgentRequest]:
    """:func:`iter_agent` as a list; an empty file or window is a TraceError."""
    return read_trace(path, parse_row, window)


def dump_row(req: AgentRequest) -> str:
    """``req`` as one JSONL line that :func:`read_agent` reads back."""
    return json.dumps({
        "timestamp": ms(req.arrival_s),
        "session": req.session,
        "tenant": req.tenant,
        "turn": req.turn,
        "messages": [dict(m) for m in req.messages],
        "max_tokens": req.max_tokens,
    })  # fmt: skip


def windowed(trace: Trace, window: Window) -> list[AgentRequest]:
    """The requests of a generated trace that ``window`` selects (as a file of it would)."""
    reqs = trace.requests
    rows = ((r.index, 0, b"") for r in reqs)
    return list(select(rows, lambda index, _line, _raw: reqs[index], window))


def config_from_spec(spec: str) -> TraceConfig:
    """A TraceConfig from ``key=value,...`` (its field names; empty: the defaults); a
    ValueError names the key."""
    fields = TraceConfig.__dataclass_fields__
    values: dict[str, int | float] = {}
    for item in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in fields:
            raise ValueError(f"{item!r}: expected key=value with key one of {', '.join(fields)}")
        kind = float if key == "session_interval_ms" else int
        try:
            values[key] = kind(value)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise ValueError(f"{key}: {value!r} is not {what}") from None
    return TraceConfig(**values)  # type: ignore[arg-type]
