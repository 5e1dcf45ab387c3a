"""The instances the gateway may send to: where they are, whether they are ready, and
their circuit breakers; plus the loop that probes their readiness.

Why this module exists: the rendered config lists every instance of the pool, but a pod that
is starting, draining or dead must not be routed to. The gateway asks each instance's
``/readyz`` every few seconds (the same probe the kubelet uses) and keeps one circuit
breaker per instance that request failures open; the router only sees instances that are
ready and whose breaker lets a request through.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import httpx

from kvpool.gateway.config import GatewayConfig
from kvpool.gateway.metrics import GatewayMetrics
from kvpool.gateway.reconfig import InstanceFacts, instance_facts
from kvpool.gateway.reliability import BreakerState, CircuitBreaker

logger = logging.getLogger(__name__)

Role = Literal["peer", "prefill", "decode"]


@dataclass(eq=False)
class Instance:
    """One engine instance (its HTTP base URL) and what the gateway knows of its health."""

    name: str
    url: str
    role: Role
    group: str
    pulls: bool = False  # a P2P group member that can pull what its group's members hold
    frozen: bool = False  # its LMCache is in a full-sync freeze (its /readyz says): no stores
    retired: bool = False  # no longer configured: requests in flight finish, no new ones
    last_error: str | None = None
    probe_failures: int = 0
    silent_probes: int = 0  # probes in a row that got no HTTP answer at all (frozen, cut off)
    #: exchanges in flight to it (``h1client`` connections), dropped when it stops answering
    inflight: set[Any] = field(default_factory=set, repr=False)
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    _ready: bool = field(default=False, repr=False)
    on_change: Callable[[Instance], None] | None = field(default=None, repr=False)

    @property
    def ready(self) -> bool:
        return self._ready

    @ready.setter
    def ready(self, value: bool) -> None:
        if value != self._ready:
            self._ready = value
            if self.on_change is not None:
                self.on_change(self)

    @property
    def impaired(self) -> bool:
        """Not ready, or its breaker is not closed: check before each request."""
        return not self._ready or self.breaker.state is not BreakerState.CLOSED

    def available(self, now: float) -> bool:
        return self._ready and self.breaker.available(now)

    @property
    def facts(self) -> InstanceFacts:
        return InstanceFacts(self.name, self.url, self.role, self.group, self.pulls)

    @classmethod
    def of(cls, facts: InstanceFacts) -> Instance:
        """A new instance (not ready until probed) from what the configuration says of it."""
        role = cast(Role, facts.role)
        return cls(facts.name, facts.url, role, facts.group, pulls=facts.pulls)


class InstanceSet:
    """Every configured instance by name; which of them are *impaired* (not ready, or their
    breaker not closed) is kept up to date as it changes, so picking the available ones of a
    thousand-instance pool costs nothing while they are all healthy."""

    def __init__(self, instances: Iterable[Instance], clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.by_name: dict[str, Instance] = {}
        self._impaired: set[Instance] = set()
        #: instances whose last probe said LMCache is frozen (a full sync after a controller
        #: restart): they answer, but store nothing; routing prefers the others meanwhile
        self.frozen: set[Instance] = set()
        self._peers: list[Instance] = []
        #: members removed by :meth:`replace` that a request in flight may still hold in a list
        #: of candidates (kept while anything refers to them)
        self._retired: weakref.WeakSet[Instance] = weakref.WeakSet()
        #: bumped by every :meth:`replace`: caches of the members compare it
        self.generation = 0
        self._adopt(list(instances))

    def _adopt(self, members: list[Instance]) -> None:
        by_name: dict[str, Instance] = {}
        for inst in members:
            if inst.name in by_name:
                raise ValueError(f"instance {inst.name!r} is listed twice in the gateway config")
            by_name[inst.name] = inst
        self.by_name = by_name
        self._peers = [i for i in members if i.role == "peer"]
        self._impaired = set()
        self.frozen = {i for i in self.frozen if i.name in by_name and by_name[i.name] is i}
        for inst in members:
            inst.on_change = self._refresh
            inst.breaker.on_change = lambda inst=inst: self._refresh(inst)
            self._refresh(inst)

    def replace(self, members: Sequence[Instance]) -> list[Instance]:
        """Make ``members`` the set (a live reconfiguration): the objects given stay as they are
        (a kept instance keeps its readiness and breaker); every current member not among them
        is retired — requests that hold it finish, no new request goes to it. Returns the
        retired instances."""
        keep = {id(i) for i in members}
        retired = [i for i in self.by_name.values() if id(i) not in keep]
        for inst in retired:
            inst.retired = True
            inst.on_change = None
            inst.breaker.on_change = None
            self._retired.add(inst)
        self._adopt(list(members))
        self.generation += 1
        return retired

    def _refresh(self, inst: Instance) -> None:
        if inst.impaired:
            self._impaired.add(inst)
        else:
            self._impaired.discard(inst)

    @classmethod
    def from_config(cls, config: GatewayConfig) -> InstanceSet:
        return cls(Instance.of(facts) for facts in instance_facts(config))

    def __iter__(self) -> Iterator[Instance]:
        return iter(self.by_name.values())

    def __len__(self) -> int:
        return len(self.by_name)

    def get(self, name: str) -> Instance | None:
        return self.by_name.get(name)

    def peers(self) -> list[Instance]:
        """The P2P group members (the same list object every time: do not modify it)."""
        return self._peers

    def of_group(self, group: str, role: Role) -> list[Instance]:
        return [i for i in self.by_name.values() if i.group == group and i.role == role]

    def available(self, instances: Iterable[Instance]) -> Sequence[Instance]:
        """Those of ``instances`` a request may go to now (a list ``instances`` itself,
        unchanged, when none of the set is impaired and it holds no retired instance)."""
        if not self._impaired and (instances is self._peers or not self._retired):
            return instances if isinstance(instances, list) else list(instances)
        now = self.clock()
        return [
            i for i in instances if not i.retired and (i not in self._impaired or i.available(now))
        ]

    def any_ready(self) -> bool:
        return any(i.ready for i in self.by_name.values())


async def probe(client: httpx.AsyncClient, inst: Instance, timeout_s: float) -> bool:
    """One readiness probe: 200 from ``/readyz``."""
    try:
        resp = await client.get(f"{inst.url}/readyz", timeout=timeout_s)
    except httpx.HTTPError as exc:
        inst.last_error = f"{type(exc).__name__}: {exc}"
        inst.silent_probes += 1
        return False
    inst.silent_probes = 0
    if resp.status_code != 200:
        inst.last_error = f"/readyz answered {resp.status_code}"
        return False
    inst.last_error = None
    try:
        inst.frozen = bool(resp.json().get("frozen", False))
    except ValueError:  # a /readyz that is not JSON (another engine) says nothing of it
        inst.frozen = False
    return True


async def probe_all(
    client: httpx.AsyncClient,
    instances: InstanceSet,
    metrics: GatewayMetrics,
    timeout_s: float,
    failures_to_unready: int = 1,
) -> None:
    """Probe every instance concurrently; a ready instance turns not ready after
    ``failures_to_unready`` failed probes in a row (its breaker reacts to real failures)."""
    insts = list(instances)
    results = await asyncio.gather(*(probe(client, i, timeout_s) for i in insts))
    for inst, ok in zip(insts, results, strict=True):
        inst.probe_failures = 0 if ok else inst.probe_failures + 1
        if not ok and inst.ready and inst.probe_failures < failures_to_unready:
            continue  # one slow probe on a busy host is not an outage
        if ok != inst.ready:
            logger.info(
                "instance %s is %s%s",
                inst.name,
                "ready" if ok else "not ready",
                f" ({inst.last_error})" if inst.last_error else "",
            )
        inst.ready = ok
        metrics.instance_ready.labels(inst.name).set(1 if ok else 0)
        if inst.silent_probes >= failures_to_unready and inst.inflight:
            drop_inflight(inst)
    instances.frozen = {i for i in insts if i.ready and i.frozen}


def drop_inflight(inst: Instance) -> int:
    """Abort every exchange in flight to ``inst``, which answers no probe (a frozen process,
    a partition): each fails like a dropped connection, so the proxy retries it elsewhere
    before its first byte or reports it in the stream after, instead of holding the client
    for the upstream timeout. Returns how many were dropped."""
    exchanges = list(inst.inflight)
    inst.inflight.clear()
    for exchange in exchanges:
        exchange.abort()
    logger.warning(
        "instance %s answers no probe (%s): dropped %d requests in flight to it",
        inst.name,
        inst.last_error,
        len(exchanges),
    )
    return len(exchanges)


async def health_loop(
    client: httpx.AsyncClient, instances: InstanceSet, metrics: GatewayMetrics, interval_s: float
) -> None:
    """Probe forever, every ``interval_s``, starting one interval from now: the gateway's
    start has just probed every instance (``GatewayState.start``). Probing again at once
    raced anything that read or set readiness right after the start (a second failed probe
    of an instance unready at start is the two in a row that mark it not ready)."""
    while True:
        await asyncio.sleep(interval_s)
        await probe_all(client, instances, metrics, max(1.0, min(interval_s, 5.0)), 2)
