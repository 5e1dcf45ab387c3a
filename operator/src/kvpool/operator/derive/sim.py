"""The simulated engine's side of the render: its flags, its effective limits, its KV shape.

Why: a sim member runs ``kvpool-worker serve --engine sim``, which times a bundled performance
profile and sizes its simulated tiers from the pool's model shape. Render (the command line),
validation (what the worker would refuse: a device too small for one request, TP > 1) and the
defaults kvpool reports (the profile's limits) must read the same numbers the worker computes,
so they are derived once here, with kvpool.protocol's own profile and KV arithmetic.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.operator.api.members import EngineSpec, P2PGroup, PDPair, SimEngineSpec
from kvpool.operator.api.pool import KVCachePool
from kvpool.protocol.simcore.profile import ModelShape, PerfProfile, bundled_profile

GIB = 1024**3


@functools.cache
def profile(name: str) -> PerfProfile:
    """A bundled profile (the API admits only bundled names)."""
    return bundled_profile(name)


@dataclass(frozen=True)
class SimLimits:
    """What a sim instance runs with: the spec's value, else the profile's."""

    device_kv_gib: float
    max_num_seqs: int
    max_num_batched_tokens: int


def limits(sim: SimEngineSpec) -> SimLimits:
    """The device KV memory, batch and token budget the worker will use."""
    p = profile(sim.profile)
    return SimLimits(
        device_kv_gib=sim.device_kv_gib if sim.device_kv_gib is not None else p.device_kv_gib,
        max_num_seqs=sim.max_num_seqs or p.max_num_seqs,
        max_num_batched_tokens=sim.max_num_batched_tokens or p.max_num_batched_tokens,
    )


def kv_bytes_per_token(pool: KVCachePool) -> int:
    """K and V of every layer and KV head: the worker's own arithmetic (kvpool.protocol)."""
    model = pool.spec.model
    shape = ModelShape(
        model.name, model.num_layers, model.num_kv_heads, model.head_dim, model.kv_dtype
    )
    return shape.kv_bytes_per_token()


def device_blocks(pool: KVCachePool, sim: SimEngineSpec) -> int:
    """Blocks of ``blockSize`` tokens the simulated device holds (as the worker computes it)."""
    per_block = kv_bytes_per_token(pool) * pool.spec.block_size
    return int(limits(sim).device_kv_gib * GIB // per_block)


def blocks_for(pool: KVCachePool, tokens: int) -> int:
    """Blocks one request of ``tokens`` tokens needs."""
    return -(-tokens // pool.spec.block_size)


def sim_flags(pool: KVCachePool, sim: SimEngineSpec) -> list[str]:
    """The ``--engine sim`` flags: profile, speed, the pool's model shape, and the limits the
    spec sets (the ones it leaves unset are the profile's, resolved by the worker)."""
    model = pool.spec.model
    flags = [
        "--sim-profile",
        sim.profile,
        "--sim-speedup",
        str(sim.speedup),
        "--num-layers",
        str(model.num_layers),
        "--num-kv-heads",
        str(model.num_kv_heads),
        "--head-dim",
        str(model.head_dim),
    ]
    optional = (
        ("--sim-device-kv-gib", sim.device_kv_gib),
        ("--max-num-seqs", sim.max_num_seqs),
        ("--max-num-batched-tokens", sim.max_num_batched_tokens),
    )
    for flag, value in optional:
        if value is not None:
            flags += [flag, str(value)]
    return flags


def is_sim(engine: EngineSpec) -> bool:
    """Whether the engine is kvpool's simulated engine."""
    return engine.sim is not None


def sim_members(members: Sequence[P2PGroup | PDPair]) -> list[P2PGroup | PDPair]:
    """The members with a simulated engine (any side)."""
    out: list[P2PGroup | PDPair] = []
    for member in members:
        if isinstance(member, P2PGroup):
            sims = [member.spec.engine]
        else:
            sims = [member.spec.prefill.engine, member.spec.decode.engine]
        if any(is_sim(e) for e in sims):
            out.append(member)
    return out
