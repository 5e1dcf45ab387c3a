"""From a prompt to a chosen instance: index lookup, pending prefixes, load, the policy.

Why this module exists: the routing core (``routing``) is pure and knows nothing of where
hits and loads come from. This glue gathers them for one request — the index client's
per-instance hits, the optimistic entries of requests routed moments ago, the load tracker —
builds the candidates among the instances that are ready and not cut off by their breaker,
asks the router, and records the decision (pending entries, load ticket, metrics).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np

from kvpool.gateway.candidates import IntArray
from kvpool.gateway.errors import upstream_error
from kvpool.gateway.hitgroups import GroupedHits, GroupPositions
from kvpool.gateway.index_client import IndexClient
from kvpool.gateway.instances import Instance, InstanceSet
from kvpool.gateway.load import LoadTracker
from kvpool.gateway.metrics import GatewayMetrics
from kvpool.gateway.pending import PendingPrefixes, extend_hit, merge_pending
from kvpool.gateway.proxy import Attempt
from kvpool.gateway.routing import (
    P2P_LOCATION,
    Candidates,
    Decision,
    PrefixHit,
    Router,
    RouteRequest,
)

#: What the index says the instances hold of a prompt: grouped (the replica), per configured
#: name (the controller's HTTP lookup), or None (unknown: the router falls back).
Hits = GroupedHits | dict[str, PrefixHit] | None


class Observer(Protocol):
    """Told each decision: (role, the prompt's chunk hashes, hits, candidates, decision,
    instance, and a note for the record, e.g. why a PD request was or was not bypassed)."""

    def __call__(
        self,
        role: str,
        hashes: tuple[int, ...],
        hits: Hits,
        cands: Candidates,
        decision: Decision,
        inst: Instance,
        note: str = "",
        /,
    ) -> None: ...


@dataclass(frozen=True)
class Prompt:
    """A request's routing facts: token count, chained chunk hashes, session."""

    tokens: int
    hashes: tuple[int, ...]
    session: str | None


@dataclass
class _PoolColumns:
    """A list of instances as the columns a routing decision needs (names, load slots, and on
    demand their positions and P2P groups)."""

    instances: Sequence[Instance]
    names: list[str]
    slots: IntArray
    _position: dict[str, int] | None = None
    _groups: np.ndarray[Any, np.dtype[Any]] | None = None
    _grouped: GroupPositions | None = None

    def position(self) -> dict[str, int]:
        if self._position is None:
            self._position = {name: i for i, name in enumerate(self.names)}
        return self._position

    def grouped(self) -> GroupPositions:
        """The index's groups mapped to these positions."""
        if self._grouped is None:
            self._grouped = GroupPositions(len(self.names), self.position().get)
        return self._grouped

    def groups(self) -> np.ndarray[Any, np.dtype[Any]]:
        """Each instance's P2P group ("" when it cannot pull: PD roles, p2p: false), as an
        object array."""
        if self._groups is None:
            self._groups = np.array(
                [i.group if i.pulls else "" for i in self.instances], dtype=object
            )
        return self._groups


