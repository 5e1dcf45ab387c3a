"""Live figures of a cache domain: what its controller and gateway say now, as status.

Why pure: the operator's poller (``runtime/figures.py``) only GETs three answers per domain and
patches status; reading those answers, the hit-ratio window, the figures of the pool and of
each member, whether they are current, and the merge patch that writes them are decided here,
with the time passed in, so every branch is a unit test.

Where each figure comes from:

- the controller's ``GET /v1/stats`` (``kvpool.protocol.http_api.stats_reply``): the instance
  ids registered and their workers (TP ranks), distinct chunks and chunk-locations per LMCache
  location, refusals and the latest refused ids. The operator already reaches the controller's
  HTTP API (its finalizer deregisters there; the domain's NetworkPolicy admits it).
- the gateway's ``GET /metrics``: ``kvpool_gateway_predicted_hit_tokens_total`` and
  ``kvpool_gateway_prompt_tokens_total`` (summed over instances), whose increase between two
  readings is the hit ratio of the window. The controller sees no hits; the workers do, but
  reading them is one request per instance per interval (a thousand for a large fleet) and
  their ports admit only their own namespace, while the gateway is one request per domain, is
  reachable, and routed every request of the window. What it counts is the prefix the index
  said the chosen instance held when it routed (a PD request's decode side counts its whole
  prompt, transferred by its prefill); the engines' own count
  (``kvpool_worker_prefix_hit_tokens_total``) is in Prometheus, for the dashboards and alerts.
- the gateway's ``GET /readyz``: per instance whether it is ready and frozen (a full-sync
  freeze: the gateway probes every worker's ``/readyz``, which says so).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpool.operator.api.members import LiveMemberFigures, P2PGroup, PDPair
from kvpool.operator.api.pool import (
    KVCachePool,
    LivePoolFigures,
    RefusedRegistration,
    TierFigures,
)
from kvpool.operator.derive.instances import instances, member_instances
from kvpool.operator.derive.platform import pd_bypass_ratio
from kvpool.operator.derive.sizing import chunk_bytes_per_rank
from kvpool.operator.render.fingerprint import pool_fingerprint
from kvpool.protocol.domain import instance_id, split_instance_id

Obj = dict[str, Any]
Member = P2PGroup | PDPair

#: The gateway's counters read for the hit ratio (gateway/src/kvpool/gateway/metrics.py).
GATEWAY_HIT_TOKENS = "kvpool_gateway_predicted_hit_tokens_total"
GATEWAY_PROMPT_TOKENS = "kvpool_gateway_prompt_tokens_total"
#: Samples a hit window keeps at most (an interval far below the window would grow it).
WINDOW_SAMPLES = 1024


class ReadError(ValueError):
    """An answer that does not have the shape the figures are read from; says what is wrong."""


# ---------------------------------------------------------------- reading the answers


@dataclass(frozen=True)
class ControllerReading:
    """The controller's ``/v1/stats``."""

    workers: dict[str, int]  # registered instance id -> registered workers (TP ranks)
    chunks: int
    chunk_locations: dict[str, int]
    refusals: int
    refused: dict[str, str]  # instance id -> reason


def _int_map(value: Any, what: str) -> dict[str, int]:
    if not isinstance(value, Mapping):
        raise ReadError(f"{what} is not an object")
    try:
        return {str(k): int(v) for k, v in value.items()}
    except (TypeError, ValueError):
        raise ReadError(f"{what} has a value that is not a number") from None


def read_controller(body: Any) -> ControllerReading:
    """The figures of a ``/v1/stats`` reply (ReadError when it is not one)."""
    if not isinstance(body, Mapping):
        raise ReadError("the answer is not a JSON object")
    chunks = body.get("chunks")
    if isinstance(chunks, bool) or not isinstance(chunks, int):
        raise ReadError("chunks is not a number")
    refused = body.get("refused") or {}
    if not isinstance(refused, Mapping):
        raise ReadError("refused is not an object")
    return ControllerReading(
        workers=_int_map(body.get("instances"), "instances"),
        chunks=chunks,
        chunk_locations=_int_map(body.get("chunk_locations"), "chunk_locations"),
        refusals=sum(_int_map(body.get("refusals") or {}, "refusals").values()),
        refused={str(k): str(v) for k, v in refused.items()},
    )


