"""Transfer rules (4, 5, 6, 8): tiers vs P2P, channels, pull modes, PD pairs, overrides.

Why: LMCache(-Ascend) silently turns a delay pull off without useNPU, ignores a top-level
p2p_pull_pending_ttl, indexes a decoder's ports by the sender's TP rank; these combinations
look fine in YAML and fail (or silently do less) at run time.
"""

from __future__ import annotations

from kvpool.operator.api.members import P2PGroup, P2PTransfer, PDPair
from kvpool.operator.api.pool import KVCachePool
from kvpool.operator.derive.instances import engines
from kvpool.operator.derive.lmcache_config import ASCEND_ONLY_KEYS, UPSTREAM_KEYS
from kvpool.operator.derive.ownership import owned_lmcache_keys
from kvpool.operator.derive.platform import (
    CHANNELS,
    PD_BUFFER_DEVICES,
    carries_pool_tiers,
    default_pd_buffer_device,
    member_channel,
    pd_sender_pull,
)
from kvpool.operator.validation.problems import Problem, remove_field, set_field, where

Members = list[P2PGroup | PDPair]


def rule4_p2p_disk(pool: KVCachePool, members: Members) -> list[Problem]:
    """P2P and the local-disk tier are mutually exclusive in one domain (upstream bug); a group
    with ``p2p: false`` pulls nothing and may use the disk tier."""
    groups = [m for m in members if isinstance(m, P2PGroup) and m.spec.p2p]
    if pool.spec.tiers.disk is None or not groups:
        return []
    listed = ", ".join(g.metadata.name for g in groups)
    return [
        Problem(
            where(pool, "spec.tiers.disk"),
            f"the local disk tier is set and P2PGroup(s) {listed} join this pool: P2P with "
            "the SSD tier has a known upstream bug (seed manual §5.3)",
            "remove tiers.disk from this pool, or run the P2P groups in a pool without disk",
            rule=4,
            code="p2p.disk",
            patch=(remove_field(pool, "spec.tiers.disk"),),
        )
    ]


def _channel(member: P2PGroup | PDPair, platform: str) -> list[Problem]:
    channel = member_channel(member)
    allowed = CHANNELS[platform]
    if channel in allowed:
        return []
    return [
        Problem(
            where(member, "spec.transfer.channel"),
            f"channel {channel} is not available on platform {platform}",
            f"remove transfer.channel (the default on {platform} is {allowed[0]}), or use "
            f"one of {', '.join(allowed)}",
            rule=5,
            code="transfer.channel",
            patch=(remove_field(member, "spec.transfer.channel"),),
        )
    ]


def _unused_transfer(group: P2PGroup) -> list[Problem]:
    """``p2p: false`` renders no transfer setting: say so when some are set."""
    if group.spec.transfer == P2PTransfer():
        return []
    return [
        Problem(
            where(group, "spec.transfer"),
            "transfer settings apply to P2P pulls; with p2p: false nothing is pulled and none "
            "of them is rendered",
            "remove spec.transfer, or set p2p: true",
            rule=5,
            severity="warning",
            code="transfer.unused",
            patch=(remove_field(group, "spec.transfer"),),
        )
    ]


def _p2p_transfer(group: P2PGroup) -> list[Problem]:
    """A P2P group's transfer settings: the channel, the Ascend-only options, the pull modes
    and async loading (in that order)."""
    if not group.spec.p2p:
        return _unused_transfer(group)
    platform = group.spec.engine.platform
    out = _channel(group, platform)
    out += _ascend_only(group, platform)
    out += _pull_modes(group)
    return out + _async_loading(group, platform)


def _ascend_only(group: P2PGroup, platform: str) -> list[Problem]:
    """LMCache-Ascend's options, which upstream LMCache ignores on another platform."""
    if platform == "ascend":
        return []
    t = group.spec.transfer
    return [
        Problem(
            where(group, f"spec.transfer.{field}"),
            f"is an LMCache-Ascend option; upstream LMCache on {platform} ignores it",
            f"set transfer.{field}: false, or use platform: ascend",
            rule=5,
            code=f"transfer.ascend-only.{field}",
            patch=(set_field(group, f"spec.transfer.{field}", False),),
        )
        for field, on in (
            ("pullMode", t.pull_mode),
            ("delayPull", t.delay_pull),
            ("useNPU", t.use_npu),
            ("hostStaging.enabled", t.host_staging.enabled),
        )
        if on
    ]


