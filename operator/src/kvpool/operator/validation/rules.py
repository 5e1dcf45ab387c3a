"""The cache-domain contract (DESIGN.md rules 1-10) as pure checks over a pool and its members.

Why: each rule is a way a hand-written LMCache deployment breaks silently (0 % hits, a delay
pull quietly turned off, a port bound twice). Rejecting it here, with the field and the fix,
turns a day of debugging into one line at `kubectl apply` time.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from kvpool.operator.api.members import EngineSpec, P2PGroup, PDPair
from kvpool.operator.api.pool import KVCachePool
from kvpool.operator.derive import names
from kvpool.operator.derive.instances import member_instances
from kvpool.operator.derive.lmcache_config import ASCEND_ONLY_KEYS, UPSTREAM_KEYS
from kvpool.operator.derive.ownership import owned_lmcache_keys
from kvpool.operator.derive.platform import default_channel, pd_sender_pull
from kvpool.operator.derive.ports import member_port_range
from kvpool.operator.derive.sizing import chunk_bytes_per_rank, kv_bytes_per_token_per_rank
from kvpool.operator.quantity import format_bytes
from kvpool.operator.validation.problems import Problem
from kvpool.protocol.domain import MAX_HASH_SEED

_DOMAIN_FLAGS = ("--block-size", "--max-model-len", "--tensor-parallel-size", "--port", "--model")

Members = list[P2PGroup | PDPair]


def where(resource: KVCachePool | P2PGroup | PDPair, field: str) -> str:
    """``Kind/name: field``."""
    return f"{resource.kind}/{resource.metadata.name}: {field}"


def _engines(member: P2PGroup | PDPair) -> Iterator[tuple[str, EngineSpec, int]]:
    if isinstance(member, P2PGroup):
        yield "spec.engine", member.spec.engine, member.spec.tensor_parallel_size
    else:
        yield (
            "spec.prefill.engine",
            member.spec.prefill.engine,
            member.spec.prefill.tensor_parallel_size,
        )
        yield (
            "spec.decode.engine",
            member.spec.decode.engine,
            member.spec.decode.tensor_parallel_size,
        )


def rule1_domain(pool: KVCachePool, members: Members) -> list[Problem]:
    """One PYTHONHASHSEED and one fingerprint (seed, chunk, hash, model, dtype, block size)."""
    out: list[Problem] = []
    seed = pool.spec.hash_seed
    if seed != "auto" and int(seed) > MAX_HASH_SEED:
        out.append(
            Problem(
                where(pool, "spec.hashSeed"),
                f"PYTHONHASHSEED {seed} is out of range: Python accepts 0..{MAX_HASH_SEED}",
                "pick an integer in 0..4294967295 (the value itself does not matter, "
                "only that every process shares it), or write auto",
                rule=1,
            )
        )
    for member in members:
        if member.spec.pool_ref.name != pool.metadata.name:
            out.append(
                Problem(
                    where(member, "spec.poolRef.name"),
                    f"names pool {member.spec.pool_ref.name!r}, not {pool.metadata.name!r}",
                    "validate each member together with the KVCachePool it names",
                    rule=1,
                )
            )
        for path, engine, _ in _engines(member):
            if engine.block_size is not None and engine.block_size != pool.spec.block_size:
                out.append(
                    Problem(
                        where(member, f"{path}.blockSize"),
                        f"block size {engine.block_size} differs from the pool's "
                        f"{pool.spec.block_size}; the block size is part of the domain "
                        "fingerprint, so this instance would never share KV",
                        f"remove it (the pool's blockSize applies) or set it to "
                        f"{pool.spec.block_size}",
                        rule=1,
                    )
                )
            for arg in engine.args:
                flag = arg.split("=", 1)[0]
                if flag in _DOMAIN_FLAGS:
                    out.append(
                        Problem(
                            where(member, f"{path}.args"),
                            f"{flag} is derived by kvpool from the pool and member spec",
                            "remove it; set blockSize on the pool, tensorParallelSize, "
                            "maxModelLen or model in their own fields",
                            rule=1,
                        )
                    )
    return out


def rule2_ports(pool: KVCachePool, members: Members) -> list[Problem]:
    """Per-rank lists have exactly TP entries; no port is bound twice where pods share a node."""
    out: list[Problem] = []
    for member in members:
        if isinstance(member, P2PGroup) and member.spec.ports.instances is not None:
            spec = member.spec
            explicit = spec.ports.instances or []
            if len(explicit) != spec.replicas:
                out.append(
                    Problem(
                        where(member, "spec.ports.instances"),
                        f"{len(explicit)} explicit port sets for {spec.replicas} replicas",
                        "give one entry per instance, or remove ports.instances and let "
                        "kvpool allocate from ports.base",
                        rule=2,
                    )
                )
            for i, ports in enumerate(explicit):
                for key, values in (
                    ("workerPorts", ports.worker_ports),
                    ("initPorts", ports.init_ports),
                    ("lookupPorts", ports.lookup_ports),
                ):
                    if len(values) != spec.tensor_parallel_size:
                        out.append(
                            Problem(
                                where(member, f"spec.ports.instances[{i}].{key}"),
                                f"has {len(values)} ports but tensorParallelSize is "
                                f"{spec.tensor_parallel_size}: LMCache indexes it by TP rank",
                                f"list exactly {spec.tensor_parallel_size} ports",
                                rule=2,
                            )
                        )
        insts = member_instances(member)
        counts = Counter(p for inst in insts for p in inst.all_ports())
        dupes = sorted(p for p, n in counts.items() if n > 1)
        if dupes:
            out.append(
                Problem(
                    where(member, "spec.ports"),
                    f"ports {dupes} are used more than once",
                    "give every instance and rank distinct ports, or use ports.base",
                    rule=2,
                )
            )
        high = max((p for inst in insts for p in inst.all_ports()), default=0)
        if high > 65535:
            out.append(
                Problem(
                    where(member, "spec.ports.base"),
                    f"the allocated range ends at {high}, beyond 65535",
                    "lower ports.base or the number of replicas",
                    rule=2,
                )
            )
    shared = [m for m in members if m.spec.host_network]
    for i, a in enumerate(shared):
        for b in shared[i + 1 :]:
            a_lo, a_hi = member_port_range(a)
            b_lo, b_hi = member_port_range(b)
            if a_lo <= b_hi and b_lo <= a_hi:
                out.append(
                    Problem(
                        where(b, "spec.ports.base"),
                        f"port range {b_lo}-{b_hi} overlaps {a.kind}/{a.metadata.name}'s "
                        f"{a_lo}-{a_hi}; with hostNetwork both can land on one node",
                        f"move ports.base to {a_hi + 1} or above (or below {a_lo})",
                        rule=2,
                    )
                )
    for member in members:
        if isinstance(member, PDPair) and member.spec.proxy.port == pool.spec.gateway.port:
            out.append(
                Problem(
                    where(member, "spec.proxy.port"),
                    f"PD proxy port {member.spec.proxy.port} is the gateway's HTTP port",
                    "choose another proxy.port (default 7500)",
                    rule=2,
                )
            )
    return out


def rule3_instance_ids(pool: KVCachePool, members: Members) -> list[Problem]:
    """lmcache_instance_id (and the lmcache_rpc_port identifier) unique across the domain, and
    no two resources rendering objects of the same name (instance StatefulSets and Services,
    the member's Service and PDB, its LMCache ConfigMap, the pool's own objects)."""
    pool_owner = f"KVCachePool/{pool.metadata.name}"
    owners: dict[str, str] = {
        name: pool_owner
        for name in (
            names.controller_name(pool),
            names.gateway_name(pool),
            names.domain_configmap_name(pool),
            *(names.mooncake_name(pool, part) for part in ("master", "metadata", "store")),
        )
    }
    out: list[Problem] = []
    for member in sorted(members, key=lambda m: (m.kind, m.metadata.name)):
        owner = f"{member.kind}/{member.metadata.name}"
        rendered = [(inst.name, f"instance {inst.name!r}") for inst in member_instances(member)]
        rendered += [
            (member.metadata.name, f"its Service {member.metadata.name!r}"),
            (names.lmcache_configmap_name(member), "its LMCache ConfigMap"),
        ]
        for name, what in rendered:
            if name in owners and owners[name] != owner:
                out.append(
                    Problem(
                        where(member, "metadata.name"),
                        f"{what} has the name {name!r}, also rendered for {owners[name]}; "
                        "objects (and lmcache_instance_id / lmcache_rpc_port) would collide",
                        "rename one of the two resources",
                        rule=3,
                    )
                )
            owners.setdefault(name, owner)
    return out


def rule4_p2p_disk(pool: KVCachePool, members: Members) -> list[Problem]:
    """P2P and the local-disk tier are mutually exclusive in one domain (upstream bug)."""
    groups = [m for m in members if isinstance(m, P2PGroup)]
    if pool.spec.tiers.disk is None or not groups:
        return []
    names = ", ".join(g.metadata.name for g in groups)
    return [
        Problem(
            where(pool, "spec.tiers.disk"),
            f"the local disk tier is set and P2PGroup(s) {names} join this pool: P2P with "
            "the SSD tier has a known upstream bug (seed manual §5.3)",
            "remove tiers.disk from this pool, or run the P2P groups in a pool without disk",
            rule=4,
        )
    ]


def rule5_transfer(pool: KVCachePool, members: Members) -> list[Problem]:
    """Delay pull, HostStaging, channels and cache_policy: the combinations LMCache honours."""
    out: list[Problem] = []
    for member in members:
        if isinstance(member, PDPair):
            platform = member.spec.prefill.engine.platform
            channel = default_channel(platform, member.spec.transfer.channel)
            out += _channel_problem(member, "spec.transfer.channel", platform, channel)
            if platform != "ascend" and pd_sender_pull(member):
                out.append(
                    Problem(
                        where(member, "spec.transfer.mode"),
                        f"mode {member.spec.transfer.mode} needs LMCache-Ascend "
                        f"(pd_pull_mode); upstream LMCache on {platform} only pushes",
                        "use mode: push, or platform: ascend",
                        rule=5,
                    )
                )
            continue
        spec = member.spec
        t = spec.transfer
        platform = spec.engine.platform
        channel = default_channel(platform, t.channel)
        out += _channel_problem(member, "spec.transfer.channel", platform, channel)
        if platform != "ascend":
            for field, on in (
                ("pullMode", t.pull_mode),
                ("delayPull", t.delay_pull),
                ("useNPU", t.use_npu),
                ("hostStaging.enabled", t.host_staging.enabled),
            ):
                if on:
                    out.append(
                        Problem(
                            where(member, f"spec.transfer.{field}"),
                            f"is an LMCache-Ascend option; upstream LMCache on {platform} "
                            "ignores it",
                            "remove it, or use platform: ascend",
                            rule=5,
                        )
                    )
        if t.delay_pull and not (t.pull_mode and t.use_npu):
            missing = [n for n, v in (("pullMode", t.pull_mode), ("useNPU", t.use_npu)) if not v]
            out.append(
                Problem(
                    where(member, "spec.transfer.delayPull"),
                    f"delay pull needs {' and '.join(missing)}: LMCache-Ascend would silently "
                    "turn delay pull off",
                    "set pullMode: true and useNPU: true, or delayPull: false for an eager "
                    "CPU pull",
                    rule=5,
                )
            )
        if t.host_staging.enabled and channel != "hccl":
            out.append(
                Problem(
                    where(member, "spec.transfer.hostStaging.enabled"),
                    f"HostStaging needs transfer channel hccl, not {channel} (HIXL has none)",
                    "set transfer.channel: hccl or disable hostStaging",
                    rule=5,
                )
            )
        if t.host_staging.enabled and not t.pull_mode:
            out.append(
                Problem(
                    where(member, "spec.transfer.hostStaging.enabled"),
                    "HostStaging only works with a pull mode (delay+NPU or eager+CPU)",
                    "set transfer.pullMode: true",
                    rule=5,
                )
            )
        if platform != "ascend" and not spec.enable_async_loading:
            out.append(
                Problem(
                    where(member, "spec.enableAsyncLoading"),
                    f"upstream LMCache P2P on {platform} only finds peer KV through async "
                    "lookups (its synchronous contains() always misses)",
                    "set enableAsyncLoading: true",
                    rule=5,
                )
            )
        if spec.cache_policy is not None and not spec.enable_async_loading:
            out.append(
                Problem(
                    where(member, "spec.cachePolicy"),
                    "cachePolicy with P2P needs enableAsyncLoading, otherwise reads from a "
                    "peer's cache can fail under load (seed manual §5.3)",
                    "set enableAsyncLoading: true or remove cachePolicy",
                    rule=5,
                )
            )
    return out


def _channel_problem(
    member: P2PGroup | PDPair, path: str, platform: str, channel: str
) -> list[Problem]:
    allowed = {"ascend": ("hccl", "hixl"), "cuda": ("nixl",), "cpu": ("nixl",)}[platform]
    if channel in allowed:
        return []
    return [
        Problem(
            where(member, path),
            f"channel {channel} is not available on platform {platform}",
            f"use one of {', '.join(allowed)} (or leave it unset for {allowed[0]})",
            rule=5,
        )
    ]


def rule6_and_overrides(pool: KVCachePool, members: Members) -> list[Problem]:
    """p2p_pull_pending_ttl only from extra_config; overrides only of known, unmanaged keys."""
    out: list[Problem] = []
    for member in members:
        for path, engine, _ in _engines(member):
            for key in sorted(engine.lmcache_overrides):
                field = f"{path}.lmcacheOverrides.{key}"
                if key == "p2p_pull_pending_ttl":
                    out.append(
                        Problem(
                            where(member, field),
                            "LMCache-Ascend reads p2p_pull_pending_ttl only from "
                            "extra_config; the top-level key is ignored",
                            "remove it and set spec.transfer.pullPendingTTLSeconds (kvpool "
                            "renders it under extra_config)",
                            rule=6,
                        )
                    )
                elif key == "enable_p2p" and isinstance(member, PDPair):
                    out.append(
                        Problem(
                            where(member, field),
                            "PD and P2P on one instance is not supported",
                            "remove it; use a P2PGroup for P2P sharing",
                            rule=8,
                        )
                    )
                elif key in owned_lmcache_keys():
                    out.append(
                        Problem(
                            where(member, field),
                            f"{key} is derived by kvpool from the pool and member spec",
                            "remove it and set the corresponding spec field",
                        )
                    )
                elif key in ASCEND_ONLY_KEYS and engine.platform != "ascend":
                    out.append(
                        Problem(
                            where(member, field),
                            f"{key} is an LMCache-Ascend key; LMCache on {engine.platform} "
                            "ignores it",
                            "remove it, or use platform: ascend",
                        )
                    )
                elif key not in UPSTREAM_KEYS and key not in ASCEND_ONLY_KEYS:
                    out.append(
                        Problem(
                            where(member, field),
                            f"{key} is not a key of the pinned LMCache (0.5.6); LMCache "
                            "would ignore it silently",
                            "check the spelling against lmcache/v1/config.py",
                        )
                    )
    return out


def rule7_buffers(pool: KVCachePool, members: Members) -> list[Problem]:
    """Buffers hold at least one full chunk; warn on staging smaller than the expected hits."""
    out: list[Problem] = []
    for member in members:
        buffers: list[tuple[str, int, int]] = []
        if isinstance(member, P2PGroup):
            t, tp = member.spec.transfer, member.spec.tensor_parallel_size
            if t.host_staging.enabled:
                buffers.append(("spec.transfer.hostStaging.bytes", t.host_staging.bytes, tp))
            if member.spec.engine.platform == "ascend" and t.use_npu:
                buffers.append(("spec.transfer.npuBufferSize", t.npu_buffer_size, tp))
            hs = t.host_staging
            if hs.enabled and hs.expected_concurrent_requests and hs.expected_hit_tokens:
                need = (
                    hs.expected_concurrent_requests
                    * hs.expected_hit_tokens
                    * kv_bytes_per_token_per_rank(pool, tp)
                )
                if need > hs.bytes:
                    out.append(
                        Problem(
                            where(member, "spec.transfer.hostStaging.bytes"),
                            f"{format_bytes(hs.bytes)} holds less than "
                            f"{hs.expected_concurrent_requests} concurrent x "
                            f"{hs.expected_hit_tokens} hit tokens x "
                            f"{kv_bytes_per_token_per_rank(pool, tp)} B/token = "
                            f"{format_bytes(need)}; the rest of each hit is recomputed",
                            f"raise hostStaging.bytes to {format_bytes(need)} or more",
                            rule=7,
                            severity="warning",
                        )
                    )
        else:
            # The smaller TP size has more KV heads per rank, hence the larger per-rank chunk:
            # a buffer that holds it holds the other side's too.
            tp_prefill = member.spec.prefill.tensor_parallel_size
            tp = min(tp_prefill, member.spec.decode.tensor_parallel_size)
            buffers.append(("spec.transfer.bufferSize", member.spec.transfer.buffer_size, tp))
            if member.spec.transfer.mode == "cpu-offload-pull-delay":
                # pd_cpu_buffer_size is rendered for the sender (prefill) only.
                buffers.append(
                    (
                        "spec.transfer.cpuBufferSize",
                        member.spec.transfer.cpu_buffer_size,
                        tp_prefill,
                    )
                )
        for path, size, tp in buffers:
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
                    )
                )
    return out


def rule8_pd(pool: KVCachePool, members: Members) -> list[Problem]:
    """PD and P2P are not combined with use_layerwise; both PD sides run one platform."""
    out: list[Problem] = []
    for member in members:
        if member.spec.use_layerwise:
            kind = "P2P" if isinstance(member, P2PGroup) else "PD"
            out.append(
                Problem(
                    where(member, "spec.useLayerwise"),
                    f"{kind} with use_layerwise raises ValueError in LMCache(-Ascend)",
                    "set useLayerwise: false",
                    rule=8,
                )
            )
        if isinstance(member, PDPair):
            p, d = member.spec.prefill.engine.platform, member.spec.decode.engine.platform
            if p != d:
                out.append(
                    Problem(
                        where(member, "spec.decode.engine.platform"),
                        f"prefill runs on {p} but decode on {d}; the PD transfer channel "
                        "needs both sides on one platform",
                        f"set decode.engine.platform: {p}",
                        rule=8,
                    )
                )
    return out


def rule9_accelerators(pool: KVCachePool, members: Members) -> list[Problem]:
    """Accelerators requested >= TP size (the env of rule 9 is injected by construction)."""
    out: list[Problem] = []
    for member in members:
        for path, engine, tp in _engines(member):
            if engine.platform == "cpu":
                continue
            if not engine.accelerator():
                out.append(
                    Problem(
                        where(member, f"{path}.acceleratorResource"),
                        f"platform {engine.platform} needs an accelerator resource",
                        "remove the empty value to use the platform default",
                        rule=9,
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
                )
            )
            continue
        wrong = [
            f"{name}={value}"
            for name, value, want in (
                ("pullMode", t.pull_mode, True),
                ("delayPull", t.delay_pull, False),
                ("useNPU", t.use_npu, False),
                ("hostStaging.enabled", t.host_staging.enabled, True),
            )
            if value != want
        ]
        if wrong:
            out.append(
                Problem(
                    where(member, "spec.transfer"),
                    f"MLA with saveOnlyFirstRank needs an eager HostStaging CPU pull; "
                    f"got {', '.join(wrong)}",
                    "set pullMode: true, delayPull: false, useNPU: false, "
                    "hostStaging.enabled: true",
                    rule=10,
                )
            )
    return out