def read_gateway_counters(text: str) -> tuple[float, float]:
    """(predicted hit tokens, prompt tokens) of a gateway's Prometheus text, each summed over
    its instances. Only those two families' lines are looked at: a large fleet's exposition
    is megabytes of per-instance histograms."""
    sums = {GATEWAY_HIT_TOKENS: 0.0, GATEWAY_PROMPT_TOKENS: 0.0}
    seen = False
    for line in text.splitlines():
        if not line.startswith("kvpool_gateway_"):
            continue
        name, brace, rest = line.partition("{")
        if brace:
            rest = rest.rpartition("}")[2]
        else:
            name, _, rest = line.partition(" ")
        if name not in sums:
            continue
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            raise ReadError(f"a {name} sample has no number: {line[:120]!r}") from None
        if math.isfinite(value):
            sums[name] += value
            seen = True
    if not seen and f"# TYPE {GATEWAY_PROMPT_TOKENS[: -len('_total')]}" not in text:
        raise ReadError(f"the exposition has no {GATEWAY_PROMPT_TOKENS}: not a kvpool gateway")
    return sums[GATEWAY_HIT_TOKENS], sums[GATEWAY_PROMPT_TOKENS]


def read_gateway_frozen(body: Any) -> frozenset[str]:
    """Instances a gateway's ``/readyz`` reports ready and frozen."""
    if not isinstance(body, Mapping) or not isinstance(body.get("instances"), Mapping):
        raise ReadError("the answer has no 'instances' object")
    return frozenset(
        str(name)
        for name, state in body["instances"].items()
        if isinstance(state, Mapping) and state.get("ready") and state.get("frozen")
    )


@dataclass(frozen=True)
class GatewayReading:
    hit_tokens: float
    prompt_tokens: float
    frozen: frozenset[str]


# ---------------------------------------------------------------- the hit window


@dataclass(frozen=True)
class Window:
    """The increase of the gateway's counters between two readings ``seconds`` apart."""

    hit_tokens: float
    prompt_tokens: float
    seconds: float


@dataclass
class HitWindow:
    """The gateway's counters over the last ``seconds``: readings are added as they come, the
    oldest kept is the newest one at least ``seconds`` old (so a full window spans at least
    ``seconds``; before that, the time since the first reading). A counter that went down (the
    gateway restarted, or the Service reached another replica) starts the window again."""

    seconds: float
    samples: deque[tuple[float, float, float]] = field(
        default_factory=lambda: deque(maxlen=WINDOW_SAMPLES)
    )

    def add(self, at: float, hit_tokens: float, prompt_tokens: float) -> None:
        if self.samples:
            _, hit, prompt = self.samples[-1]
            if hit_tokens < hit or prompt_tokens < prompt:
                self.samples.clear()
        self.samples.append((at, hit_tokens, prompt_tokens))
        while len(self.samples) >= 2 and self.samples[1][0] <= at - self.seconds:
            self.samples.popleft()

    def current(self) -> Window | None:
        """The window's increase, or None before two readings."""
        if len(self.samples) < 2:
            return None
        (t0, hit0, prompt0), (t1, hit1, prompt1) = self.samples[0], self.samples[-1]
        return Window(hit1 - hit0, prompt1 - prompt0, t1 - t0)


# ---------------------------------------------------------------- one reading of a domain


@dataclass(frozen=True)
class Reading:
    """What one poll of a domain got: each side's figures, or why it has none."""

    controller: ControllerReading | None = None
    controller_error: str | None = None
    gateway: GatewayReading | None = None
    gateway_error: str | None = None
    window: Window | None = None


@dataclass(frozen=True)
class Health:
    """Condition FiguresCurrent: whether the last poll read both sides."""

    ok: bool
    reason: str
    message: str


def health(reading: Reading, last_read: Mapping[str, str] | None = None) -> Health:
    """FiguresCurrent from a reading; ``last_read``: side -> when it last answered."""
    last = last_read or {}
    failed = [
        (side, error)
        for side, error in (
            ("controller", reading.controller_error),
            ("gateway", reading.gateway_error),
        )
        if error is not None
    ]
    if not failed:
        return Health(True, "Read", "the controller and the gateway answered")
    sides = [side for side, _ in failed]
    reason = f"{sides[0].capitalize()}Unavailable" if len(sides) == 1 else "Unavailable"
    parts = [
        f"the {side} could not be read ({error}; "
        + (f"last answered {last[side]})" if side in last else "never answered)")
        for side, error in failed
    ]
    return Health(False, reason, "; ".join(parts) + ": its figures are left out of status.live")


# ---------------------------------------------------------------- figures as status


