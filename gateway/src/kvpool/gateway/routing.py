"""The routing core: which instance serves a request, and why. Pure: no I/O, no clock.

Why this module exists: every policy the gateway offers (kv-aware, session, least-load,
round-robin) is one small class behind one interface, :class:`Policy`, registered under its
config name (``spec.gateway.routing.policy``; the names are :mod:`kvpool.protocol.policies`), so
the serving glue and the fleet simulator only build :class:`Candidate` rows (what each instance
holds of this prompt and how loaded it is) and ask for a :class:`Decision`. Adding a policy is
one class with the ``@register`` decorator. The formula of the kv-aware score and its guards is
written out in ``gateway/README.md``; the code below is its only implementation.

kv-aware (default)::

    H_i   = tier-weighted cached prefix tokens of instance i (weights per tier class from
            :mod:`kvpool.protocol.tiers`: device 1.0 > DDR 0.8 > P2P peer 0.6 > disk 0.5 >
            remote 0.3; pending = routed here moments ago, not yet admitted: 0.8)
    L_i   = (queued prefill tokens_i + chunk_size * in-flight requests_i) * slow_i
    slow_i = recent TTFT of i / median recent TTFT of the pool, clipped to [0.5, 2]
    score = w_prefix * H_i - w_load * L_i           (w_* = the pool's spec.gateway.routing)

Guards: an instance is *eligible* only while its in-flight count is at most
``max(imbalance_abs + min_inflight, imbalance_ratio * min_inflight)`` (a hot prefix cannot
pull the whole pool onto one instance); ties go to the session's rendezvous-hash favourite,
then to the name.
"""

from __future__ import annotations

import hashlib
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, TypeVar

from kvpool.protocol.policies import ROUTING_POLICIES
from kvpool.protocol.tiers import DEFAULT_TIER_WEIGHTS as BACKEND_TIER_WEIGHTS
from kvpool.protocol.tiers import tier_class

#: Weight of one cached token by the tier class that holds it (see :func:`tier_of`).
DEFAULT_TIER_WEIGHTS: dict[str, float] = {**BACKEND_TIER_WEIGHTS, "pending": 0.8}
#: The location a P2P group member is credited its peers' chunks under: LMCache's P2P backend.
P2P_LOCATION = "P2PBackend"
#: The location of chunks routed to an instance moments ago, not yet admitted (gateway only).
PENDING_LOCATION = "pending"


def tier_of(location: str) -> str:
    """The tier class of a location (an LMCache backend name a worker reports, or pending)."""
    return "pending" if location == PENDING_LOCATION else tier_class(location)


@dataclass(frozen=True)
class PrefixHit:
    """What one instance holds of the prompt: leading chunks, and how many each tier holds."""

    hit_chunks: int
    per_location: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class InstanceLoad:
    """How busy an instance is right now (see :class:`kvpool.gateway.load.LoadTracker`)."""

    inflight: int = 0
    queued_prefill_tokens: int = 0
    ttft_s: float | None = None  # recent TTFT (EWMA); None until measured


@dataclass(frozen=True)
class Candidate:
    """One instance that may serve the request (healthy, breaker closed)."""

    name: str
    load: InstanceLoad = InstanceLoad()
    hit: PrefixHit | None = None


@dataclass(frozen=True)
class RouteRequest:
    """What the router knows about a request: its size, its chunk hashes, its session."""

    prompt_tokens: int
    chunk_size: int
    session: str | None = None


@dataclass(frozen=True)
class Decision:
    """The chosen instance, the reason (a metric label) and the hit it is expected to get."""

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

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision: ...


def _check(candidates: Sequence[Candidate]) -> None:
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

    def eligible(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        low = min(c.load.inflight for c in candidates)
        cap = max(low + self.imbalance_abs, self.imbalance_ratio * low)
        return [c for c in candidates if c.load.inflight <= cap]


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

    def load_cost(self, c: Candidate, chunk_size: int, median_ttft: float | None) -> float:
        tokens = c.load.queued_prefill_tokens + chunk_size * c.load.inflight
        slow = 1.0
        if median_ttft and c.load.ttft_s is not None:
            slow = min(2.0, max(0.5, c.load.ttft_s / median_ttft))
        return tokens * slow

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        _check(candidates)
        ttfts = [c.load.ttft_s for c in candidates if c.load.ttft_s is not None]
        median = statistics.median(ttfts) if ttfts else None
        scores: dict[str, float] = {}
        for c in candidates:
            cached = weighted_hit_tokens(
                c.hit, request.chunk_size, request.prompt_tokens, self.tier_weights
            )
            cost = self.load_cost(c, request.chunk_size, median)
            scores[c.name] = self.prefix_weight * cached - self.load_weight * cost
        eligible = self.guards.eligible(candidates)
        order = {n: i for i, n in enumerate(_tie_order(request.session, candidates))}
        best = max(eligible, key=lambda c: (scores[c.name], -order[c.name]))
        unguarded = max(candidates, key=lambda c: (scores[c.name], -order[c.name]))
        cached = hit_tokens(best.hit, request.chunk_size, request.prompt_tokens)
        if unguarded.name != best.name and scores[unguarded.name] > scores[best.name]:
            reason = "imbalance-guard"
        elif cached > 0:
            reason = "kv-hit"
        else:
            reason = "kv-miss-least-load"
        return Decision(best.name, reason, cached, scores)


def _tie_order(session: str | None, candidates: Sequence[Candidate]) -> list[str]:
    names = sorted(c.name for c in candidates)
    return rendezvous_rank(session, names) if session else names


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

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        _check(candidates)
        if not request.session:
            d = self._fallback.choose(request, candidates)
            return Decision(d.instance, "no-session-least-load", d.predicted_hit_tokens)
        by_name = {c.name: c for c in candidates}
        eligible = {c.name for c in self.guards.eligible(candidates)}
        ranked = rendezvous_rank(request.session, sorted(by_name))
        for position, name in enumerate(ranked):
            if name in eligible:
                reason = "session" if position == 0 else "session-imbalance-guard"
                hit = hit_tokens(by_name[name].hit, request.chunk_size, request.prompt_tokens)
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

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        _check(candidates)
        best = min(
            candidates,
            key=lambda c: (
                c.load.inflight,
                c.load.queued_prefill_tokens,
                c.load.ttft_s if c.load.ttft_s is not None else 0.0,
                c.name,
            ),
        )
        hit = hit_tokens(best.hit, request.chunk_size, request.prompt_tokens)
        return Decision(best.name, "least-load", hit)


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

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        _check(candidates)
        ordered = sorted(candidates, key=lambda c: c.name)
        pick = ordered[self._next % len(ordered)]
        self._next += 1
        hit = hit_tokens(pick.hit, request.chunk_size, request.prompt_tokens)
        return Decision(pick.name, "round-robin", hit)


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

    def route(
        self, request: RouteRequest, candidates: Sequence[Candidate], *, index_ok: bool
    ) -> Decision:
        if index_ok or not self.policy.uses_index:
            return self.policy.choose(request, candidates)
        if request.session:
            d = self._session.choose(request, candidates)
            return Decision(d.instance, "fallback-session", d.predicted_hit_tokens)
        d = self._least.choose(request, candidates)
        return Decision(d.instance, "fallback-least-load", d.predicted_hit_tokens)
