"""Every size the operator fills in by default, reported instead of applied silently.

Why: a buffer of 128Mi that nobody wrote, a CPU cache of 5Gi per rank or an accelerator count
equal to the TP size decide whether a deployment fits its nodes; ``kvpool-operator validate``
prints them and status shows them, so a person sees what runs without reading the defaults.
A size counts as filled in when the spec leaves it at the field's default (the API server's
CRD defaulting writes the same value, so the cluster and the CLI report alike).
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel

from kvpool.operator.api.members import P2PGroup, PDPair, SimEngineSpec
from kvpool.operator.api.pool import KVCachePool
from kvpool.operator.derive import sim
from kvpool.operator.derive.instances import engines
from kvpool.operator.derive.platform import default_pd_buffer_device
from kvpool.operator.quantity import format_bytes


@dataclass(frozen=True)
class FilledDefault:
    """One value kvpool chose: which resource and field, the value, and where it lands."""

    resource: str
    field: str
    value: str
    lands_in: str

    def __str__(self) -> str:
        return f"{self.resource}: {self.field} = {self.value} (default; {self.lands_in})"


def _is_default(model: BaseModel, name: str) -> bool:
    info = type(model).model_fields[name]
    default = info.get_default(call_default_factory=True)
    value = getattr(model, name)
    if isinstance(value, BaseModel) and isinstance(default, BaseModel):
        return value.model_dump() == default.model_dump()
    return bool(value == default)


def _size(owner: str, field: str, value: int, lands_in: str) -> FilledDefault:
    return FilledDefault(owner, field, format_bytes(value), lands_in)


def pool_defaults(pool: KVCachePool, members: list[P2PGroup | PDPair]) -> list[FilledDefault]:
    """Pool sizes left at their defaults that some member of the domain uses."""
    out: list[FilledDefault] = []
    owner = f"KVCachePool/{pool.metadata.name}"
    tiers = pool.spec.tiers
    groups = [m for m in members if isinstance(m, P2PGroup)]
    if groups and _is_default(tiers, "cpu"):
        lands = "max_local_cpu_size per TP rank"
        if all(g.spec.engine.sim is not None for g in groups):
            lands += "; simulated by the sim engine, no host memory allocated"
        out.append(_size(owner, "spec.tiers.cpu.size", tiers.cpu.size, lands))
    remote = tiers.remote
    if remote is not None and remote.mooncake is not None:
        mc = remote.mooncake
        if _is_default(mc, "local_buffer_size"):
            out.append(
                _size(
                    owner,
                    "spec.tiers.remote.mooncake.localBufferSize",
                    mc.local_buffer_size,
                    "Mooncake local_buffer_size per TP rank",
                )
            )
    return out


def _sim_defaults(owner: str, path: str, spec: SimEngineSpec) -> list[FilledDefault]:
    """The sim limits left to the profile (the worker resolves them the same way)."""
    limits = sim.limits(spec)
    lands = f"the profile {spec.profile}'s"
    unset = (
        ("deviceKVGiB", spec.device_kv_gib, f"{limits.device_kv_gib:g}", "GiB of device KV"),
        ("maxNumSeqs", spec.max_num_seqs, str(limits.max_num_seqs), "requests batched"),
        (
            "maxNumBatchedTokens",
            spec.max_num_batched_tokens,
            str(limits.max_num_batched_tokens),
            "tokens per engine step",
        ),
    )
    return [
        FilledDefault(owner, f"{path}.{name}", value, f"{lands} {what}")
        for name, given, value, what in unset
        if given is None
    ]


def member_defaults(member: P2PGroup | PDPair) -> list[FilledDefault]:
    """Member sizes (and derived counts) kvpool filled in."""
    owner = f"{member.kind}/{member.metadata.name}"
    out: list[FilledDefault] = []
    for path, engine, tp in engines(member):
        if engine.platform != "cpu" and engine.accelerator_count is None:
            lands = f"{engine.accelerator()} per pod: the TP size"
            out.append(FilledDefault(owner, f"{path}.acceleratorCount", str(tp), lands))
        if engine.sim is not None:
            out += _sim_defaults(owner, f"{path}.sim", engine.sim)
    if isinstance(member, P2PGroup):
        if not member.spec.p2p:  # no transfer setting is rendered
            return out
        t = member.spec.transfer
        if t.host_staging.enabled and _is_default(t.host_staging, "bytes"):
            out.append(
                _size(
                    owner,
                    "spec.transfer.hostStaging.bytes",
                    t.host_staging.bytes,
                    "os_staging_bytes per rank",
                )
            )
        if (
            member.spec.engine.platform == "ascend"
            and t.use_npu
            and _is_default(t, "npu_buffer_size")
        ):
            out.append(
                _size(
                    owner,
                    "spec.transfer.npuBufferSize",
                    t.npu_buffer_size,
                    "p2p_npu_buffer_size per rank",
                )
            )
        return out
    pt = member.spec.transfer
    if _is_default(pt, "buffer_size"):
        out.append(
            _size(
                owner,
                "spec.transfer.bufferSize",
                pt.buffer_size,
                "pd_buffer_size per rank, both sides",
            )
        )
    if pt.buffer_device is None:
        out.append(
            FilledDefault(
                owner,
                "spec.transfer.bufferDevice",
                default_pd_buffer_device(member),
                "pd_buffer_device",
            )
        )
    if pt.mode == "cpu-offload-pull-delay" and _is_default(pt, "cpu_buffer_size"):
        out.append(
            _size(
                owner,
                "spec.transfer.cpuBufferSize",
                pt.cpu_buffer_size,
                "pd_cpu_buffer_size per prefill rank",
            )
        )
    return out


def domain_defaults(pool: KVCachePool, members: list[P2PGroup | PDPair]) -> list[FilledDefault]:
    """Everything kvpool filled in for the domain: the pool's, then each member's."""
    out = pool_defaults(pool, members)
    for member in sorted(members, key=lambda m: (m.kind, m.metadata.name)):
        out += member_defaults(member)
    return out