def _pull_modes(group: P2PGroup) -> list[Problem]:
    """Delay pull and HostStaging: what LMCache-Ascend needs before it honours them."""
    out: list[Problem] = []
    t = group.spec.transfer
    if t.delay_pull and not (t.pull_mode and t.use_npu):
        missing = [n for n, v in (("pullMode", t.pull_mode), ("useNPU", t.use_npu)) if not v]
        out.append(
            Problem(
                where(group, "spec.transfer.delayPull"),
                f"delay pull needs {' and '.join(missing)}: LMCache-Ascend would silently turn "
                "delay pull off",
                "set pullMode: true and useNPU: true, or delayPull: false for an eager CPU pull",
                rule=5,
                code="transfer.delay-pull",
                patch=(
                    set_field(group, "spec.transfer.pullMode", True),
                    set_field(group, "spec.transfer.useNPU", True),
                ),
            )
        )
    channel = member_channel(group)
    if t.host_staging.enabled and channel != "hccl":
        out.append(
            Problem(
                where(group, "spec.transfer.hostStaging.enabled"),
                f"HostStaging needs transfer channel hccl, not {channel} (HIXL has none)",
                "set transfer.channel: hccl or disable hostStaging",
                rule=5,
                code="transfer.staging-channel",
                patch=(set_field(group, "spec.transfer.channel", "hccl"),),
            )
        )
    if t.host_staging.enabled and not t.pull_mode:
        out.append(
            Problem(
                where(group, "spec.transfer.hostStaging.enabled"),
                "HostStaging only works with a pull mode (delay+NPU or eager+CPU)",
                "set transfer.pullMode: true",
                rule=5,
                code="transfer.staging-pull",
                patch=(set_field(group, "spec.transfer.pullMode", True),),
            )
        )
    return out


def _async_loading(group: P2PGroup, platform: str) -> list[Problem]:
    """Where P2P needs async loading: upstream's lookups, and a cache policy anywhere."""
    out: list[Problem] = []
    spec = group.spec
    async_on = (set_field(group, "spec.enableAsyncLoading", True),)
    if platform != "ascend" and not spec.enable_async_loading:
        out.append(
            Problem(
                where(group, "spec.enableAsyncLoading"),
                f"upstream LMCache P2P on {platform} only finds peer KV through async "
                "lookups (its synchronous contains() always misses)",
                "set enableAsyncLoading: true",
                rule=5,
                code="transfer.async",
                patch=async_on,
            )
        )
    if spec.cache_policy is not None and not spec.enable_async_loading:
        out.append(
            Problem(
                where(group, "spec.cachePolicy"),
                "cachePolicy with P2P needs enableAsyncLoading, otherwise reads from a "
                "peer's cache can fail under load (seed manual §5.3)",
                "set enableAsyncLoading: true or remove cachePolicy",
                rule=5,
                code="transfer.cache-policy",
                patch=async_on,
            )
        )
    return out


def rule5_transfer(pool: KVCachePool, members: Members) -> list[Problem]:
    """Delay pull, HostStaging, channels and cache_policy: the combinations LMCache honours."""
    out: list[Problem] = []
    for member in members:
        if isinstance(member, P2PGroup):
            out += _p2p_transfer(member)
            continue
        platform = member.spec.prefill.engine.platform
        out += _channel(member, platform)
        if platform != "ascend" and pd_sender_pull(member):
            out.append(
                Problem(
                    where(member, "spec.transfer.mode"),
                    f"mode {member.spec.transfer.mode} needs LMCache-Ascend (pd_pull_mode); "
                    f"upstream LMCache on {platform} only pushes",
                    "set transfer.mode: push, or platform: ascend",
                    rule=5,
                    code="pd.mode-platform",
                    patch=(set_field(member, "spec.transfer.mode", "push"),),
                )
            )
    return out


