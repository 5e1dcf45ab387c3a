"""The fleet simulator's event loop: trace arrivals, the gateway's routing, engine steps, index
updates, all in virtual time.

Why this module exists: see the package docstring. What runs here is the product's code: each
arrival is routed by a real :class:`~kvpool.gateway.selection.Selector` (the gateway's
candidates, pending prefixes, load tracker, imbalance guards and registered policy, with the
gateway's metrics) over hits from a real :class:`~kvpool.protocol.index.ChunkIndex`; each
instance is a :class:`~kvpool.protocol.simcore.instance.SimInstance`. What is modelled: the
index sees an engine's admits and evicts ``index_lag_s`` after they happen (LMCache batches them
every 10 ms, the controller publishes deltas, the gateway applies them), and the gateway sees a
first token and an end exactly when the engine produces them. The ``oracle`` routes by the
engines' actual caches (no lag, no load): what perfect cache knowledge alone would reach.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.gateway.config import Guards as GuardsConfig
from kvpool.gateway.config import parse_config
from kvpool.gateway.fleetsim.keys import chunk_keys
from kvpool.gateway.fleetsim.stats import RequestResult
from kvpool.gateway.hitgroups import GroupedHits
from kvpool.gateway.instances import InstanceSet
from kvpool.gateway.load import LoadTracker, Ticket
from kvpool.gateway.metrics import GatewayMetrics
from kvpool.gateway.pending import PendingPrefixes
from kvpool.gateway.routing import Decision, Guards, PolicySettings, Router, make_policy
from kvpool.gateway.selection import Prompt, Selector
from kvpool.gateway.traces.mooncake import MOONCAKE_BLOCK_TOKENS, TraceRequest
from kvpool.protocol.index import ChunkIndex
from kvpool.protocol.simcore.instance import (
    CPU_BACKEND,
    DISK_BACKEND,
    InstanceConfig,
    SimInstance,
    SimRequest,
    SubmitError,
)
from kvpool.protocol.simcore.kvcache import KvEvent
from kvpool.protocol.simcore.profile import GIB, PerfProfile

__all__ = ["ORACLE", "FleetConfig", "FleetRun", "FleetSim", "Observer"]

#: The routing policy name of the oracle (not a gateway policy: it reads the engines' caches).
ORACLE = "oracle"
_LMCACHE_LOCATIONS = (CPU_BACKEND, DISK_BACKEND)


@dataclass(frozen=True)
class FleetConfig:
    """A fleet and its gateway: what ``make bench-fleet`` renders, as numbers."""

    instances: int
    profile: PerfProfile
    ddr_bytes: int  # LMCache local CPU tier per instance
    disk_bytes: int = 0
    chunk_size: int = 256
    block_size: int = 16
    kv_bytes_per_token: int | None = None  # default: the profile's model
    device_kv_gib: float | None = None  # default: the profile's
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int = 131072
    policy: str = "kv-aware"
    prefix_weight: float = 1.0
    load_weight: float = 1.0
    imbalance_abs: int = 8
    imbalance_ratio: float = 1.5
    pending_ttl_s: float = GuardsConfig().pending_ttl_seconds  # wall = model seconds here
    index_lag_s: float = 0.05
    p2p: bool = False
    trace_block_tokens: int = MOONCAKE_BLOCK_TOKENS
    save_unfull_chunk: bool = False
    touch_on_hit: bool = True
    name_prefix: str = "sim-"

    def kv_bytes(self) -> int:
        return self.kv_bytes_per_token or self.profile.model.kv_bytes_per_token()

    def instance_config(self) -> InstanceConfig:
        p = self.profile
        chunk_bytes = self.chunk_size * self.kv_bytes()
        device_gib = self.device_kv_gib if self.device_kv_gib is not None else p.device_kv_gib
        return InstanceConfig(
            profile=p,
            chunk_size=self.chunk_size,
            block_size=self.block_size,
            kv_bytes_per_token=self.kv_bytes(),
            device_blocks=int(device_gib * GIB // (self.kv_bytes() * self.block_size)),
            ddr_chunks=self.ddr_bytes // chunk_bytes,
            disk_chunks=self.disk_bytes // chunk_bytes,
            max_num_seqs=self.max_num_seqs or p.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens or p.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            touch_on_hit=self.touch_on_hit,
        )

    def names(self) -> list[str]:
        width = len(str(max(self.instances - 1, 0)))
        return [f"{self.name_prefix}{i:0{width}d}" for i in range(self.instances)]


@dataclass
class FleetRun:
    """A finished simulation: one result per request, the engines' counters, timing."""

    results: list[RequestResult]
    engines: dict[str, dict[str, float]]
    wall_s: float
    events: int
    route_s: list[float] = field(default_factory=list)  # wall seconds of each routing decision


