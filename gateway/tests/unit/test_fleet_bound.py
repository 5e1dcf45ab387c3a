"""The pooled-cache bound of the fleet benchmark (kvpool.gateway.fleetsim.bound).

Unbounded it equals the window's ideal hit ratio (trace_stats; synthetic conversations, so the
test needs no trace checked out beside the repository); it never rises as the pooled capacity
shrinks; LRU order is honoured; and on a trace whose prompts share a first block the
simulator's literal oracle router (longest prefix, ignores load) hits less than the bound,
which is why the bound, not that router, is what ``hit_over_oracle`` divides by.
"""

from __future__ import annotations

import dataclasses
import random

from kvpool.gateway.fleetsim.bound import pooled_capacity_chunks, pooled_hit_ratio
from kvpool.gateway.fleetsim.fleet import ORACLE, FleetConfig, FleetSim
from kvpool.gateway.fleetsim.stats import summarize
from kvpool.gateway.traces.mooncake import TraceRequest, trace_stats
from kvpool.protocol.simcore.profile import bundled_profile

PROFILE = bundled_profile("h100-llama-3.1-8b-vllm")
CHUNK_BYTES = 256 * PROFILE.model.kv_bytes_per_token()


def fleet(instances: int, ddr_chunks: int) -> FleetConfig:
    return FleetConfig(instances=instances, profile=PROFILE, ddr_bytes=ddr_chunks * CHUNK_BYTES,
                       device_kv_gib=1.0)  # fmt: skip


def req(i: int, ids: tuple[int, ...], t: float | None = None) -> TraceRequest:
    return TraceRequest(index=i, line=i + 1, arrival_s=float(i) if t is None else t,
                        input_length=512 * len(ids), output_length=4, hash_ids=ids)  # fmt: skip


def test_capacity_counts_device_ddr_and_disk_of_every_instance() -> None:
    cfg = fleet(4, 10)
    inst = cfg.instance_config()
    device = inst.device_blocks * 16 // 256
    assert pooled_capacity_chunks(cfg) == 4 * (device + 10)
    with_disk = dataclasses.replace(cfg, disk_bytes=5 * CHUNK_BYTES)
    assert pooled_capacity_chunks(with_disk) == 4 * (device + 15)


def conversations(count: int = 60, turns: int = 4, seed: int = 0) -> list[TraceRequest]:
    """Conversations taking turns (each turn its history and one new block), all starting
    with one shared block, whole blocks only."""
    rng = random.Random(seed)
    histories = [(0, 1000 + c) for c in range(count)]
    reqs: list[TraceRequest] = []
    for _ in range(turns):
        for c in rng.sample(range(count), count):
            histories[c] = (*histories[c], rng.randrange(10**6, 10**12))  # never a fixed id
            reqs.append(req(len(reqs), histories[c], 0.5 * len(reqs)))
    return reqs


def test_unbounded_equals_the_ideal_and_shrinking_never_helps() -> None:
    window = conversations()
    ideal = trace_stats(window).ideal_hit_ratio
    assert ideal > 0.3
    assert pooled_hit_ratio(window, fleet(16, 100_000)) == ideal  # whole blocks: exactly
    tiny = dataclasses.replace(fleet(1, 0), device_kv_gib=1e-6)
    ratios = [pooled_hit_ratio(window, fleet(n, 40)) for n in (16, 8, 4, 2, 1)]
    ratios.append(pooled_hit_ratio(window, tiny))
    assert ratios == sorted(ratios, reverse=True)
    assert ratios[-1] < 0.5 * ratios[0]


def test_least_recently_used_goes_first() -> None:
    # one instance with no device KV: 8 chunks, two prompts of 2 blocks (4 chunks each)
    cfg = dataclasses.replace(fleet(1, 8), device_kv_gib=1e-6)
    assert pooled_capacity_chunks(cfg) == 8
    a, b, c = (1, 2), (3, 4), (5, 6)
    keep = [req(0, a), req(1, b), req(2, a), req(3, c), req(4, a)]  # a touched, b evicted
    lose = [req(0, a), req(1, b), req(2, c), req(3, a)]  # a least recent when c comes
    assert pooled_hit_ratio(keep, cfg) > pooled_hit_ratio(lose, cfg) == 0.0


def test_the_literal_oracle_router_hits_less_than_the_bound() -> None:
    """Every prompt starts with block 0 and 40 conversations take turns: the literal oracle puts
    everything on one instance, whose cache cannot keep 40 histories; the pooled one can."""
    reqs = conversations(count=40, turns=3)
    cfg = fleet(8, 24)
    bound = pooled_hit_ratio(reqs, cfg)
    oracle = summarize(FleetSim(dataclasses.replace(cfg, policy=ORACLE)).run(reqs).results)
    assert oracle["hit_ratio"] < bound
    assert len(oracle["per_instance"]) <= 2 < cfg.instances