def _override(member: P2PGroup | PDPair, path: str, key: str, platform: str) -> Problem | None:
    field = f"{path}.lmcacheOverrides.{key}"
    drop = (remove_field(member, field),)
    if key == "p2p_pull_pending_ttl":
        message = (
            "LMCache-Ascend reads p2p_pull_pending_ttl only from extra_config; the top-level "
            "key is ignored"
        )
        fix = "remove it and set spec.transfer.pullPendingTTLSeconds (kvpool renders it under "
        fix += "extra_config)"
        return Problem(where(member, field), message, fix, rule=6, code="override", patch=drop)
    if key == "enable_p2p" and isinstance(member, PDPair):
        return Problem(
            where(member, field),
            "PD and P2P on one instance is not supported",
            "remove it; use a P2PGroup for P2P sharing",
            rule=8,
            code="override",
            patch=drop,
        )
    if key in owned_lmcache_keys():
        message = f"{key} is derived by kvpool from the pool and member spec"
        fix = f"remove it; kvpool renders {key} itself (see `kvpool-operator render`)"
    elif key in ASCEND_ONLY_KEYS and platform != "ascend":
        message = f"{key} is an LMCache-Ascend key; LMCache on {platform} ignores it"
        fix = "remove it, or use platform: ascend"
    elif key not in UPSTREAM_KEYS and key not in ASCEND_ONLY_KEYS:
        message = (
            f"{key} is not a key of the pinned LMCache (0.5.6); LMCache would ignore it silently"
        )
        fix = "remove it, or correct the spelling against lmcache/v1/config.py"
    else:
        return None
    return Problem(where(member, field), message, fix, rule=6, code="override", patch=drop)


def _override_value(member: P2PGroup | PDPair, path: str, key: str, value: object) -> str | None:
    """What LMCache 0.5.6's config validation (or its PD backend) refuses in an allowed key."""
    if key == "min_retrieve_tokens" and (not isinstance(value, int) or value < 0):
        return "LMCache requires min_retrieve_tokens >= 0 (it raises ValueError)"
    if key == "pd_backend_mode" and value not in ("sync", "async"):
        return "LMCache requires pd_backend_mode 'sync' or 'async' (it raises ValueError)"
    if isinstance(member, PDPair) and path == "spec.decode.engine":
        if key == "store_location" and value == "PDBackend":
            return "store_location cannot be PDBackend on a PD receiver (LMCache asserts it)"
        if key == "retrieve_locations" and value not in (None, ["PDBackend"]):
            return 'a PD receiver retrieves from ["PDBackend"] only (LMCache asserts it)'
    return None


def rule6_and_overrides(pool: KVCachePool, members: Members) -> list[Problem]:
    """p2p_pull_pending_ttl only from extra_config; overrides only of known keys kvpool does
    not own (the owned keys are what kvpool's LMCache config builders emit)."""
    out: list[Problem] = []
    for member in members:
        for path, engine, _ in engines(member):
            for key in sorted(engine.lmcache_overrides):
                problem = _override(member, path, key, engine.platform)
                if problem is not None:
                    out.append(problem)
                    continue
                refused = _override_value(member, path, key, engine.lmcache_overrides[key])
                if refused is not None:
                    field = f"{path}.lmcacheOverrides.{key}"
                    out.append(
                        Problem(
                            where(member, field),
                            refused,
                            f"remove lmcacheOverrides.{key} (LMCache's default applies)",
                            rule=6,
                            code="override.value",
                            patch=(remove_field(member, field),),
                        )
                    )
    return out


def _pd_pair(pair: PDPair) -> list[Problem]:
    """A PD pair's sides: one platform and TP size, a buffer device the platform allocates,
    neither side alone at zero."""
    return _pd_sides(pair) + _pd_buffer_device(pair) + _pd_half_scaled(pair)


def _pd_sides(pair: PDPair) -> list[Problem]:
    out: list[Problem] = []
    spec = pair.spec
    p, d = spec.prefill.engine.platform, spec.decode.engine.platform
    if p != d:
        out.append(
            Problem(
                where(pair, "spec.decode.engine.platform"),
                f"prefill runs on {p} but decode on {d}; the PD transfer channel needs both "
                "sides on one platform",
                f"set decode.engine.platform: {p}",
                rule=8,
                code="pd.platform",
                patch=(set_field(pair, "spec.decode.engine.platform", p),),
            )
        )
    tpp, tpd = spec.prefill.tensor_parallel_size, spec.decode.tensor_parallel_size
    if tpp != tpd:
        out.append(
            Problem(
                where(pair, "spec.decode.tensorParallelSize"),
                f"prefill runs TP {tpp} but decode TP {tpd}: each sender rank writes its KV "
                "slice to the decoder rank of the same index (pd_peer_init_port[rank]), so "
                "both sides need one TP size",
                f"set decode.tensorParallelSize: {tpp}",
                rule=8,
                code="pd.tp",
                patch=(set_field(pair, "spec.decode.tensorParallelSize", tpp),),
            )
        )
    return out