@dataclass(frozen=True)
class _Expected:
    """The instances registering with the controller, with their TP sizes: P2PGroup instances
    and, with the gateway's PD bypass on, the decoders that keep (``platform.pd_bypass_ratio``;
    other PD instances do not register)."""

    tp: dict[str, int]  # instance name -> TP size
    ids: dict[str, str]  # lmcache instance id -> instance name

    @classmethod
    def of(cls, pool: KVCachePool, members: list[Member]) -> _Expected:
        fp = pool_fingerprint(pool)
        tp = {
            inst.name: inst.tp
            for m in members
            for inst in instances(m)
            if isinstance(m, P2PGroup) or (inst.role == "decode" and pd_bypass_ratio(pool, m) > 0)
        }
        return cls(tp, {instance_id(name, fp): name for name in tp})

    def registered(self, reading: ControllerReading) -> set[str]:
        """Instance names with every TP rank registered."""
        return {
            name for iid, name in self.ids.items() if reading.workers.get(iid, 0) >= self.tp[name]
        }


def hit_ratio(window: Window | None) -> float | None:
    """Hit tokens over prompt tokens of the window; None with nothing routed in it."""
    if window is None or window.prompt_tokens <= 0:
        return None
    return min(1.0, max(0.0, window.hit_tokens / window.prompt_tokens))


def hit_text(reading: Reading) -> str:
    """Column HIT (see LivePoolFigures.hit)."""
    ratio = hit_ratio(reading.window)
    if reading.gateway is None:
        return "?"
    if reading.window is None:
        return "-"
    return "idle" if ratio is None else f"{100.0 * ratio:.1f}%"


def pool_figures(pool: KVCachePool, members: list[Member], reading: Reading) -> LivePoolFigures:
    """``status.live`` of the pool: the domain's figures from what was read (a side that could
    not be read leaves its figures out; the column shows ``?``)."""
    expected = _Expected.of(pool, members)
    out = LivePoolFigures(
        instances=f"?/{len(expected.tp)}",
        hit=hit_text(reading),
        instances_expected=len(expected.tp),
        workers_expected=sum(expected.tp.values()),
    )
    ctl = reading.controller
    if ctl is not None:
        registered = expected.registered(ctl)
        out.instances = f"{len(registered)}/{len(expected.tp)}"
        out.instances_registered = len(registered)
        out.workers_registered = sum(n for iid, n in ctl.workers.items() if iid in expected.ids)
        out.unexpected_instances = sorted(set(ctl.workers) - set(expected.ids))
        out.chunks = ctl.chunks
        tps = set(expected.tp.values())
        per_location = chunk_bytes_per_rank(pool, tps.pop()) if len(tps) == 1 else None
        out.tiers = {
            location: TierFigures(
                chunk_locations=count,
                bytes=None if per_location is None else count * per_location,
            )
            for location, count in sorted(ctl.chunk_locations.items())
        }
        out.refused_registrations = ctl.refusals
        out.refused = [
            RefusedRegistration(instance_id=iid, reason=reason)
            for iid, reason in ctl.refused.items()
        ]
    gw = reading.gateway
    if gw is not None:
        names = {i.name for m in members for i in member_instances(m)}
        out.instances_frozen = len(gw.frozen & names)
        window = reading.window
        if window is not None:
            out.hit_tokens = round(window.hit_tokens)
            out.prompt_tokens = round(window.prompt_tokens)
            out.window_seconds = round(window.seconds, 1)
            ratio = hit_ratio(window)
            out.hit_ratio = None if ratio is None else round(ratio, 4)
    return out


def member_figures(pool: KVCachePool, member: Member, reading: Reading) -> LiveMemberFigures:
    """``status.live`` of a member: its instances registered, frozen and refused (an instance
    is refused when it is not registered and the controller refused an id of its name: a
    worker of another domain fingerprint, e.g. a pod left on an old seed)."""
    names = [i.name for i in member_instances(member)]
    out = LiveMemberFigures()
    ctl = reading.controller
    if ctl is not None:
        expected = _Expected.of(pool, [member])
        registered = expected.registered(ctl)
        refused_names = {split_instance_id(iid)[0] for iid in ctl.refused}
        refused = [n for n in names if n in refused_names and n not in registered]
        if isinstance(member, P2PGroup):
            out.instances_registered = len(registered)
        out.instances_refused = len(refused)
        out.refused = refused
    if reading.gateway is not None:
        frozen = [n for n in names if n in reading.gateway.frozen]
        out.instances_frozen = len(frozen)
        out.frozen = frozen
    return out


def dump(figures: LivePoolFigures | LiveMemberFigures) -> Obj:
    """The figures as they are written into status (camelCase, nothing unset)."""
    return figures.model_dump(by_alias=True, exclude_none=True, mode="json")


def merge_replace(old: Any, new: Obj) -> Obj:
    """A JSON merge patch turning ``old`` into ``new``: keys ``old`` has and ``new`` has not
    are named null (a merge patch keeps what it does not name)."""
    base = old if isinstance(old, Mapping) else {}
    out: Obj = {k: None for k in base if k not in new}
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(base.get(key), Mapping):
            out[key] = merge_replace(base[key], value)
        else:
            out[key] = value
    return out