@dataclass
class Selector:
    """Chooses instances for requests (and records what it chose)."""

    instances: InstanceSet
    index: IndexClient | None  # None: the caller brings the hits (the fleet simulator)
    router: Router
    load: LoadTracker
    pending: PendingPrefixes
    metrics: GatewayMetrics
    chunk_size: int
    clock: Callable[[], float] = time.monotonic
    #: told every decision (``explain``: the request's record), None: nobody listens
    observer: Observer | None = None
    _columns: _PoolColumns | None = None
    _puller_groups: tuple[InstanceSet, int, dict[str, str]] | None = None

    async def hits(self, prompt: Prompt) -> Hits:
        if self.index is None:
            return None
        return await self.index.lookup(prompt.hashes)

    def candidates(
        self,
        pool: Sequence[Instance],
        prompt: Prompt,
        hits: Hits,
        exclude: set[str],
    ) -> Candidates:
        """The available instances of ``pool`` (not in ``exclude``) with their loads and what
        each holds of the prompt: its own index hit and pending entries, and, for a P2P group
        member, the longest prefix any member of its group holds (it can pull it)."""
        now = self.clock()
        avail = self.instances.available(pool)
        if exclude:
            avail = [i for i in avail if i.name not in exclude]
        if self.instances.frozen:  # what a frozen LMCache computes now is not stored
            thawed = [i for i in avail if i not in self.instances.frozen]
            avail = thawed or avail
        static = self._static(avail)
        inflight, queued, ttft = self.load.columns(static.slots)
        if isinstance(hits, GroupedHits) and not self._pullers():
            # no P2P group: every holder's hit is its own, so groups stay groups
            grouped = static.grouped()
            shared = grouped.shared(hits) if hits else []
            ends = self.pending.ends(prompt.hashes, now)
            if ends:
                version, pending_names = self.pending.names()
                table = grouped.table(pending_names, version, str)
                shared += grouped.with_pending(shared, ends, table)
            return Candidates(static.names, inflight, queued, ttft, {}, shared)
        pending = self.pending.hits(prompt.hashes, now)
        by_name = (hits.by_name() if isinstance(hits, GroupedHits) else hits) or {}
        group_best = self._group_best(by_name)
        sparse = self._sparse(static, by_name, pending, group_best)
        return Candidates(
            static.names,
            inflight,
            queued,
            ttft,
            sparse,
            self._group_shared(static, sparse, group_best),
        )

    def _sparse(
        self,
        static: _PoolColumns,
        hits: dict[str, PrefixHit],
        pending: dict[str, int],
        group_best: dict[str, int],
    ) -> dict[int, PrefixHit]:
        """Each instance's index hit, extended by its pending chunks, then (a P2P member) by
        the longest prefix its group holds, by position."""
        sparse: dict[int, PrefixHit] = {}
        where = static.position().get
        for name, hit in hits.items():
            i = where(name)
            if i is not None:
                sparse[i] = hit
        for name, chunks in pending.items():
            i = where(name)
            if i is not None:
                merged = merge_pending(hits.get(name), chunks)
                if merged is not None:
                    sparse[i] = merged
        if group_best:  # (extending by 0 chunks changes nothing)
            for i, hit in list(sparse.items()):
                inst = static.instances[i]
                if inst.pulls:  # P2P: a peer's chunks can be pulled (tier p2p)
                    best = group_best.get(inst.group, 0)
                    sparse[i] = extend_hit(hit, best, P2P_LOCATION) or hit
        return sparse

    @staticmethod
    def _group_shared(
        static: _PoolColumns, sparse: dict[int, PrefixHit], group_best: dict[str, int]
    ) -> list[tuple[IntArray, PrefixHit]]:
        """Per P2P group, the members without a hit of their own and what they can pull."""
        shared: list[tuple[IntArray, PrefixHit]] = []
        if group_best:
            groups = static.groups()
            for group, best in group_best.items():
                members = [int(i) for i in np.flatnonzero(groups == group) if int(i) not in sparse]
                if members:
                    hit = PrefixHit(best, {P2P_LOCATION: best})
                    shared.append((np.array(members, dtype=np.int64), hit))
        return shared

    def _static(self, avail: Sequence[Instance]) -> _PoolColumns:
        """What does not change from request to request for this list of instances (cached
        while the same list object comes back: the instance set's peers, all available)."""
        cached = self._columns
        if cached is not None and cached.instances is avail:
            return cached
        columns = _PoolColumns(
            avail, [i.name for i in avail], self.load.slots(i.name for i in avail)
        )
        if avail is self.instances.peers():
            self._columns = columns
        return columns

    def _pullers(self) -> dict[str, str]:
        """Name -> P2P group of every configured instance that can pull from its group (the
        configuration's; kept for this instance set)."""
        cached = self._puller_groups
        version = self.instances.generation  # a live reconfiguration changes the members
        if cached is None or cached[0] is not self.instances or cached[1] != version:
            groups = {i.name: i.group for i in self.instances if i.pulls}
            cached = self._puller_groups = (self.instances, version, groups)
        return cached[2]

    def _group_best(self, hits: dict[str, PrefixHit]) -> dict[str, int]:
        """Per P2P group, the longest prefix one of its peers holds (one pass over the hits,
        so building the candidates is O(instances), not O(instances x group size))."""
        best: dict[str, int] = {}
        pullers = self._pullers()
        if not pullers:
            return best
        for name, hit in hits.items():
            group = pullers.get(name)
            if group is not None and hit.hit_chunks > best.get(group, 0):
                best[group] = hit.hit_chunks
        return best

    def decide(
        self,
        pool: Sequence[Instance],
        prompt: Prompt,
        hits: Hits,
        exclude: set[str],
        role: str = "serve",
        reason: str | None = None,
        *,
        record: bool = True,
    ) -> tuple[Instance, Decision]:
        """The decision for ``hits`` (None: the index cannot be trusted), recorded in the
        metrics and (``record``) the pending prefixes, which :meth:`admit` records anyway;
        503 when none of ``pool`` can take it. No I/O: the fleet simulator calls this with hits
        from its own index."""
        cands = self.candidates(pool, prompt, hits, exclude)
        if not cands:
            self.metrics.rejections.labels("no_instance").inc()
            names = ", ".join(i.name for i in pool) or "none configured"
            raise upstream_error(
                503,
                f"no instance is ready to {role} this request (instances: {names}); retry shortly",
                "no_instance_available",
            )
        request = RouteRequest(prompt.tokens, self.chunk_size, prompt.session)
        decision = self.router.route(request, cands, index_ok=hits is not None)
        if reason is not None:  # the caller decided (a pinned request)
            decision = replace(decision, reason=reason)
        inst = self.instances.by_name[decision.instance]
        self.metrics.decisions.labels(decision.reason, inst.name).inc()
        self.metrics.predicted_hit_tokens.labels(inst.name).inc(decision.predicted_hit_tokens)
        self.metrics.prompt_tokens.labels(inst.name).inc(prompt.tokens)
        if record:
            self.pending.record(inst.name, prompt.hashes, self.clock())
        if self.observer is not None:
            self.observer(role, prompt.hashes, hits, cands, decision, inst)
        return inst, decision

    async def choose(
        self,
        pool: Sequence[Instance],
        prompt: Prompt,
        exclude: set[str],
        role: str = "serve",
        reason: str | None = None,
        *,
        record: bool = True,
    ) -> tuple[Instance, Decision]:
        """The instance for this attempt: the index's hits, then :meth:`decide`."""
        hits = await self.hits(prompt)
        return self.decide(pool, prompt, hits, exclude, role, reason, record=record)

    def admit(self, inst: Instance, prompt: Prompt, decision: Decision) -> Attempt:
        """Count the request against ``inst`` (uncached prompt tokens are queued prefill)."""
        queued = max(0, prompt.tokens - decision.predicted_hit_tokens)
        now = self.clock()
        ticket = self.load.start(inst.name, queued, now)
        self.pending.record(inst.name, prompt.hashes, now, ticket)  # alive until answered + TTL
        return Attempt(inst, ticket, decision.reason, decision.predicted_hit_tokens)

    async def attempt(
        self,
        pool: Sequence[Instance],
        prompt: Prompt,
        exclude: set[str],
        reason: str | None = None,
    ) -> Attempt:
        inst, decision = await self.choose(pool, prompt, exclude, reason=reason, record=False)
        return self.admit(inst, prompt, decision)
