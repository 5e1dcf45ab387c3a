"""What the gateway remembers of each recent request's routing, by request id.

Why this module exists: "why did this request miss?" is asked after the fact, so the facts
must be kept when they are true: which instances held which chunks at which tier when the
request was routed (the index answer, as the replica's groups: a bitmask of instances per
distinct answer, so a thousand holders cost one integer), the best candidates' scores, loads
and hits, the winner and its reason, which instances were frozen. :class:`ExplainBook` keeps a
bounded ring of :class:`Record` by request id, fed by the selector's decisions (the ``observe``
hook) while the request's record is current (a context variable set by ``serving``), the
gateway's prompt history (:class:`kvpool.gateway.recent.PromptHistory`) and the evictions the
index's delta stream carries (:class:`kvpool.gateway.recent.EvictionLog`). Building the answer
to an explain request is :mod:`kvpool.gateway.explain_report`.

Cost on the request path: a record (a few hundred bytes plus the index answer the router
already computed), a dict probe per chunk of the prompt in the history, and for the best
candidates (at most :data:`kvpool.gateway.routing.TOP_SCORES`) their load and hit.
"""

from __future__ import annotations

import contextvars
import math
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvpool.gateway.candidates import Candidates, PrefixHit
from kvpool.gateway.hitgroups import GroupedHits, name_of
from kvpool.gateway.instances import Instance, InstanceSet
from kvpool.gateway.misses import Sent
from kvpool.gateway.recent import EvictionLog, PromptHistory
from kvpool.gateway.routing import Decision
from kvpool.protocol import deltas as dl

__all__ = ["Answer", "ExplainBook", "Record", "Row", "Step", "request_id_of"]

MAX_STEPS = 8  # decisions kept per request (retries, PD steps)
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def request_id_of(given: str | None) -> str:
    """The client's ``x-request-id`` when it is a plain token (letters, digits, ``._:-``, at
    most 128), else a new one."""
    if given and _REQUEST_ID.match(given):
        return given
    return uuid.uuid4().hex


@dataclass(frozen=True, slots=True)
class Row:
    """One candidate of a decision: its score (kv-aware; None for other policies), what it
    held of the prompt, its load."""

    name: str
    score: float | None
    hit_chunks: int
    per_location: Mapping[str, int]
    inflight: int
    queued: int
    ttft_s: float | None


@dataclass(frozen=True, slots=True)
class Step:
    """One routing decision of a request (``role``: serve, or prefill and decode)."""

    role: str
    instance: str
    reason: str
    predicted_hit_tokens: int
    rows: tuple[Row, ...]
    candidates: int
    frozen: tuple[str, ...]
    chosen_frozen: bool
    note: str = ""


@dataclass(frozen=True, slots=True)
class Answer:
    """The index answer a request was routed on: ``groups`` of (instances, hit chunks,
    per-location counts), the instances as a bitmask over ``ids`` (the replica's form) or as
    names (the controller's HTTP lookup)."""

    mode: str  # "replica" | "http"
    groups: tuple[tuple[int | tuple[str, ...], int, Mapping[str, int]], ...]
    ids: tuple[str, ...] = ()

    @property
    def longest(self) -> int:
        return max((g[1] for g in self.groups), default=0)

    def named(self) -> list[tuple[list[str], int, Mapping[str, int]]]:
        """Each group with its instances' configured names, longest hit first."""
        out: list[tuple[list[str], int, Mapping[str, int]]] = []
        for who, chunks, per_location in self.groups:
            if isinstance(who, int):
                names: list[str] = []
                rest = who
                while rest:
                    low = rest & -rest
                    rest ^= low
                    i = low.bit_length() - 1
                    if i < len(self.ids):
                        names.append(name_of(self.ids[i]))
                who_names = sorted(set(names))
            else:
                who_names = sorted(who)
            out.append((who_names, chunks, per_location))
        return sorted(out, key=lambda g: -g[1])


