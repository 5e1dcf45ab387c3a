"""The routing core: which instance serves a request, and why. Pure: no I/O, no clock.

Why this module exists: every policy the gateway offers (kv-aware, session, least-load,
round-robin) is one small class behind one interface, :class:`Policy`, registered under its
config name (``spec.gateway.routing.policy``; the names are :mod:`kvpool.protocol.policies`), so
the serving glue and the fleet simulator only build :class:`Candidates` (what each instance
holds of this prompt and how loaded it is, column by column) and ask for a :class:`Decision`.
Adding a policy is one class with the ``@register`` decorator. The formula of the kv-aware score
and its guards is written out in ``gateway/README.md``; the code below is its only
implementation.

kv-aware (default)::

    H_i   = tier-weighted cached prefix tokens of instance i (weights per tier class from
            :mod:`kvpool.protocol.tiers`: device 1.0 > DDR 0.8 > P2P peer 0.6 > disk 0.5 >
            remote 0.3; pending = routed here, not yet admitted or still on the device: 0.8)
    L_i   = (queued prefill tokens_i + chunk_size * in-flight requests_i) * slow_i
    slow_i = recent TTFT of i / median recent TTFT of the pool, clipped to [0.5, 2]
    score = w_prefix * H_i - w_load * L_i           (w_* = the pool's spec.gateway.routing)

Guards: an instance is *eligible* only while its in-flight count is at most
``max(imbalance_abs + min_inflight, imbalance_ratio * min_inflight)`` (a hot prefix cannot
pull the whole pool onto one instance); ties go to the session's rendezvous-hash favourite,
then to the name. The scores of a thousand instances are computed as arrays (numpy), in the
same floating-point operations as one at a time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, TypeVar

import numpy as np

from kvpool.gateway.candidates import (
    BoolArray,
    Candidate,
    Candidates,
    FloatArray,
    InstanceLoad,
    PrefixHit,
)
from kvpool.protocol.policies import ROUTING_POLICIES
from kvpool.protocol.tiers import DEFAULT_TIER_WEIGHTS as BACKEND_TIER_WEIGHTS
from kvpool.protocol.tiers import tier_class

__all__ = [
    "DEFAULT_TIER_WEIGHTS",
    "P2P_LOCATION",
    "PENDING_LOCATION",
    "POLICIES",
    "Candidate",
    "Candidates",
    "Decision",
    "Guards",
    "InstanceLoad",
    "KvAwarePolicy",
    "LeastLoadPolicy",
    "NoCandidateError",
    "Policy",
    "PolicySettings",
    "PrefixHit",
    "RoundRobinPolicy",
    "RouteRequest",
    "Router",
    "SessionPolicy",
    "hit_tokens",
    "make_policy",
    "register",
    "rendezvous_rank",
    "tier_of",
    "weighted_hit_tokens",
]

#: Weight of one cached token by the tier class that holds it (see :func:`tier_of`).
DEFAULT_TIER_WEIGHTS: dict[str, float] = {**BACKEND_TIER_WEIGHTS, "pending": 0.8}
#: The location a P2P group member is credited its peers' chunks under: LMCache's P2P backend.
P2P_LOCATION = "P2PBackend"
#: The location of chunks routed to an instance moments ago, not yet admitted (gateway only).
PENDING_LOCATION = "pending"
#: Scores a decision carries (the best ones), for explanations.
TOP_SCORES = 8


def tier_of(location: str) -> str:
    """The tier class of a location (an LMCache backend name a worker reports, or pending)."""
    return "pending" if location == PENDING_LOCATION else tier_class(location)


@dataclass(frozen=True)
class RouteRequest:
    """What the router knows about a request: its size, its chunk hashes, its session."""

    prompt_tokens: int
    chunk_size: int
    session: str | None = None


@dataclass(frozen=True)
class Decision:
    """The chosen instance, the reason (a metric label), the hit it is expected to get, and
    the best candidates' scores (at most :data:`TOP_SCORES`, the chosen one included)."""

    instance: str
    reason: str
    predicted_hit_tokens: int = 0
    scores: Mapping[str, float] = field(default_factory=dict)


class NoCandidateError(Exception):
    """No instance can take the request (all unhealthy, open breakers, or none configured)."""


