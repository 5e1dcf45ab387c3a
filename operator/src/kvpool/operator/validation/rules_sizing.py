"""Sizing rules (7, 9, 10): buffers hold a chunk, pods fit a node, accelerators cover the TP
ranks, MLA with saveOnlyFirstRank pulls eagerly through HostStaging.

Why: a buffer smaller than one chunk fails (or aligns to zero) at run time, and a pod asking
for more memory than any node has stays Pending without saying why.
"""

from __future__ import annotations

import math

from kvpool.operator.api.members import P2PGroup, PDPair
from kvpool.operator.api.pool import KVCachePool
from kvpool.operator.derive.instances import engines, instances
from kvpool.operator.derive.sizing import (
    chunk_bytes_per_rank,
    engine_memory_bytes,
    instance_host_bytes,
    kv_bytes_per_token_per_rank,
    rank_parts,
)
from kvpool.operator.quantity import format_bytes
from kvpool.operator.validation.problems import Patch, Problem, remove_field, set_field, where

Members = list[P2PGroup | PDPair]
MIB = 2**20


def _buffers(member: P2PGroup | PDPair) -> list[tuple[str, int, int]]:
    """(field, bytes, TP) of every buffer that must hold one chunk per rank."""
    if isinstance(member, P2PGroup):
        t, tp = member.spec.transfer, member.spec.tensor_parallel_size
        out: list[tuple[str, int, int]] = []
        if not member.spec.p2p:  # no P2P buffer is rendered
            return out
        if t.host_staging.enabled:
            out.append(("spec.transfer.hostStaging.bytes", t.host_staging.bytes, tp))
        if member.spec.engine.platform == "ascend" and t.use_npu:
            out.append(("spec.transfer.npuBufferSize", t.npu_buffer_size, tp))
        return out
    # The smaller TP size has more KV heads per rank, hence the larger per-rank chunk.
    tp_prefill = member.spec.prefill.tensor_parallel_size
    tp = min(tp_prefill, member.spec.decode.tensor_parallel_size)
    out = [("spec.transfer.bufferSize", member.spec.transfer.buffer_size, tp)]
    if member.spec.transfer.mode == "cpu-offload-pull-delay":
        # pd_cpu_buffer_size is rendered for the sender (prefill) only.
        out.append(
            ("spec.transfer.cpuBufferSize", member.spec.transfer.cpu_buffer_size, tp_prefill)
        )
    return out


def _staging_warning(pool: KVCachePool, group: P2PGroup) -> list[Problem]:
    hs, tp = group.spec.transfer.host_staging, group.spec.tensor_parallel_size
    on = hs.enabled and group.spec.p2p
    if not (on and hs.expected_concurrent_requests and hs.expected_hit_tokens):
        return []
    per_token = kv_bytes_per_token_per_rank(pool, tp)
    need = hs.expected_concurrent_requests * hs.expected_hit_tokens * per_token
    if need <= hs.bytes:
        return []
    return [
        Problem(
            where(group, "spec.transfer.hostStaging.bytes"),
            f"{format_bytes(hs.bytes)} holds less than {hs.expected_concurrent_requests} "
            f"concurrent x {hs.expected_hit_tokens} hit tokens x {per_token} B/token = "
            f"{format_bytes(need)}; the rest of each hit is recomputed",
            f"set hostStaging.bytes: {need} ({format_bytes(need)}) or more",
            rule=7,
            severity="warning",
            code="buffer.staging-hits",
            patch=(set_field(group, "spec.transfer.hostStaging.bytes", need),),
        )
    ]


def rule7_buffers(pool: KVCachePool, members: Members) -> list[Problem]:
    """Buffers hold at least one full chunk; warn on staging smaller than the expected hits."""
    out: list[Problem] = []
    for member in members:
        if isinstance(member, P2PGroup):
            out += _staging_warning(pool, member)
        for path, size, tp in _buffers(member):
            chunk = chunk_bytes_per_rank(pool, tp)
            if size < chunk:
                out.append(
                    Problem(
                        where(member, path),
                        f"{format_bytes(size)} is smaller than one chunk: {pool.spec.chunk_size} "
                        f"tokens x {kv_bytes_per_token_per_rank(pool, tp)} B/token/rank = "
                        f"{format_bytes(chunk)}",
                        f"set it to at least {format_bytes(chunk)} ({chunk} bytes)",
                        rule=7,
                        code="buffer.chunk",
                        patch=(set_field(member, path, chunk),),
                    )
                )
    out += budget_warnings(pool, members)
    return out


#: The per-rank part a fix lowers to fit a node, and the field that sets it.
_ADJUSTABLE = {
    "CPU cache": ("pool", "spec.tiers.cpu.size"),
    "staging": ("member", "spec.transfer.hostStaging.bytes"),
    "PD CPU buffer": ("member", "spec.transfer.cpuBufferSize"),
    "PD buffer": ("member", "spec.transfer.bufferSize"),
}


