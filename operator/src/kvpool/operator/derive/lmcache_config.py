"""Per-instance LMCache YAML (as dicts), with the pinned LMCache version's real keys.

Why: LMCache logs and ignores unknown keys, so a misspelt or wrong-version key silently changes
nothing. Upstream keys are listed from lmcache 0.5.6's ``_CONFIG_DEFINITIONS`` (the e2e test
checks the list against the installed package); LMCache-Ascend's additional keys are rendered
only for the ascend platform and are checked against their own explicit list.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvpool.operator.api.members import P2PGroup, PDPair
from kvpool.operator.api.pool import KVCachePool
from kvpool.operator.derive import names
from kvpool.operator.derive.platform import (
    default_channel,
    default_pd_buffer_device,
    pd_bypass_ratio,
    pd_delay_pull,
    pd_sender_pull,
)
from kvpool.operator.derive.ports import InstancePorts, pd_decoder_worker_ports
from kvpool.operator.quantity import GIB
from kvpool.protocol.domain import instance_id
from kvpool.protocol.pd import UNCLAIMED_TTL_KEY

#: Top-level keys of lmcache 0.5.6 ``lmcache.v1.config._CONFIG_DEFINITIONS`` that kvpool may render
#: or accept as overrides (the e2e test asserts each one exists in the installed LMCache).
UPSTREAM_KEYS: frozenset[str] = frozenset(
    [
        "chunk_size",
        "local_cpu",
        "max_local_cpu_size",
        "local_cpu_use_hugepages",
        "reserve_local_cpu_size",
        "local_disk",
        "local_disk_path_sharding",
        "max_local_disk_size",
        "remote_url",
        "remote_serde",
        "use_layerwise",
        "save_decode_cache",
        "pre_caching_hash_algorithm",
        "enable_blending",
        "blend_recompute_ratios",
        "blend_thresholds",
        "blend_check_layers",
        "blend_min_tokens",
        "blend_special_str",
        "retrieve_locations",
        "store_location",
        "enable_p2p",
        "p2p_host",
        "p2p_init_ports",
        "p2p_lookup_ports",
        "enable_controller",
        "lmcache_instance_id",
        "controller_pull_url",
        "controller_reply_url",
        "lmcache_worker_ports",
        "lmcache_worker_ids",
        "lmcache_worker_heartbeat_delay_time",
        "lmcache_worker_heartbeat_time",
        "enable_pd",
        "pd_role",
        "pd_buffer_size",
        "pd_buffer_device",
        "pd_peer_host",
        "pd_peer_init_port",
        "pd_peer_alloc_port",
        "pd_peer_query_port",
        "pd_proxy_host",
        "pd_proxy_port",
        "pd_allocation_timeout_sec",
        "pd_shutdown_timeout_sec",
        "pd_max_prefill_len",
        "pd_backend_mode",
        "pd_skip_proxy_notification",
        "transfer_channel",
        "nixl_backends",
        "nixl_buffer_size",
        "nixl_buffer_device",
        "internal_api_server_host",
        "extra_config",
        "save_unfull_chunk",
        "blocking_timeout_secs",
        "py_enable_gc",
        "cache_policy",
        "numa_mode",
        "enable_async_loading",
        "internal_api_server_enabled",
        "internal_api_server_port_start",
        "priority_limit",
        "lookup_timeout_ms",
        "min_retrieve_tokens",
        "enable_kv_events",
    ]
)

#: Keys LMCache-Ascend adds to the config (reference/lmcache-and-ascend.md §3 and the seed
#: manual); rendered only for platform ascend.
ASCEND_ONLY_KEYS: frozenset[str] = frozenset(
    [
        "p2p_use_npu",
        "p2p_npu_buffer_size",
        "p2p_pull_mode",
        "p2p_delay_pull",
        "pd_pull_mode",
        "pd_delay_pull",
        "pd_pull_done_port",
        "pd_pull_pending_ttl",
        "pd_use_cpu_offload",
        "pd_cpu_buffer_size",
        "store_async",
        "store_async_max_queue_size",
    ]
)

WORKER_SOCKET_RECV_TIMEOUT_MS = 3000


def full_sync_timing(pool: KVCachePool) -> dict[str, float]:
    """LMCache's full-sync timing from ``spec.controller.fullSync`` (extra_config keys).

    After a controller restart that lost its index every worker resends its keys (LMCache's
    full sync) and drops every store from the start of its sync until a status poll finds it
    complete (its freeze). lmcache 0.5.6 (``FullSyncSender``) first waits a random 0 to
    ``full_sync_startup_delay_s`` (default 5 s; not frozen yet: it spreads the domain's syncs),
    then freezes, sends its keys and polls every ``full_sync_status_poll_interval_s`` (default
    5 s), so each worker is frozen at least 5 s whatever the domain's size. kvpool's defaults
    (0.5 s and 0.5 s) are fixed, not derived from the member's size: a value that changed with
    the replica count would change every instance's config on a scale-up and roll them all. A
    thousand workers starting their syncs within 0.5 s send the controller a few thousand small
    messages and their keys in 2000-key batches, well within what it ingests
    (controller/README.md, benchmark). Measured on the cpu-demo domain: e2e/README.md, "The
    freeze window".
    """
    sync = pool.spec.controller.full_sync
    return {
        "full_sync_startup_delay_s": sync.startup_delay_seconds,
        "full_sync_status_poll_interval_s": sync.status_poll_interval_seconds,
    }


def _gb(size: int) -> float:
    """LMCache sizes local tiers in GiB floats (size * 1024**3 bytes)."""
    return round(size / GIB, 6)


def _tiers(pool: KVCachePool, instance: str, *, local_cpu: bool) -> dict[str, Any]:
    """The tiers of an instance: with ``local_cpu`` the pool's CPU, disk and remote tiers,
    without it (a PD instance, ``platform.carries_pool_tiers``) none."""
    spec = pool.spec
    ns = pool.metadata.namespace
    cfg: dict[str, Any] = {"local_cpu": local_cpu}
    if not local_cpu:
        return cfg
    cfg["max_local_cpu_size"] = _gb(spec.tiers.cpu.size)
    if spec.tiers.disk is not None:
        cfg["local_disk"] = f"file://{spec.tiers.disk.path.rstrip('/')}/"
        cfg["max_local_disk_size"] = _gb(spec.tiers.disk.size)
    remote = spec.tiers.remote
    if remote is not None and remote.redis is not None:
        cfg["remote_url"] = remote.redis.url
        cfg["remote_serde"] = remote.serde
    elif remote is not None and remote.mooncake is not None:
        mc = remote.mooncake
        master = names.service_host(names.mooncake_name(pool, "master"), ns)
        metadata = names.service_host(names.mooncake_name(pool, "metadata"), ns)
        cfg["remote_url"] = f"mooncakestore://{master}:{mc.master_port}/"
        cfg["remote_serde"] = remote.serde
        cfg["extra_config"] = {
            "local_hostname": names.instance_pod_host(instance, ns),
            "metadata_server": f"http://{metadata}:{mc.metadata_port}/metadata",
            "master_server_address": f"{master}:{mc.master_port}",
            # mooncake-transfer-engine 0.3.13's dict setup reads master_server_addr; LMCache
            # forwards "mooncake_"-prefixed extra keys, so without this the client retries the
            # default master for ~45 s and fails (found by the worker's Mooncake tier tests).
            "mooncake_master_server_addr": f"{master}:{mc.master_port}",
            "protocol": mc.protocol,
            "device_name": mc.device_name,
            "global_segment_size": 0,
            "local_buffer_size": mc.local_buffer_size,
        }
    return cfg


def _common(pool: KVCachePool, inst: InstancePorts, fingerprint: str) -> dict[str, Any]:
    return {
        "chunk_size": pool.spec.chunk_size,
        "pre_caching_hash_algorithm": pool.spec.hash_algorithm,
        "lmcache_instance_id": instance_id(inst.name, fingerprint),
    }


def _controller(pool: KVCachePool, inst: InstancePorts) -> dict[str, Any]:
    host = names.service_host(names.controller_name(pool), pool.metadata.namespace)
    ports = pool.spec.controller.ports
    return {
        "enable_controller": True,
        "controller_pull_url": f"{host}:{ports.pull}",
        "controller_reply_url": f"{host}:{ports.reply}",
        "lmcache_worker_ports": inst.lists["lmcache_worker_ports"],
        "lmcache_worker_heartbeat_time": pool.spec.controller.health_check_interval_seconds,
    }


def p2p_config(
    pool: KVCachePool, group: P2PGroup, inst: InstancePorts, fingerprint: str
) -> dict[str, Any]:
    """kvpool's LMCache settings of one P2P-group instance (kv_both, registered with the
    controller; with ``p2p: false`` no P2P key at all); every key returned is owned by kvpool
    (see derive/ownership.py for the overrides)."""
    spec = group.spec
    platform = spec.engine.platform
    transfer = spec.transfer
    channel = default_channel(platform, transfer.channel)
    ns = pool.metadata.namespace
    cfg = _common(pool, inst, fingerprint)
    cfg.update(_tiers(pool, inst.name, local_cpu=True))
    cfg.update(_controller(pool, inst))
    cfg["enable_async_loading"] = spec.enable_async_loading
    cfg["use_layerwise"] = spec.use_layerwise
    if spec.cache_policy is not None:
        cfg["cache_policy"] = spec.cache_policy
    extra: dict[str, Any] = dict(cfg.get("extra_config", {}))
    # LMCache's default (30 s) keeps a worker waiting on a heartbeat that was in flight when
    # the controller died; with 3 s the worker re-registers and full-syncs within seconds
    # (measured by the controller's recovery benchmark).
    extra["worker_socket_recv_timeout_ms"] = WORKER_SOCKET_RECV_TIMEOUT_MS
    extra.update(full_sync_timing(pool))
    if spec.save_only_first_rank:
        extra["save_only_first_rank"] = True
    if spec.p2p:
        cfg.update(
            {
                "enable_p2p": True,
                "p2p_host": names.instance_pod_host(inst.name, ns),
                "p2p_init_ports": inst.lists["p2p_init_ports"],
                "p2p_lookup_ports": inst.lists["p2p_lookup_ports"],
                "transfer_channel": channel,
            }
        )
        if channel == "nixl":
            cfg["nixl_backends"] = ["UCX"]
    if spec.p2p and platform == "ascend":
        cfg.update(
            {
                "p2p_use_npu": transfer.use_npu,
                "p2p_pull_mode": transfer.pull_mode,
                "p2p_delay_pull": transfer.delay_pull,
                "p2p_npu_buffer_size": transfer.npu_buffer_size,
            }
        )
        extra["p2p_pull_pending_ttl"] = transfer.pull_pending_ttl_seconds
        extra["lookup_backoff_time"] = transfer.lookup_backoff_seconds
        extra["use_host_staging"] = transfer.host_staging.enabled
        if transfer.host_staging.enabled:
            extra["os_staging_bytes"] = transfer.host_staging.bytes
    if extra:
        cfg["extra_config"] = dict(sorted(extra.items()))
    return dict(sorted(cfg.items()))


def pd_config(
    pool: KVCachePool, pair: PDPair, inst: InstancePorts, fingerprint: str
) -> dict[str, Any]:
    """kvpool's LMCache settings of one prefill (sender) or decode (receiver) instance."""
    spec = pair.spec
    role = spec.prefill if inst.role == "prefill" else spec.decode
    platform = role.engine.platform
    transfer = spec.transfer
    channel = default_channel(platform, transfer.channel)
    ns = pool.metadata.namespace
    cfg = _common(pool, inst, fingerprint)
    cfg.update(_tiers(pool, inst.name, local_cpu=False))
    cfg.update(
        {
            "enable_pd": True,
            "transfer_channel": channel,
            "pd_buffer_size": transfer.buffer_size,
            "pd_buffer_device": default_pd_buffer_device(pair),
            "use_layerwise": spec.use_layerwise,
        }
    )
    if channel == "nixl":
        cfg["nixl_backends"] = ["UCX"]
    pull = pd_sender_pull(pair)
    delay = pd_delay_pull(pair)
    if inst.role == "prefill":
        gateway = names.service_host(names.gateway_name(pool), ns)
        cfg.update(
            {
                "pd_role": "sender",
                "pd_proxy_host": gateway,
                "pd_proxy_port": spec.proxy.port,
                "save_unfull_chunk": True,
            }
        )
        if platform == "ascend":
            # LMCache-Ascend's sender binds its Done socket on pd_peer_host (seed manual §4.2).
            cfg["pd_peer_host"] = names.instance_pod_host(inst.name, ns)
            cfg["pd_pull_mode"] = pull
            cfg["pd_delay_pull"] = delay
            cfg["pd_use_cpu_offload"] = transfer.mode == "cpu-offload-pull-delay"
            if pull:
                cfg["pd_pull_done_port"] = inst.lists["pd_pull_done_port"]
                cfg["pd_pull_pending_ttl"] = transfer.pull_pending_ttl_seconds
            if transfer.mode == "cpu-offload-pull-delay":
                cfg["pd_cpu_buffer_size"] = transfer.cpu_buffer_size
    else:
        cfg.update(
            {
                "pd_role": "receiver",
                "pd_peer_host": names.instance_pod_host(inst.name, ns),
                "pd_peer_init_port": inst.lists["pd_peer_init_port"],
                "pd_peer_alloc_port": inst.lists["pd_peer_alloc_port"],
            }
        )
        if platform == "ascend":
            cfg["pd_pull_mode"] = pull
            cfg["pd_delay_pull"] = delay
        if platform == "cpu":  # kvpool's reference engine frees transfers nobody claims
            extra = dict(cfg.get("extra_config", {}))
            extra[UNCLAIMED_TTL_KEY] = transfer.unclaimed_ttl_seconds
            cfg["extra_config"] = dict(sorted(extra.items()))
        if pd_bypass_ratio(pool, pair) > 0:
            _keep_on_decoder(cfg, pool, pair, inst)
    return dict(sorted(cfg.items()))