def _pd_buffer_device(pair: PDPair) -> list[Problem]:
    out: list[Problem] = []
    spec = pair.spec
    p = spec.prefill.engine.platform
    device = default_pd_buffer_device(pair)
    allowed = PD_BUFFER_DEVICES[p]
    if device not in allowed:
        out.append(
            Problem(
                where(pair, "spec.transfer.bufferDevice"),
                f"pd_buffer_device {device} cannot be allocated on platform {p}",
                f"remove transfer.bufferDevice (the default on {p} is {allowed[0]}), or use "
                f"one of {', '.join(allowed)}",
                rule=8,
                code="pd.device",
                patch=(remove_field(pair, "spec.transfer.bufferDevice"),),
            )
        )
    elif p == "ascend" and device == "cpu" and pd_sender_pull(pair):
        offload = spec.transfer.mode == "cpu-offload-pull-delay"
        out.append(
            Problem(
                where(pair, "spec.transfer.bufferDevice"),
                f"mode {spec.transfer.mode} pulls from the sender's NPU buffer; "
                + (
                    "cpu-offload-pull-delay already stages on the host (cpuBufferSize)"
                    if offload
                    else "LMCache-Ascend's pull modes are documented with pd_buffer_device npu"
                ),
                "set transfer.bufferDevice: npu",
                rule=8,
                severity="error" if offload else "warning",
                code="pd.mode-device",
                patch=(set_field(pair, "spec.transfer.bufferDevice", "npu"),),
            )
        )
    return out


def _pd_half_scaled(pair: PDPair) -> list[Problem]:
    out: list[Problem] = []
    spec = pair.spec
    for side, role in (("prefill", spec.prefill), ("decode", spec.decode)):
        other = spec.decode if side == "prefill" else spec.prefill
        if role.replicas == 0 and other.replicas > 0:
            out.append(
                Problem(
                    where(pair, f"spec.{side}.replicas"),
                    f"{side} is scaled to zero while the other side runs: the pair serves no "
                    "request until both sides have an instance",
                    f"set {side}.replicas: 1, or scale both sides to zero",
                    rule=8,
                    severity="warning",
                    code="pd.half-scaled",
                    patch=(set_field(pair, f"spec.{side}.replicas", 1),),
                )
            )
    return out


def rule8_pd(pool: KVCachePool, members: Members) -> list[Problem]:
    """PD/P2P not with use_layerwise; a PD pair's sides agree on platform, TP and buffer."""
    out: list[Problem] = []
    for member in members:
        p2p_off = isinstance(member, P2PGroup) and not member.spec.p2p
        if member.spec.use_layerwise and not p2p_off:
            kind = "P2P" if isinstance(member, P2PGroup) else "PD"
            out.append(
                Problem(
                    where(member, "spec.useLayerwise"),
                    f"{kind} with use_layerwise raises ValueError in LMCache(-Ascend)",
                    "set useLayerwise: false",
                    rule=8,
                    code="layerwise",
                    patch=(set_field(member, "spec.useLayerwise", False),),
                )
            )
        if isinstance(member, PDPair):
            out += _pd_pair(member)
    return out + _tiers_unused(pool, members)


def _tiers_unused(pool: KVCachePool, members: Members) -> list[Problem]:
    """A warning per disk or remote tier that no member carries: every member is a PD pair,
    whose instances run without the pool's tiers (``platform.carries_pool_tiers``)."""
    if not members or any(carries_pool_tiers(m) for m in members):
        return []
    out: list[Problem] = []
    for tier in ("disk", "remote"):
        if getattr(pool.spec.tiers, tier) is None:
            continue
        out.append(
            Problem(
                where(pool, f"spec.tiers.{tier}"),
                f"no member of this pool uses the {tier} tier: PD instances run without the "
                "pool's disk and remote tiers (LMCache 0.5.6's PD roles have no local CPU tier, "
                "which those backends need as their buffer)",
                f"remove tiers.{tier}, or add a P2PGroup to this pool (it carries the tiers)",
                rule=8,
                severity="warning",
                code="pd.tiers",
                patch=(remove_field(pool, f"spec.tiers.{tier}"),),
            )
        )
    return out
