"""KV sizes and the host memory budget of the seed manual (§5.5), as pure arithmetic.

Why: buffers smaller than one chunk fail at runtime, and host memory must be summed per worker
(TP rank), not per instance. Render, validation and status all need these same numbers.
"""

from __future__ import annotations

import math

from kvpool.operator.api.common import MemoryBudget
from kvpool.operator.api.members import P2PGroup, PDPair, PDPairSpec
from kvpool.operator.api.pool import DTYPE_BYTES, KVCachePool
from kvpool.operator.quantity import format_bytes


def kv_bytes_per_token_per_rank(pool: KVCachePool, tp: int) -> int:
    """All layers, K and V (one latent for MLA), KV heads on this rank, head dim, dtype bytes."""
    model = pool.spec.model
    dtype = DTYPE_BYTES[model.kv_dtype]
    if model.mla:
        return model.num_layers * model.head_dim * dtype
    heads_per_rank = max(1, math.ceil(model.num_kv_heads / tp))
    return model.num_layers * 2 * heads_per_rank * model.head_dim * dtype


def chunk_bytes_per_rank(pool: KVCachePool, tp: int) -> int:
    """Bytes of one full chunk on one TP rank."""
    return pool.spec.chunk_size * kv_bytes_per_token_per_rank(pool, tp)


def _budget(
    pool: KVCachePool, tp: int, instances: int, parts: list[tuple[str, int]]
) -> MemoryBudget:
    per_worker = sum(size for _, size in parts)
    workers = instances * tp
    terms = " + ".join(f"{format_bytes(size)} {name}" for name, size in parts) or "0"
    formula = (
        f"{instances} instances x TP {tp} = {workers} workers x ({terms}) = "
        f"{format_bytes(workers * per_worker)}"
    )
    return MemoryBudget(
        kv_bytes_per_token_per_rank=kv_bytes_per_token_per_rank(pool, tp),
        chunk_bytes_per_rank=chunk_bytes_per_rank(pool, tp),
        workers=workers,
        per_worker_bytes=per_worker,
        per_instance_bytes=per_worker * tp,
        total_bytes=workers * per_worker,
        formula=formula,
    )


def member_memory_budget(pool: KVCachePool, member: P2PGroup | PDPair) -> MemoryBudget:
    """Host memory of a member: workers x (staging + CPU cache [+ PD CPU buffer])."""
    cpu = pool.spec.tiers.cpu.size
    if isinstance(member, P2PGroup):
        spec = member.spec
        p2p_parts = [("CPU cache", cpu)]
        if spec.transfer.host_staging.enabled:
            p2p_parts.insert(0, ("staging", spec.transfer.host_staging.bytes))
        return _budget(pool, spec.tensor_parallel_size, spec.replicas, p2p_parts)
    pd = member.spec
    tp = max(pd.prefill.tensor_parallel_size, pd.decode.tensor_parallel_size)
    parts: list[tuple[str, int]] = []  # PD instances run without the local CPU tier
    if pd.transfer.mode == "cpu-offload-pull-delay":
        parts.append(("PD CPU buffer", pd.transfer.cpu_buffer_size))
    if default_pd_buffer_device(member) == "cpu":
        parts.append(("PD buffer", pd.transfer.buffer_size))
    return _budget(pool, tp, pd.prefill.replicas + pd.decode.replicas, parts)


def _default_pd_device(pd: PDPairSpec) -> str:
    platform = pd.prefill.engine.platform
    return {"ascend": "npu", "cuda": "cuda", "cpu": "cpu"}[platform]


def default_pd_buffer_device(member: PDPair) -> str:
    """pd_buffer_device when the spec leaves it unset: the accelerator, or cpu on cpu."""
    return member.spec.transfer.buffer_device or _default_pd_device(member.spec)