def _keep_on_decoder(
    cfg: dict[str, Any], pool: KVCachePool, pair: PDPair, inst: InstancePorts
) -> None:
    """A decoder the gateway may bypass to (spec.gateway.pd.bypassMinCachedRatio): the pool's
    CPU tier, where it keeps each request it finished (worker ``pd_keep``; LMCache 0.5.6 builds
    a LocalCPUBackend beside the PD backend when ``local_cpu`` is true), and a registration with
    the controller, so the index knows what it holds (its worker ports:
    ``ports.pd_decoder_worker_ports``; validation refuses a block without room for them)."""
    worker_ports = pd_decoder_worker_ports(pair, inst)
    if worker_ports is None:
        raise ValueError(f"{inst.name}: no room for lmcache_worker_ports (validation refuses it)")
    cfg.update(local_cpu=True, max_local_cpu_size=_gb(pool.spec.tiers.cpu.size))
    cfg.update(_controller(pool, replace(inst, lists={"lmcache_worker_ports": worker_ports})))
    extra = dict(cfg.get("extra_config", {}))
    extra["worker_socket_recv_timeout_ms"] = WORKER_SOCKET_RECV_TIMEOUT_MS
    extra.update(full_sync_timing(pool))
    cfg["extra_config"] = dict(sorted(extra.items()))
