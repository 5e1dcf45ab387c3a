"""The fleet benchmark's sizes: DDR per instance, the fleet's capacity, the replay's pace.

Why this module exists: issue 14 fixes the comparison's conditions in words ("per-instance DDR
sized so that the fleet's total cache holds about half of the window's distinct blocks; offered
load about 75 % of the fleet's capacity"); this module turns them into numbers for any trace
window, the same way every run, with the fleet simulator (the same engine model the sim workers
run), and says how:

- *distinct chunks*: the LMCache chunks the window's prompts touch (their chunk keys, counted
  once); the fleet's LMCache DDR in total holds half of them (``cache_fraction``), split evenly;
- *device KV*: enough for the window's longest request (prompt + output) and at least
  ``device_kv_gib`` (vLLM refuses to start when max_model_len does not fit);
- *capacity*: the requests per second the fleet completes when the whole window arrives at once
  (least-load routing, simulated): its saturated throughput;
- *pace*: the window's requests arrive at ``load`` x capacity (the trace's own inter-arrival
  pattern, compressed by ``time_scale``); the sim workers run at ``speedup`` model seconds per
  wall second, so the replay's wall-clock compression is ``time_scale x speedup`` and every
  measured time is converted back to model time (``x speedup``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.gateway.config import Guards
from kvpool.gateway.fleetsim.fleet import FleetConfig, FleetSim
from kvpool.gateway.fleetsim.keys import chunk_keys
from kvpool.gateway.fleetsim.stats import summarize
from kvpool.gateway.traces.mooncake import MOONCAKE_BLOCK_TOKENS, TraceRequest
from kvpool.protocol.simcore.profile import GIB, PerfProfile

PENDING_TTL_WALL_S = Guards().pending_ttl_seconds  # gateway.yaml's default
INDEX_LAG_WALL_S = 0.02


@dataclass(frozen=True)
class FleetPlan:
    """Everything the arms of one benchmark run share."""

    instances: int
    profile: str
    chunk_size: int
    block_size: int
    kv_bytes_per_token: int
    device_kv_gib: float
    ddr_gib: float
    max_model_len: int
    requests: int
    distinct_chunks: int
    cache_fraction: float  # fleet DDR / distinct chunks of the window
    native_req_per_s: float  # the window's own arrival rate
    capacity_req_per_s: float  # model time
    load: float
    time_scale: float  # model-time compression of the trace
    speedup: float  # model seconds per wall second of the sim workers

    @property
    def wall_time_scale(self) -> float:
        """What the replay's ``--time-scale`` is (trace seconds per wall second)."""
        return self.time_scale * self.speedup

    def fleet_config(self, profile: PerfProfile, policy: str = "kv-aware") -> FleetConfig:
        """The simulator's fleet for this plan. The gateway's clocks run in wall time (its
        pending-prefix TTL, 120 s; the index's lag behind an admit, about 20 ms: LMCache's
        10 ms batching, the controller's publish, the replica's apply), so in model time they
        are those times x ``speedup``."""
        return FleetConfig(
            instances=self.instances,
            profile=profile,
            ddr_bytes=int(self.ddr_gib * GIB),
            chunk_size=self.chunk_size,
            block_size=self.block_size,
            kv_bytes_per_token=self.kv_bytes_per_token,
            device_kv_gib=self.device_kv_gib,
            max_model_len=self.max_model_len,
            policy=policy,
            pending_ttl_s=PENDING_TTL_WALL_S * self.speedup,
            index_lag_s=INDEX_LAG_WALL_S * self.speedup,
        )


def distinct_chunks(requests: Sequence[TraceRequest], chunk_size: int, block: int) -> int:
    seen: set[int] = set()
    for r in requests:
        seen.update(chunk_keys(r.hash_ids, r.input_length, chunk_size=chunk_size,
                               block_tokens=block))  # fmt: skip
    return len(seen)


def plan_fleet(
    requests: Sequence[TraceRequest],
    profile: PerfProfile,
    *,
    profile_name: str,
    instances: int = 16,
    chunk_size: int = 256,
    block_size: int = 16,
    device_kv_gib: float = 20.0,
    cache_fraction: float = 0.5,
    load: float = 0.75,
    wall_s: float = 240.0,
    block: int = MOONCAKE_BLOCK_TOKENS,
) -> FleetPlan:
    """Sizes and pace for ``requests`` (see the module docstring); ``wall_s`` is how long the
    window should take to arrive on the wall clock (it sets ``speedup``)."""
    kv_bytes = profile.model.kv_bytes_per_token()
    chunk_bytes = chunk_size * kv_bytes
    distinct = distinct_chunks(requests, chunk_size, block)
    ddr_chunks = math.ceil(cache_fraction * distinct / instances)
    ddr_gib = ddr_chunks * chunk_bytes / GIB
    longest = max(r.input_length + r.output_length for r in requests)
    max_model_len = max(4096, -(-longest // 4096) * 4096)
    device = max(device_kv_gib, max_model_len * kv_bytes * 1.05 / GIB)
    span = max(r.arrival_s for r in requests) - min(r.arrival_s for r in requests)
    native = len(requests) / span if span > 0 else float(len(requests))
    base = FleetConfig(
        instances=instances,
        profile=profile,
        ddr_bytes=int(ddr_gib * GIB),
        chunk_size=chunk_size,
        block_size=block_size,
        device_kv_gib=device,
        max_model_len=max_model_len,
        policy="least-load",
    )
    saturated = FleetSim(base, time_scale=1e6).run(requests)
    capacity = summarize(saturated.results)["throughput_req_per_s"]
    time_scale = load * capacity / native
    model_span = span / time_scale
    speedup = model_span / wall_s
    return FleetPlan(
        instances=instances,
        profile=profile_name,
        chunk_size=chunk_size,
        block_size=block_size,
        kv_bytes_per_token=kv_bytes,
        device_kv_gib=round(device, 3),
        ddr_gib=round(ddr_gib, 3),
        max_model_len=max_model_len,
        requests=len(requests),
        distinct_chunks=distinct,
        cache_fraction=instances * ddr_chunks / distinct,
        native_req_per_s=native,
        capacity_req_per_s=capacity,
        load=load,
        time_scale=time_scale,
        speedup=speedup,
    )


def with_policy(plan: FleetPlan, profile: PerfProfile, policy: str) -> FleetConfig:
    return dataclasses.replace(plan.fleet_config(profile), policy=policy)
