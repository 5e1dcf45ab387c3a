"""KV sizes and the host memory budget of the seed manual (§5.5), as pure arithmetic.

Why: buffers smaller than one chunk fail at runtime, and host memory must be summed per worker
(TP rank), not per instance. Render (the memory each worker pod requests), validation (buffer
checks, the allocatable-memory warning) and status (the budget) all need these same numbers.
"""

from __future__ import annotations

import math

from kvpool.operator.api.common import MemoryBudget
from kvpool.operator.api.members import EngineSpec, P2PGroup, PDPair
from kvpool.operator.api.pool import DTYPE_BYTES, KVCachePool
from kvpool.operator.derive.platform import default_pd_buffer_device, pd_bypass_ratio
from kvpool.operator.quantity import format_bytes, parse_quantity

Parts = list[tuple[str, int]]


def kv_bytes_per_token_per_rank(pool: KVCachePool, tp: int) -> int:
    """All layers, K and V (one latent for MLA), KV heads on this rank, head dim, dtype bytes."""
    model = pool.spec.model
    dtype = DTYPE_BYTES[model.kv_dtype]
    if model.mla:
        return model.num_layers * model.head_dim * dtype
    heads = max(1, math.ceil(model.num_kv_heads / tp))
    return model.num_layers * 2 * heads * model.head_dim * dtype


def chunk_bytes_per_rank(pool: KVCachePool, tp: int) -> int:
    """Bytes of one full chunk on one TP rank."""
    return pool.spec.chunk_size * kv_bytes_per_token_per_rank(pool, tp)


def _mooncake(pool: KVCachePool) -> Parts:
    remote = pool.spec.tiers.remote
    if remote is None or remote.mooncake is None:
        return []
    return [("Mooncake buffer", remote.mooncake.local_buffer_size)]


def role_engine(member: P2PGroup | PDPair, role: str) -> EngineSpec:
    """The engine the instances of ``role`` (p2p, prefill, decode) run."""
    if isinstance(member, P2PGroup):
        return member.spec.engine
    return member.spec.prefill.engine if role == "prefill" else member.spec.decode.engine


def rank_parts(pool: KVCachePool, member: P2PGroup | PDPair, role: str) -> Parts:
    """Host memory one LMCache worker (TP rank) of ``role`` pins, by purpose. A simulated
    engine pins none: its tiers are bounded counters of the rendered sizes."""
    if role_engine(member, role).sim is not None:
        return []
    if isinstance(member, P2PGroup):
        staging = member.spec.transfer.host_staging
        on = staging.enabled and member.spec.p2p  # HostStaging is a P2P transfer buffer
        parts: Parts = [("staging", staging.bytes)] if on else []
        return [*parts, ("CPU cache", pool.spec.tiers.cpu.size), *_mooncake(pool)]
    transfer = member.spec.transfer
    parts = []  # PD instances run without the local CPU tier (but a bypassed-to decoder)
    if role == "prefill" and transfer.mode == "cpu-offload-pull-delay":
        parts.append(("PD CPU buffer", transfer.cpu_buffer_size))
    if default_pd_buffer_device(member) == "cpu":
        parts.append(("PD buffer", transfer.buffer_size))
    if role == "decode" and pd_bypass_ratio(pool, member) > 0:  # it keeps what it decoded
        parts.append(("CPU cache", pool.spec.tiers.cpu.size))
    return parts  # nor the pool's remote tier (platform.carries_pool_tiers)


def engine_memory_bytes(engine: EngineSpec) -> int:
    """The engine's own memory request (engine.resources.requests.memory), 0 when unset or
    not a quantity kvpool can add to (validation reports that one)."""
    value = engine.resources.requests.get("memory")
    try:
        return parse_quantity(value) if value is not None else 0
    except ValueError:
        return 0


def _groups(member: P2PGroup | PDPair) -> list[tuple[str, str, int, int, EngineSpec]]:
    """(label, role, instances, TP, engine) of each kind of instance of a member."""
    if isinstance(member, P2PGroup):
        s = member.spec
        return [("instances", "p2p", s.replicas, s.tensor_parallel_size, s.engine)]
    p, d = member.spec.prefill, member.spec.decode
    return [
        ("prefill", "prefill", p.replicas, p.tensor_parallel_size, p.engine),
        ("decode", "decode", d.replicas, d.tensor_parallel_size, d.engine),
    ]


def instance_host_bytes(pool: KVCachePool, member: P2PGroup | PDPair, role: str, tp: int) -> int:
    """LMCache host memory of one instance: TP ranks x what each rank pins."""
    return tp * sum(size for _, size in rank_parts(pool, member, role))


#: The budget's term for a simulated engine's instances (rule 7's host memory is not theirs).
SIMULATED_TIERS = "0: sim, its tiers are simulated and allocate no host memory"


def _terms(parts: Parts) -> str:
    return " + ".join(f"{format_bytes(size)} {name}" for name, size in parts) or "0"


def member_memory_budget(pool: KVCachePool, member: P2PGroup | PDPair) -> MemoryBudget:
    """Host memory of a member: workers x (staging + CPU cache [+ PD buffers, Mooncake])."""
    groups = _groups(member)
    pieces: list[str] = []
    total = workers = per_worker = per_instance = pod_request = 0
    for label, role, count, tp, engine in groups:
        parts = rank_parts(pool, member, role)
        rank_bytes = sum(size for _, size in parts)
        terms = _terms(parts) if engine.sim is None else SIMULATED_TIERS
        pieces.append(f"{count} {label} x TP {tp} = {count * tp} workers x ({terms})")
        total += count * tp * rank_bytes
        workers += count * tp
        per_worker = max(per_worker, rank_bytes)
        per_instance = max(per_instance, tp * rank_bytes)
        pod_request = max(pod_request, tp * rank_bytes + engine_memory_bytes(engine))
    formula = " + ".join(pieces) + f" = {format_bytes(total)}"
    tp_first = groups[0][3]
    return MemoryBudget(
        kv_bytes_per_token_per_rank=kv_bytes_per_token_per_rank(pool, tp_first),
        chunk_bytes_per_rank=chunk_bytes_per_rank(pool, tp_first),
        workers=workers,
        per_worker_bytes=per_worker,
        per_instance_bytes=per_instance,
        pod_memory_request_bytes=pod_request,
        total_bytes=total,
        formula=formula,
    )