def _fit_patch(
    pool: KVCachePool, member: P2PGroup | PDPair, role: str, tp: int, request: int
) -> tuple[str, tuple[Patch, ...]]:
    """Lower the largest pinned parts per rank (never below one chunk) until the pod fits;
    when even that is not enough, the fix is a node that fits it."""
    allocatable = pool.spec.node_allocatable_memory or 0
    per_rank = math.ceil((request - allocatable) / tp)
    floor = math.ceil(chunk_bytes_per_rank(pool, tp) / MIB) * MIB
    texts: list[str] = []
    patches: list[Patch] = []
    for name, size in sorted(rank_parts(pool, member, role), key=lambda p: -p[1]):
        if per_rank <= 0 or name not in _ADJUSTABLE:
            continue
        lowered = max(floor, (size - per_rank) // MIB * MIB)
        if lowered >= size:
            continue
        per_rank -= size - lowered
        owner, field = _ADJUSTABLE[name]
        target = pool if owner == "pool" else member
        prefix = "the pool's " if owner == "pool" else ""
        texts.append(f"{prefix}{field.removeprefix('spec.')}: {format_bytes(lowered)}")
        patches.append(set_field(target, field, lowered))
    if per_rank <= 0:
        return f"set {' and '.join(texts)} (or use nodes with more memory)", tuple(patches)
    return (
        f"use nodes with at least {format_bytes(request)} allocatable (nodeAllocatableMemory: "
        f"{request}), or lower the engine's memory request",
        (set_field(pool, "spec.nodeAllocatableMemory", request),),
    )


def budget_warnings(pool: KVCachePool, members: Members) -> list[Problem]:
    """A worker pod whose memory request (LMCache host memory + engine) exceeds a node (a
    simulated engine's request is its engine's alone: its tiers allocate nothing)."""
    allocatable = pool.spec.node_allocatable_memory
    if allocatable is None:
        return []
    out: list[Problem] = []
    for member in members:
        seen: set[str] = set()
        for inst in instances(member):
            if inst.role in seen:
                continue
            seen.add(inst.role)
            lmcache = instance_host_bytes(pool, member, inst.role, inst.tp)
            request = lmcache + engine_memory_bytes(inst.engine)
            if request <= allocatable:
                continue
            fix, patch = _fit_patch(pool, member, inst.role, inst.tp, request)
            out.append(
                Problem(
                    where(member, "spec"),
                    f"each {inst.role} pod requests {format_bytes(request)} of memory "
                    f"({format_bytes(lmcache)} pinned by LMCache + "
                    f"{format_bytes(request - lmcache)} engine), more than a node's allocatable "
                    f"{format_bytes(allocatable)}: it can never be scheduled",
                    fix,
                    rule=7,
                    severity="warning",
                    code=f"budget.node:{inst.role}",
                    patch=patch,
                )
            )
    return out


def rule9_accelerators(pool: KVCachePool, members: Members) -> list[Problem]:
    """Accelerators requested >= TP size (the env of rule 9 is injected by construction)."""
    out: list[Problem] = []
    for member in members:
        for path, engine, tp in engines(member):
            if engine.platform == "cpu":
                continue
            if not engine.accelerator():
                out.append(
                    Problem(
                        where(member, f"{path}.acceleratorResource"),
                        f"platform {engine.platform} needs an accelerator resource",
                        "remove the empty value to use the platform default",
                        rule=9,
                        code="accelerator.resource",
                        patch=(remove_field(member, f"{path}.acceleratorResource"),),
                    )
                )
            count = engine.accelerator_count if engine.accelerator_count is not None else tp
            if count < tp:
                out.append(
                    Problem(
                        where(member, f"{path}.acceleratorCount"),
                        f"requests {count} accelerators but tensor parallel size is {tp}",
                        f"request at least {tp} (or remove it: the default is the TP size)",
                        rule=9,
                        code="accelerator.count",
                        patch=(set_field(member, f"{path}.acceleratorCount", tp),),
                    )
                )
    return out


def rule10_mla(pool: KVCachePool, members: Members) -> list[Problem]:
    """MLA/DSA with save_only_first_rank: eager HostStaging CPU pull."""
    out: list[Problem] = []
    for member in members:
        if not isinstance(member, P2PGroup) or not member.spec.save_only_first_rank:
            continue
        t = member.spec.transfer
        if not pool.spec.model.mla:
            out.append(
                Problem(
                    where(member, "spec.saveOnlyFirstRank"),
                    "saveOnlyFirstRank is meant for MLA/DSA models, whose KV is identical "
                    "on every rank; this pool's model is not MLA",
                    "remove saveOnlyFirstRank, or set spec.model.mla on the pool",
                    rule=10,
                    severity="warning",
                    code="mla.first-rank",
                    patch=(remove_field(member, "spec.saveOnlyFirstRank"),),
                )
            )
            continue
        if not member.spec.p2p:  # the eager pull applies to P2P; nothing is pulled
            continue
        wanted = (
            ("pullMode", t.pull_mode, True),
            ("delayPull", t.delay_pull, False),
            ("useNPU", t.use_npu, False),
            ("hostStaging.enabled", t.host_staging.enabled, True),
        )
        wrong = [(name, value, want) for name, value, want in wanted if value != want]
        if wrong:
            out.append(
                Problem(
                    where(member, "spec.transfer"),
                    "MLA with saveOnlyFirstRank needs an eager HostStaging CPU pull; got "
                    + ", ".join(f"{name}={value}" for name, value, _ in wrong),
                    "set pullMode: true, delayPull: false, useNPU: false, "
                    "hostStaging.enabled: true",
                    rule=10,
                    code="mla.transfer",
                    patch=tuple(
                        set_field(member, f"spec.transfer.{name}", want) for name, _, want in wrong
                    ),
                )
            )
    return out


__all__ = ["budget_warnings", "rule7_buffers", "rule9_accelerators", "rule10_mla"]