class Observer:
    """Watches a run as it happens (decisions, tokens, index updates); every method is
    optional to override. Used to check the simulator against a real gateway's state."""

    def routed(self, now: float, request: TraceRequest, prompt: Prompt, decision: Decision) -> None:
        """A request was routed (before it is counted against the instance)."""

    def first_token(self, now: float, request: TraceRequest) -> None:
        """The request's first token (the gateway's first byte)."""

    def finished(self, now: float, request: TraceRequest) -> None:
        """The request ended."""

    def indexed(self, now: float, instance: str, events: Sequence[KvEvent]) -> None:
        """LMCache admit/evict events of ``instance`` reached the index."""


@dataclass
class _Flight:
    trace: TraceRequest
    sim: SimRequest
    instance: str
    reason: str
    ticket: Ticket | None


class FleetSim:
    """Simulates one :class:`FleetConfig` over a list of trace requests (arrival order)."""

    def __init__(
        self,
        config: FleetConfig,
        *,
        time_scale: float = 1.0,
        keys_of: Callable[[TraceRequest], tuple[int, ...]] | None = None,
        observer: Observer | None = None,
    ) -> None:
        if config.instances < 1:
            raise ValueError("a fleet needs at least one instance")
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.config = config
        self.time_scale = time_scale
        self.keys_of = keys_of or self._chunk_keys
        self.observer = observer or Observer()
        self.now = 0.0
        names = config.names()
        engine = config.instance_config()
        self.engines = {n: SimInstance(n, engine) for n in names}
        self.index = ChunkIndex()
        gateway = parse_config(
            {
                "model": config.profile.model.name,
                "chunkSize": config.chunk_size,
                "controllerUrl": "http://127.0.0.1:9",
                "p2pGroups": [
                    {
                        "name": "fleet",
                        "p2p": config.p2p,
                        "instances": [{"name": n, "url": f"http://{n}.sim"} for n in names],
                    }
                ],
            }
        )
        self.instances = InstanceSet.from_config(gateway)
        for inst in self.instances:
            inst.ready = True
        self.oracle = config.policy == ORACLE
        guards = Guards(config.imbalance_abs, config.imbalance_ratio)
        policy = "least-load" if self.oracle else config.policy
        settings = PolicySettings(config.prefix_weight, config.load_weight, guards)
        self.selector = Selector(
            self.instances,
            None,
            Router(make_policy(policy, settings), guards),
            LoadTracker(),
            PendingPrefixes(config.pending_ttl_s),
            GatewayMetrics(),
            config.chunk_size,
            clock=lambda: self.now,
        )
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()
        self._version = dict.fromkeys(names, 0)
        self._flights: dict[str, _Flight] = {}
        self._results: list[RequestResult] = []
        self._route_s: list[float] = []

    # ------------------------------------------------------------------ events
    _ARRIVE, _STEP, _INDEX = 0, 1, 2

    def _push(self, at: float, kind: int, payload: Any) -> None:
        heapq.heappush(self._heap, (at, kind, next(self._seq), payload))

    def _schedule_step(self, name: str) -> None:
        t = self.engines[name].next_time
        if t is not None:
            self._version[name] += 1
            self._push(t, self._STEP, (name, self._version[name]))

    def run(
        self,
        requests: Sequence[TraceRequest],
        progress: Callable[[int, int, float], None] | None = None,
    ) -> FleetRun:
        """Replay ``requests`` (their arrival times divided by ``time_scale``, the first at 0)."""
        started = time.perf_counter()
        first = min((r.arrival_s for r in requests), default=0.0)
        for r in requests:
            self._push((r.arrival_s - first) / self.time_scale, self._ARRIVE, r)
        events = 0
        total = len(requests)
        while self._heap:
            at, kind, _, payload = heapq.heappop(self._heap)
            self.now = at
            events += 1
            if kind == self._ARRIVE:
                self._arrive(payload)
            elif kind == self._STEP:
                name, version = payload
                if version == self._version[name]:
                    self._step(name)
            else:
                self._apply(*payload)
            if progress is not None and events % 20000 == 0:
                progress(len(self._results), total, self.now)
        engines = {n: e.stats() for n, e in self.engines.items()}
        return FleetRun(
            sorted(self._results, key=lambda r: r.index),
            engines,
            time.perf_counter() - started,
            events,
            self._route_s,
        )

    # ------------------------------------------------------------------ arrivals
    def _chunk_keys(self, r: TraceRequest) -> tuple[int, ...]:
        cfg = self.config
        return chunk_keys(
            r.hash_ids,
            r.input_length,
            chunk_size=cfg.chunk_size,
            block_tokens=cfg.trace_block_tokens,
            save_unfull_chunk=cfg.save_unfull_chunk,
        )

    def _arrive(self, r: TraceRequest) -> None:
        cfg = self.config
        keys = self.keys_of(r)
        full = keys[: r.input_length // cfg.chunk_size]  # the gateway hashes full chunks only
        prompt = Prompt(r.input_length, full, r.session)
        t0 = time.perf_counter()
        if self.oracle:
            name, held = self._oracle(keys)
            decision = Decision(name, ORACLE, min(held * cfg.chunk_size, r.input_length))
        else:
            version, ids = self.index.instance_names()
            hits = GroupedHits(self.index.prefix_groups(full), ids, version)
            _, decision = self.selector.decide(
                self.instances.peers(), prompt, hits, set(), record=False
            )
        name, reason = decision.instance, decision.reason
        self.observer.routed(self.now, r, prompt, decision)
        attempt = self.selector.admit(self.instances.by_name[name], prompt, decision)
        self._route_s.append(time.perf_counter() - t0)
        engine = self.engines[name]
        peer_end = self._peer_end(name, keys) if cfg.p2p else 0
        sim = SimRequest(
            str(r.index), keys, r.input_length, max(1, r.output_length), self.now, peer_end
        )
        flight = _Flight(r, sim, name, reason, attempt.ticket)
        before = engine.next_time
        try:
            engine.submit(sim, self.now)
        except SubmitError:  # longer than one instance's model or device: as an engine's 400
            self.selector.load.finish(attempt.ticket)
            self.observer.finished(self.now, r)
            self._finish(flight, error="refused_too_long")
            return
        self._flights[sim.rid] = flight
        if engine.next_time != before:
            self._schedule_step(name)

    def _oracle(self, keys: tuple[int, ...]) -> tuple[str, int]:
        """The instance holding the longest prefix in any tier, right now (ties: fewest in
        flight, then name), and how many chunks it holds."""
        best: tuple[int, int, str] | None = None
        for name, engine in self.engines.items():
            held = sum(engine.lookup(keys).values())
            key = (-held, len(engine.running) + len(engine.waiting), name)
            if best is None or key < best:
                best = key
        assert best is not None
        return best[2], -best[0]

    def _peer_end(self, name: str, keys: tuple[int, ...]) -> int:
        """What the controller's P2P lookup answers at arrival: the local DDR run, then the
        longest run another instance holds from there (same TP rank)."""
        local = self.engines[name].lookup(keys)
        start = local["device"] + local["ddr"]
        found = self.index.p2p_lookup(keys[start:], name, 0)
        return start + (found[0][2] if found else 0)

    # ------------------------------------------------------------------ steps
    def _step(self, name: str) -> None:
        engine = self.engines[name]
        out = engine.complete_step(fast=True)
        for r in out.first_tokens:
            flight = self._flights[r.rid]
            if flight.ticket is not None:
                self.selector.load.first_byte(flight.ticket, out.time)
            self.observer.first_token(out.time, flight.trace)
        for r in out.finished:
            flight = self._flights.pop(r.rid)
            if flight.ticket is not None:
                self.selector.load.finish(flight.ticket)
            self.observer.finished(out.time, flight.trace)
            self._finish(flight)
        lmcache = [e for e in out.events if e.location in _LMCACHE_LOCATIONS]
        if lmcache:
            self._push(out.time + self.config.index_lag_s, self._INDEX, (name, lmcache))
        self._schedule_step(name)

    def _apply(self, name: str, events: list[KvEvent]) -> None:
        """LMCache's admit/evict events reach the index (as the controller applies them)."""
        self.observer.indexed(self.now, name, events)
        for e in events:
            if e.op == "admit":
                self.index.admit(name, 0, e.location, (e.key,))
            else:
                self.index.evict(name, 0, e.location, (e.key,))

    def _finish(self, flight: _Flight, error: str | None = None) -> None:
        sim, tr = flight.sim, flight.trace
        ttft = None if sim.first_token_at is None else sim.first_token_at - sim.arrival
        e2e = None if sim.finished_at is None else sim.finished_at - sim.arrival
        self._results.append(
            RequestResult(
                index=tr.index,
                instance=flight.instance,
                arrival_s=sim.arrival,
                prompt_tokens=tr.input_length,
                output_tokens=sim.generated,
                cached_tokens=sim.cached_tokens,
                ttft_s=ttft,
                e2e_s=e2e,
                reason=flight.reason,
                error=error,
            )
        )
