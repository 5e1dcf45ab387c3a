"""Platform defaults: transfer channel, PD buffer device, which side of a PD pair pulls, and
which members carry the pool's disk and remote tiers.

Why: a field left unset is filled in from the platform (ascend, cuda, cpu); render emits the
filled-in value and validation checks it, so both read it from here.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.operator.api.members import P2PGroup, PDPair
from kvpool.operator.api.pool import KVCachePool

CHANNEL_DEFAULT = {"ascend": "hccl", "cuda": "nixl", "cpu": "nixl"}
#: Transfer channels each platform's LMCache build accepts (the first is the default).
CHANNELS = {"ascend": ("hccl", "hixl"), "cuda": ("nixl",), "cpu": ("nixl",)}
#: pd_buffer_device values each platform can allocate (the first is the default).
PD_BUFFER_DEVICES = {"ascend": ("npu", "cpu"), "cuda": ("cuda", "cpu"), "cpu": ("cpu",)}


def default_channel(platform: str, channel: str | None) -> str:
    """transfer_channel when the spec leaves it unset."""
    return channel or CHANNEL_DEFAULT[platform]


def member_channel(member: P2PGroup | PDPair) -> str:
    """The transfer channel a member's instances use."""
    if isinstance(member, P2PGroup):
        return default_channel(member.spec.engine.platform, member.spec.transfer.channel)
    return default_channel(member.spec.prefill.engine.platform, member.spec.transfer.channel)


def pd_sender_pull(pair: PDPair) -> bool:
    """Whether the PD mode makes the decoder pull (the sender then collects Done)."""
    return pair.spec.transfer.mode != "push"


def pd_delay_pull(pair: PDPair) -> bool:
    """Whether the decoder pulls only when it decodes (pd_delay_pull)."""
    return pair.spec.transfer.mode in ("pull-delay", "cpu-offload-pull-delay")


def default_pd_buffer_device(member: PDPair) -> str:
    """pd_buffer_device when the spec leaves it unset: the accelerator, or cpu on cpu."""
    platform = member.spec.prefill.engine.platform
    return member.spec.transfer.buffer_device or PD_BUFFER_DEVICES[platform][0]


def member_platforms(member: P2PGroup | PDPair) -> list[str]:
    """The platform of each engine a member declares."""
    if isinstance(member, P2PGroup):
        return [member.spec.engine.platform]
    return [member.spec.prefill.engine.platform, member.spec.decode.engine.platform]


def hashes_like_vllm(members: Sequence[P2PGroup | PDPair]) -> bool:
    """Whether the domain's engines are vLLM (ascend, cuda): vLLM seeds LMCache's NONE_HASH from
    PYTHONHASHSEED, kvpool's reference engine (cpu) does not, so the controller (``--vllm``)
    and the gateway (``vllm: true``) must hash the way the engines do."""
    return any(p != "cpu" for m in members for p in member_platforms(m))


def carries_pool_tiers(member: P2PGroup | PDPair) -> bool:
    """Whether ``member``'s instances get the pool's disk and remote tiers. A PD pair's do not:
    LMCache 0.5.6 runs the PD roles without the local CPU tier, and its disk and remote backends
    use that tier as their buffer (the disk backend asserts at start, the Mooncake connector
    fails with ``'SafeLocalCPUBackend' object has no attribute 'config'`` and every store of a
    remote tier with ``local_cpu_backend is required for get_allocator_backend``). A PD
    instance gets its KV by transfer; the tiers serve the pool's P2P groups."""
    return isinstance(member, P2PGroup)


def pd_bypass_ratio(pool: KVCachePool, member: P2PGroup | PDPair) -> float:
    """The gateway's PD bypass threshold for ``member`` (spec.gateway.pd.bypassMinCachedRatio),
    0 when off: unset or 0, not a PDPair, or decoders that keep nothing. Only kvpool's reference
    engine (platform cpu) keeps what a decoder finished (worker ``pd_keep``); vLLM's PD consumer
    does not save. Where it is on, the decoders get the pool's CPU tier and register with the
    controller (``lmcache_config.pd_config``), so the index knows what they hold."""
    ratio = pool.spec.gateway.pd.bypass_min_cached_ratio
    if not ratio or not isinstance(member, PDPair):
        return 0.0
    decode = member.spec.decode.engine
    return float(ratio) if decode.platform == "cpu" and decode.sim is None else 0.0