@dataclass(slots=True)
class Record:
    """One request's routing, kept by :class:`ExplainBook` (``tokens`` only while it is
    being routed: the prompt history keeps them by chunk)."""

    request_id: str
    at: float
    endpoint: str
    session: str | None
    prompt_tokens: int
    hashes: tuple[int, ...]
    tokens: Sequence[int] | None = None
    answer: Answer | None = None
    index_mode: str = "down"
    steps: list[Step] = field(default_factory=list)

    @property
    def miss_from(self) -> int:
        """The first chunk no instance held in the index answer."""
        return self.answer.longest if self.answer is not None else 0


#: The record of the request being routed in this task (set by ``serving``).
CURRENT: contextvars.ContextVar[Record | None] = contextvars.ContextVar(
    "kvpool_explain_record", default=None
)


class ExplainBook:
    """The ring of recent :class:`Record` (``max_requests``), the prompt history and the
    eviction log; see the module docstring."""

    def __init__(
        self,
        chunk_size: int,
        instances: InstanceSet,
        *,
        max_requests: int,
        prompt_bytes: int,
        evictions: int,
    ) -> None:
        self.chunk_size = chunk_size
        self.instances = instances
        self.max_requests = max_requests
        self.records: OrderedDict[str, Record] = OrderedDict()
        self.history = PromptHistory(chunk_size, prompt_bytes)
        self.evictions = EvictionLog(evictions)
        self._ids: OrderedDict[tuple[int, int], tuple[object, tuple[str, ...]]] = OrderedDict()
        self._positions: tuple[object, dict[str, int]] | None = None

    # ------------------------------------------------------------------ the request path

    def begin(
        self,
        request_id: str,
        endpoint: str,
        session: str | None,
        hashes: tuple[int, ...],
        tokens: Sequence[int],
    ) -> Record:
        """A new record, current in this task until :meth:`end`."""
        rec = Record(request_id, time.time(), endpoint, session, len(tokens), hashes, tokens)
        self.records.pop(request_id, None)
        self.records[request_id] = rec
        while len(self.records) > self.max_requests:
            self.records.popitem(last=False)
        return rec

    @staticmethod
    def end(rec: Record) -> None:
        rec.tokens = None

    def get(self, request_id: str) -> Record | None:
        return self.records.get(request_id)

    def observe(
        self,
        role: str,
        hashes: tuple[int, ...],
        hits: GroupedHits | Mapping[str, PrefixHit] | None,
        cands: Candidates,
        decision: Decision,
        inst: Instance,
        note: str = "",
    ) -> None:
        """A decision for the current request's prompt (``hashes`` is its tuple; decisions
        for other prompts, e.g. a memory prefetch, are not its own)."""
        rec = CURRENT.get()
        if rec is None or rec.hashes is not hashes:
            return
        if rec.answer is None and hits is not None:
            rec.answer = self.answer_of(hits)
            rec.index_mode = rec.answer.mode
        if len(rec.steps) < MAX_STEPS:
            rec.steps.append(self.step(role, cands, decision, inst, note))
        if rec.tokens is not None and hashes and role != "decode":  # a decoder gets it by transfer
            sent = Sent(rec.request_id, inst.name, rec.at, inst in self.instances.frozen)
            self.history.record(rec.tokens, hashes, sent)

    def step(
        self, role: str, cands: Candidates, decision: Decision, inst: Instance, note: str = ""
    ) -> Step:
        """One decision as a record keeps it."""
        frozen = self.instances.frozen
        return Step(
            role,
            inst.name,
            decision.reason,
            decision.predicted_hit_tokens,
            self._rows(cands, decision),
            len(cands),
            tuple(sorted(i.name for i in frozen)) if frozen else (),
            inst in frozen,
            note,
        )

    def preview(
        self,
        endpoint: str,
        session: str | None,
        hashes: tuple[int, ...],
        prompt_tokens: int,
        hits: GroupedHits | Mapping[str, PrefixHit] | None,
    ) -> Record:
        """A record of a decision not taken (a dry run): kept nowhere."""
        rec = Record(f"dry-run-{uuid.uuid4().hex[:12]}", time.time(), endpoint, session,
                     prompt_tokens, hashes)  # fmt: skip
        if hits is not None:
            rec.answer = self.answer_of(hits)
            rec.index_mode = rec.answer.mode
        return rec

    def on_batch(self, batch: dl.DeltaBatch) -> None:
        """The index client's hook: remember what each delta batch removed."""
        now = time.time()
        for d in batch.deltas:
            if d.op is dl.DeltaOp.EVICT:
                self.evictions.evicted(d.instance_id, d.location, d.keys, now)
            elif d.op is dl.DeltaOp.CLEAR:
                self.evictions.lost(d.instance_id, d.location, now, "clear")
            elif d.op is dl.DeltaOp.WORKER_DOWN:
                self.evictions.lost(d.instance_id, "", now, "worker_down")

    def answer_of(self, hits: GroupedHits | Mapping[str, PrefixHit]) -> Answer:
        if isinstance(hits, GroupedHits):
            ids = self._ids_of(hits)
            groups = tuple((g.instances, g.hit_chunks, g.per_location) for g in hits.groups)
            return Answer("replica", groups, ids)
        same: dict[tuple[int, tuple[tuple[str, int], ...]], list[str]] = {}
        for name, hit in hits.items():
            key = (hit.hit_chunks, tuple(sorted(hit.per_location.items())))
            same.setdefault(key, []).append(name)
        return Answer("http", tuple((tuple(names), k[0], dict(k[1])) for k, names in same.items()))

    # ------------------------------------------------------------------ internals

    def _ids_of(self, hits: GroupedHits) -> tuple[str, ...]:
        """The index's instance ids as of ``hits.version``, one tuple per version (the list
        itself changes as instances come and go)."""
        key = (id(hits.ids), hits.version)
        found = self._ids.get(key)
        if found is None:
            found = self._ids[key] = (hits.ids, tuple(hits.ids))
            while len(self._ids) > 8:
                self._ids.popitem(last=False)
        return found[1]

    def _where(self, names: Sequence[str]) -> dict[str, int]:
        cached = self._positions
        if cached is not None and cached[0] is names:
            return cached[1]
        where = {n: i for i, n in enumerate(names)}
        if len(names) > 64:  # the pool's own list: the same object while the pool is unchanged
            self._positions = (names, where)
        return where

    def _rows(self, c: Candidates, decision: Decision) -> tuple[Row, ...]:
        """The best candidates (the decision's scores), the winner and the longest holder."""
        where = self._where(c.names)
        owner = None
        if c.shared:
            owner = np.full(len(c), -1, dtype=np.int64)
            for k, (positions, _) in enumerate(c.shared):
                owner[positions] = k

        def hit(i: int) -> PrefixHit | None:
            own = c.hits.get(i)
            if own is not None or owner is None:
                return own
            k = int(owner[i])
            return c.shared[k][1] if k >= 0 else None

        wanted = list(decision.scores) or [decision.instance]
        if decision.instance not in wanted:
            wanted.append(decision.instance)
        longest = max(
            [(h.hit_chunks, i) for i, h in c.hits.items()]
            + [(h.hit_chunks, int(p[0])) for p, h in c.shared if len(p)],
            default=None,
        )
        if longest is not None and longest[0] > 0 and c.names[longest[1]] not in wanted:
            wanted.append(c.names[longest[1]])
        rows = []
        for name in wanted:
            i = where.get(name)
            if i is None:
                continue
            h = hit(i)
            ttft = float(c.ttft[i])
            rows.append(
                Row(
                    name,
                    decision.scores.get(name),
                    h.hit_chunks if h is not None else 0,
                    dict(h.per_location) if h is not None else {},
                    int(c.inflight[i]),
                    int(c.queued[i]),
                    None if math.isnan(ttft) else ttft,
                )
            )
        return tuple(rows)
