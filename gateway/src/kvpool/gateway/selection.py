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

from kvpool.gateway.errors import upstream_error
from kvpool.gateway.index_client import IndexClient
from kvpool.gateway.instances import Instance, InstanceSet
from kvpool.gateway.load import LoadTracker, PendingPrefixes, extend_hit, merge_pending
from kvpool.gateway.metrics import GatewayMetrics
from kvpool.gateway.proxy import Attempt
from kvpool.gateway.routing import (
    P2P_LOCATION,
    Candidate,
    Decision,
    PrefixHit,
    Router,
    RouteRequest,
)


@dataclass(frozen=True)
class Prompt:
    """A request's routing facts: token count, chained chunk hashes, session."""

    tokens: int
    hashes: tuple[int, ...]
    session: str | None


@dataclass
class Selector:
    """Chooses instances for requests (and records what it chose)."""

    instances: InstanceSet
    index: IndexClient
    router: Router
    load: LoadTracker
    pending: PendingPrefixes
    metrics: GatewayMetrics
    chunk_size: int
    clock: Callable[[], float] = time.monotonic

    async def hits(self, prompt: Prompt) -> dict[str, PrefixHit] | None:
        return await self.index.prefix_hits(prompt.hashes)

    def candidates(
        self,
        pool: Sequence[Instance],
        prompt: Prompt,
        hits: dict[str, PrefixHit] | None,
        exclude: set[str],
    ) -> list[Candidate]:
        now = self.clock()
        hits = hits or {}
        group_best = self._group_best(hits)
        out: list[Candidate] = []
        for inst in self.instances.available(pool):
            if inst.name in exclude:
                continue
            hit = merge_pending(
                hits.get(inst.name), self.pending.hit(inst.name, prompt.hashes, now)
            )
            if inst.role == "peer":  # P2P: a peer's chunks can be pulled (tier p2p)
                hit = extend_hit(hit, group_best.get(inst.group, 0), P2P_LOCATION)
            out.append(Candidate(inst.name, self.load.load(inst.name), hit))
        return out

    def _group_best(self, hits: dict[str, PrefixHit]) -> dict[str, int]:
        """Per P2P group, the longest prefix one of its peers holds (one pass over the hits,
        so building the candidates is O(instances), not O(instances x group size))."""
        best: dict[str, int] = {}
        for name, hit in hits.items():
            inst = self.instances.by_name.get(name)
            if (
                inst is not None
                and inst.role == "peer"
                and hit.hit_chunks > best.get(inst.group, 0)
            ):
                best[inst.group] = hit.hit_chunks
        return best

    async def choose(
        self,
        pool: Sequence[Instance],
        prompt: Prompt,
        exclude: set[str],
        role: str = "serve",
        reason: str | None = None,
    ) -> tuple[Instance, Decision]:
        """The instance for this attempt; 503 when none of ``pool`` can take it."""
        hits = await self.hits(prompt)
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
        self.pending.record(inst.name, prompt.hashes, self.clock())
        return inst, decision

    def admit(self, inst: Instance, prompt: Prompt, decision: Decision) -> Attempt:
        """Count the request against ``inst`` (uncached prompt tokens are queued prefill)."""
        queued = max(0, prompt.tokens - decision.predicted_hit_tokens)
        now = self.clock()
        ticket = self.load.start(inst.name, queued, now)
        self.pending.record(inst.name, prompt.hashes, now, ticket)  # alive until answered + TTL
        self.metrics.inflight.labels(inst.name).set(self.load.load(inst.name).inflight)
        return Attempt(inst, ticket, decision.reason, decision.predicted_hit_tokens)

    async def attempt(
        self,
        pool: Sequence[Instance],
        prompt: Prompt,
        exclude: set[str],
        reason: str | None = None,
    ) -> Attempt:
        inst, decision = await self.choose(pool, prompt, exclude, reason=reason)
        return self.admit(inst, prompt, decision)
