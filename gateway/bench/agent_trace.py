"""A deterministic shared-prefix, multi-tenant agent trace for the gateway benchmark.

Why this module exists: routing quality is only visible on a workload whose requests share KV
the way agent traffic does. Here: several tenants, each with a long system prompt that every
one of its sessions starts with, one tenant more popular than the rest (its extra sessions
come last, so they run together: a hot prefix); multi-turn sessions whose every turn repeats
the whole conversation so far (each turn extends the previous turn's prompt); and RAG sessions
whose user turns carry documents retrieved from the tenant's corpus in a per-request order, so
two requests with the same documents share KV only up to the first document that differs in
place. The assistant replies are scripted (the trace is replayed, not generated), so every
router under test receives byte-identical requests in the same order.

Pure: no I/O, no clock, no global random state; the same :class:`TraceConfig` always gives the
same trace. ``gateway/tests/unit/test_bench_trace.py`` checks that and the shape. (Not named
``trace.py``: that would shadow the standard library's ``trace`` module on ``sys.path``.)
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

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

    def __post_init__(self) -> None:
        for name in ("tenants", "sessions_per_tenant", "turns", "system_words", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"TraceConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.rag_every and self.docs_per_turn > self.docs_per_tenant:
            raise ValueError(
                f"TraceConfig.docs_per_turn ({self.docs_per_turn}) exceeds docs_per_tenant "
                f"({self.docs_per_tenant}): a RAG turn cannot retrieve more documents than exist"
            )


@dataclass(frozen=True)
class Request:
    """One chat completion of the trace: the full conversation up to this user turn."""

    session: str
    tenant: str
    turn: int
    messages: tuple[Message, ...]
    max_tokens: int

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
    requests: tuple[Request, ...]


@dataclass(frozen=True)
class Trace:
    config: TraceConfig
    sessions: tuple[Session, ...] = field(default_factory=tuple)

    @property
    def requests(self) -> list[Request]:
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
                requests.append(Request(sid, t, turn, tuple(dict(m) for m in history),
                                        cfg.max_tokens))  # fmt: skip
                history.append({"role": "assistant", "content": filler(rng, cfg.reply_words)})
            per_tenant[t].append(Session(sid, t, rag, tuple(requests)))
    # interleave tenants so concurrent sessions belong to different tenants, until only the
    # hot tenant has sessions left: its burst then runs alone
    rounds = max(len(v) for v in per_tenant.values())
    order = [per_tenant[t][k] for k in range(rounds) for t in tenants if k < len(per_tenant[t])]
    return Trace(cfg, tuple(order))


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