class Policy(Protocol):
    """One routing policy: picks among candidates; never empty (the glue checks first).

    ``name`` is its config name; ``uses_index`` says whether it needs the chunk index (when the
    index cannot be trusted, the :class:`Router` falls back for such a policy).
    """

    name: ClassVar[str]
    uses_index: ClassVar[bool]

    def choose(self, request: RouteRequest, candidates: Candidates) -> Decision: ...


def _check(candidates: Candidates) -> None:
    if not candidates:
        raise NoCandidateError("no instance is available")


def rendezvous_rank(key: str, names: Sequence[str]) -> list[str]:
    """``names`` ordered by highest-random-weight hashing of ``key``: a consistent hash.

    Adding or removing one instance moves only the keys that instance wins or held.
    """

    def weight(name: str) -> bytes:
        return hashlib.blake2b(f"{key}\x00{name}".encode(), digest_size=8).digest()

    return sorted(names, key=weight, reverse=True)


def hit_tokens(hit: PrefixHit | None, chunk_size: int, prompt_tokens: int) -> int:
    """Unweighted cached prefix tokens (the last chunk may be partial)."""
    if hit is None:
        return 0
    return min(hit.hit_chunks * chunk_size, prompt_tokens)


def weighted_hit_tokens(
    hit: PrefixHit | None,
    chunk_size: int,
    prompt_tokens: int,
    weights: Mapping[str, float] = DEFAULT_TIER_WEIGHTS,
) -> float:
    """Cached prefix tokens weighted by tier, fastest tier first.

    ``per_location`` may count a chunk in two tiers; the prefix's ``hit_chunks`` are credited
    to the fastest tiers first, so a chunk is counted once, at its best tier.
    """
    if hit is None or hit.hit_chunks <= 0:
        return 0.0
    by_tier: dict[str, int] = {}
    for location, count in hit.per_location.items():
        tier = tier_of(location)
        by_tier[tier] = by_tier.get(tier, 0) + count
    remaining = hit.hit_chunks
    credited = 0.0
    for tier in sorted(by_tier, key=lambda t: weights.get(t, 0.0), reverse=True):
        take = min(remaining, by_tier[tier])
        credited += take * weights.get(tier, 0.0)
        remaining -= take
        if remaining == 0:
            break
    if remaining:  # per_location unknown (e.g. an older controller): assume DDR
        credited += remaining * weights.get("ddr", 0.0)
    tokens = hit_tokens(hit, chunk_size, prompt_tokens)
    return credited / hit.hit_chunks * tokens


@dataclass(frozen=True)
class Guards:
    """Bounded imbalance: the most in-flight requests an instance may carry, relative to
    the least loaded candidate, before it stops being eligible for affinity."""

    imbalance_abs: int = 8
    imbalance_ratio: float = 1.5

    def eligible(self, candidates: Candidates) -> BoolArray:
        """A boolean mask of the eligible candidates (the least loaded always is)."""
        low = int(candidates.inflight.min())
        cap = max(low + self.imbalance_abs, self.imbalance_ratio * low)
        return candidates.inflight <= cap


DEFAULT_GUARDS = Guards()


@dataclass(frozen=True)
class PolicySettings:
    """What a policy may be built from: ``spec.gateway.routing`` and the guards."""

    prefix_weight: float = 1.0
    load_weight: float = 1.0
    guards: Guards = DEFAULT_GUARDS


#: Config name -> factory of the policy of that name (filled by :func:`register`).
POLICIES: dict[str, Callable[[PolicySettings], Policy]] = {}

_P = TypeVar("_P")


def register(cls: _P) -> _P:
    """Class decorator: make a policy available under its ``name`` (its ``from_settings``
    builds it)."""
    name = cls.name  # type: ignore[attr-defined]
    if name not in ROUTING_POLICIES:
        raise ValueError(f"policy {name!r} is not in kvpool.protocol.policies.ROUTING_POLICIES")
    POLICIES[name] = cls.from_settings  # type: ignore[attr-defined]
    return cls


def _tie_break(session: str | None, names: Sequence[str], tied: Sequence[int]) -> int:
    """Among tied positions: the session's rendezvous favourite, else the smallest name."""
    if len(tied) == 1:
        return tied[0]
    if session:
        first = rendezvous_rank(session, [names[i] for i in tied])[0]
        return next(i for i in tied if names[i] == first)
    return min(tied, key=lambda i: names[i])


def _best(scores: FloatArray, mask: BoolArray, session: str | None, names: Sequence[str]) -> int:
    """Position of the highest score among ``mask``, ties broken by :func:`_tie_break`."""
    top = scores[mask].max()
    tied = np.flatnonzero(mask & (scores == top))
    return _tie_break(session, names, [int(i) for i in tied])


def _top_scores(scores: FloatArray, names: Sequence[str], chosen: int) -> dict[str, float]:
    k = min(TOP_SCORES, len(names))
    best = np.argpartition(-scores, k - 1)[:k] if k < len(names) else np.arange(len(names))
    out = {names[int(i)]: float(scores[i]) for i in best}
    out[names[chosen]] = float(scores[chosen])
    return out


@register
class KvAwarePolicy:
    """Cached prefix (tier-weighted) against load; see the module docstring."""

    name: ClassVar[str] = "kv-aware"
    uses_index: ClassVar[bool] = True

    def __init__(
        self,
        prefix_weight: float = 1.0,
        load_weight: float = 1.0,
        tier_weights: Mapping[str, float] = DEFAULT_TIER_WEIGHTS,
        guards: Guards = DEFAULT_GUARDS,
    ) -> None:
        self.prefix_weight = prefix_weight
        self.load_weight = load_weight
        self.tier_weights = dict(tier_weights)
        self.guards = guards

    @classmethod
    def from_settings(cls, s: PolicySettings) -> KvAwarePolicy:
        return cls(s.prefix_weight, s.load_weight, guards=s.guards)

    def cached(self, request: RouteRequest, c: Candidates) -> FloatArray:
        """H_i for every candidate (tier-weighted cached prefix tokens).

        Most holders of a prompt hold the same thing (a shared system prompt: the same chunks
        in the same tiers), so each distinct hit is weighed once: by object first (the index
        client hands equal hits out as one object), then by content (chunks and per-tier
        counts in their order, so the sum is the same floating-point operations)."""
        h: FloatArray = np.zeros(len(c), dtype=np.float64)
        args = (request.chunk_size, request.prompt_tokens, self.tier_weights)
        by_id: dict[int, float] = {}
        by_value: dict[tuple[int, tuple[tuple[str, int], ...]], float] = {}

        def weigh(hit: PrefixHit) -> float:
            value = by_id.get(id(hit))
            if value is None:
                key = (hit.hit_chunks, tuple(hit.per_location.items()))
                value = by_value.get(key)
                if value is None:
                    value = by_value[key] = weighted_hit_tokens(hit, *args)
                by_id[id(hit)] = value
            return value

        for positions, hit in c.shared:
            h[positions] = weigh(hit)
        for i, hit in c.hits.items():
            h[i] = weigh(hit)
        return h

    def load_cost(self, request: RouteRequest, c: Candidates) -> FloatArray:
        """L_i for every candidate."""
        tokens = c.queued + request.chunk_size * c.inflight
        known = ~np.isnan(c.ttft)
        slow: FloatArray = np.ones(len(c), dtype=np.float64)
        if known.any():
            median = float(np.median(c.ttft[known]))
            if median:
                slow[known] = np.clip(c.ttft[known] / median, 0.5, 2.0)
        cost: FloatArray = tokens * slow
        return cost

    def choose(self, request: RouteRequest, candidates: Candidates) -> Decision:
        _check(candidates)
        c = candidates
        scores: FloatArray = self.prefix_weight * self.cached(request, c) - (
            self.load_weight * self.load_cost(request, c)
        )
        everyone = np.ones(len(c), dtype=bool)
        best = _best(scores, self.guards.eligible(c), request.session, c.names)
        unguarded = _best(scores, everyone, request.session, c.names)
        cached = hit_tokens(c.hit(best), request.chunk_size, request.prompt_tokens)
        if unguarded != best and scores[unguarded] > scores[best]:
            reason = "imbalance-guard"
        elif cached > 0:
            reason = "kv-hit"
        else:
            reason = "kv-miss-least-load"
        return Decision(c.names[best], reason, cached, _top_scores(scores, c.names, best))


@register
class SessionPolicy:
    """Session affinity: one session (``x-session-id`` or ``user``) always lands on the same
    instance while it is available (rendezvous hashing); requests without one go to the
    least-loaded instance."""

    name: ClassVar[str] = "session"
    uses_index: ClassVar[bool] = False

    def __init__(self, guards: Guards = DEFAULT_GUARDS) -> None:
        self.guards = guards
        self._fallback = LeastLoadPolicy()

    @classmethod
    def from_settings(cls, s: PolicySettings) -> SessionPolicy:
        return cls(s.guards)

    def choose(self, request: RouteRequest, candidates: Candidates) -> Decision:
        _check(candidates)
        c = candidates
        if not request.session:
            d = self._fallback.choose(request, c)
            return Decision(d.instance, "no-session-least-load", d.predicted_hit_tokens)
        eligible = self.guards.eligible(c)
        position = {name: i for i, name in enumerate(c.names)}
        for rank, name in enumerate(rendezvous_rank(request.session, sorted(c.names))):
            i = position[name]
            if eligible[i]:
                reason = "session" if rank == 0 else "session-imbalance-guard"
                hit = hit_tokens(c.hit(i), request.chunk_size, request.prompt_tokens)
                return Decision(name, reason, hit)
        raise NoCandidateError("no eligible instance")  # unreachable: the least loaded is


@register
class LeastLoadPolicy:
    """Fewest in-flight requests, then fewest queued prefill tokens, then fastest TTFT."""

    name: ClassVar[str] = "least-load"
    uses_index: ClassVar[bool] = False

    @classmethod
    def from_settings(cls, s: PolicySettings) -> LeastLoadPolicy:
        return cls()

    def choose(self, request: RouteRequest, candidates: Candidates) -> Decision:
        _check(candidates)
        c = candidates
        left = np.flatnonzero(c.inflight == c.inflight.min())
        queued = c.queued[left]
        left = left[queued == queued.min()]
        ttft = np.nan_to_num(c.ttft[left], nan=0.0)
        left = left[ttft == ttft.min()]
        best = min((int(i) for i in left), key=lambda i: c.names[i])
        hit = hit_tokens(c.hit(best), request.chunk_size, request.prompt_tokens)
        return Decision(c.names[best], "least-load", hit)


@register
class RoundRobinPolicy:
    """Each candidate in turn (by name), whatever it holds."""

    name: ClassVar[str] = "round-robin"
    uses_index: ClassVar[bool] = False

    def __init__(self) -> None:
        self._next = 0

    @classmethod
    def from_settings(cls, s: PolicySettings) -> RoundRobinPolicy:
        return cls()

    def choose(self, request: RouteRequest, candidates: Candidates) -> Decision:
        _check(candidates)
        c = candidates
        ordered = sorted(range(len(c)), key=lambda i: c.names[i])
        pick = ordered[self._next % len(ordered)]
        self._next += 1
        hit = hit_tokens(c.hit(pick), request.chunk_size, request.prompt_tokens)
        return Decision(c.names[pick], "round-robin", hit)


def make_policy(name: str, settings: PolicySettings | None = None) -> Policy:
    """The policy the rendered config names."""
    factory = POLICIES.get(name)
    if factory is None:
        known = ", ".join(sorted(POLICIES))
        raise ValueError(f"unknown routing policy {name!r}; use one of {known}")
    return factory(settings or PolicySettings())


class Router:
    """The policy in force plus the fallback when the index cannot be trusted.

    With ``index_ok`` false (controller unreachable, replica out of sync) a policy that uses the
    index has no hits to weigh: requests with a session go by session affinity, others by least
    load.
    """

    def __init__(self, policy: Policy, guards: Guards = DEFAULT_GUARDS) -> None:
        self.policy = policy
        self._session = SessionPolicy(guards)
        self._least = LeastLoadPolicy()

    def route(self, request: RouteRequest, candidates: Candidates, *, index_ok: bool) -> Decision:
        if index_ok or not self.policy.uses_index:
            return self.policy.choose(request, candidates)
        if request.session:
            d = self._session.choose(request, candidates)
            return Decision(d.instance, "fallback-session", d.predicted_hit_tokens)
        d = self._least.choose(request, candidates)
        return Decision(d.instance, "fallback-least-load", d.predicted_hit_tokens)
