"""What the simulated engine reads of the rendered LMCache config and of its flags (pure).

Why this module exists: a simulated worker must size its tiers, reach the controller and time
its protocol exactly as a real LMCache 0.5.6 worker given the same rendered config would
(defaults included: LMCache's ``config.py``, ``batched_message_sender.py``,
``full_sync_sender.py``), and it must refuse what it does not model instead of silently
serving something else (a remote tier, PD, CacheBlend). Every refusal names the key or the
flag and the fix. No I/O except reading a profile file named by ``--sim-profile``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpool.protocol.domain import split_instance_id
from kvpool.protocol.hashing import DEFAULT_CHUNK_SIZE, DEFAULT_HASH_ALGORITHM
from kvpool.protocol.simcore.instance import InstanceConfig
from kvpool.protocol.simcore.profile import (
    ModelShape,
    PerfProfile,
    ProfileError,
    bundled_profile,
    bundled_profiles,
    parse_profile,
)
from kvpool.worker.contract import Problem

GIB = 1024**3
PAGE = 4096  # LMCache's allocator hands out 4 KiB-aligned buffers, one per chunk


class SimConfigError(ValueError):
    """The simulated engine cannot run this configuration; ``problems`` say what to fix."""

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__("; ".join(str(p) for p in problems))
        self.problems = problems


@dataclass(frozen=True)
class FullSyncParams:
    """LMCache's ``FullSyncSender`` knobs (``extra_config``), with its defaults."""

    batch_size: int = 2000
    batch_interval_s: float = 0.005
    startup_delay_s: float = 5.0
    poll_interval_s: float = 5.0
    max_retry: int = 3
    retry_delay_s: float = 1.0
    max_polls: int = 60


@dataclass(frozen=True)
class ControllerLink:
    """How this worker reaches the controller (``enable_controller``)."""

    pull_url: str  # host:port of the controller's PULL socket
    reply_url: str  # host:port of its ROUTER
    worker_port: int  # the REP socket this worker binds (lmcache_worker_ports[0])
    heartbeat_delay_s: float = 10.0
    heartbeat_s: float | None = None  # None: LMCache sends no heartbeats
    recv_timeout_s: float = 30.0
    kv_batch_size: int = 50
    kv_batch_timeout_s: float = 0.01
    full_sync: FullSyncParams = field(default_factory=FullSyncParams)


@dataclass(frozen=True)
class LmcacheView:
    """The rendered LMCache config as the simulated engine models it."""

    instance_id: str
    chunk_size: int = DEFAULT_CHUNK_SIZE
    hash_algorithm: str = DEFAULT_HASH_ALGORITHM
    save_unfull_chunk: bool = False
    local_cpu: bool = True
    cpu_bytes: int = int(5.0 * GIB)
    disk_bytes: int = 0  # 0: no LocalDiskBackend
    async_loading: bool = False
    p2p: bool = False
    peer_init_url: str | None = None
    controller: ControllerLink | None = None


class _Reader:
    """Typed reads of config keys; a wrong type is a problem naming the key."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.config = config
        self.problems: list[Problem] = []

    def get(self, key: str, default: Any, kind: type | tuple[type, ...], *aliases: str) -> Any:
        value = self.config.get(key)
        for alias in aliases:
            if value is None:
                value = self.config.get(alias)
        if value is None:
            return default
        ok = isinstance(value, kind) and not (isinstance(value, bool) and bool not in _kinds(kind))
        if not ok:
            self.problems.append(
                Problem(key, f"must be {_kind_name(kind)}, got {value!r}", "re-render the config")
            )
            return default
        return value

    def extra(self, key: str, default: float) -> float:
        extra = self.config.get("extra_config") or {}
        value = extra.get(key, default) if isinstance(extra, Mapping) else default
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            self.problems.append(
                Problem(f"extra_config.{key}", f"must be a number >= 0, got {value!r}", "fix it")
            )
            return default
        return float(value)

    def refuse(self, key: str, message: str, fix: str) -> None:
        self.problems.append(Problem(key, message, fix))


def _kinds(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in _kinds(kind))


def _ports(r: _Reader, key: str, *aliases: str) -> list[int]:
    value = r.get(key, None, (list, int), *aliases)
    ports = [value] if isinstance(value, int) else list(value or [])
    if not ports or not all(isinstance(p, int) and 0 < p < 65536 for p in ports):
        r.refuse(key, f"must be a non-empty list of TCP ports, got {value!r}", "re-render it")
        return []
    return ports


def lmcache_view(config: Mapping[str, Any]) -> LmcacheView:
    """Read and check the rendered config; SimConfigError lists every problem."""
    r = _Reader(config)
    instance_id = str(r.get("lmcache_instance_id", "", str))
    if r.get("remote_url", None, str):
        r.refuse(
            "remote_url",
            "the simulated engine models local tiers and P2P, not a remote store",
            "remove tiers.remote from the KVCachePool (or run this pool with engine reference)",
        )
    if r.get("enable_pd", False, bool, "enable_xpyd"):
        r.refuse(
            "enable_pd",
            "PD is not simulated",
            "run the PDPair with engine reference (cpu) or vllm, not sim",
        )
    if r.get("enable_kv_events", False, bool):
        r.refuse(
            "enable_kv_events",
            "LMCache's own KV events (one BlockStored per stored chunk) are not simulated; the "
            "simulated engine publishes vLLM's device events (--kv-events-config)",
            "set enable_kv_events: false",
        )
    for key in ("enable_blending", "use_layerwise"):
        if r.get(key, False, bool):
            r.refuse(key, "is not simulated (the profile times whole-chunk stores)", "set false")
    p2p = bool(r.get("enable_p2p", False, bool))
    async_loading = bool(r.get("enable_async_loading", False, bool))
    if p2p and not async_loading:
        r.refuse(
            "enable_async_loading",
            "must be true with enable_p2p (LMCache's P2P backend answers lookups only "
            "asynchronously)",
            "set enable_async_loading: true",
        )
    peer_init_url = None
    if p2p:
        host = r.get("p2p_host", None, str)
        init = _ports(r, "p2p_init_ports")
        if not host:
            r.refuse("p2p_host", "is required with enable_p2p", "re-render the config")
        elif init:
            peer_init_url = f"{host}:{init[0]}"
    local_disk = r.get("local_disk", None, str)
    disk_gb = float(r.get("max_local_disk_size", 0.0, (int, float)))
    view = LmcacheView(
        instance_id=instance_id,
        chunk_size=int(r.get("chunk_size", DEFAULT_CHUNK_SIZE, int)),
        hash_algorithm=str(r.get("pre_caching_hash_algorithm", DEFAULT_HASH_ALGORITHM, str)),
        save_unfull_chunk=bool(r.get("save_unfull_chunk", False, bool)),
        local_cpu=bool(r.get("local_cpu", True, bool)),
        cpu_bytes=int(float(r.get("max_local_cpu_size", 5.0, (int, float))) * GIB),
        disk_bytes=int(disk_gb * GIB) if local_disk and disk_gb > 0 else 0,
        async_loading=async_loading,
        p2p=p2p,
        peer_init_url=peer_init_url,
        controller=_controller(r) if r.get("enable_controller", False, bool) else None,
    )
    if r.problems:
        raise SimConfigError(r.problems)
    return view


def _controller(r: _Reader) -> ControllerLink | None:
    pull = r.get("controller_pull_url", None, str, "controller_url")
    reply = r.get("controller_reply_url", None, str)
    for key, value in (("controller_pull_url", pull), ("controller_reply_url", reply)):
        if not value:
            r.refuse(key, "is required with enable_controller", "re-render the config")
    ports = _ports(r, "lmcache_worker_ports", "lmcache_worker_port")
    beat = r.get("lmcache_worker_heartbeat_time", None, (int, float))
    defaults = FullSyncParams()
    full_sync = FullSyncParams(
        batch_size=max(1, int(r.extra("full_sync_batch_size", defaults.batch_size))),
        batch_interval_s=r.extra("full_sync_batch_interval_ms", 5) / 1000.0,
        startup_delay_s=r.extra("full_sync_startup_delay_s", defaults.startup_delay_s),
        poll_interval_s=r.extra("full_sync_status_poll_interval_s", defaults.poll_interval_s),
        max_retry=int(r.extra("full_sync_max_retry_count", defaults.max_retry)),
        retry_delay_s=r.extra("full_sync_retry_delay_s", defaults.retry_delay_s),
        max_polls=int(r.extra("full_sync_max_poll_attempts", defaults.max_polls)),
    )
    if not pull or not reply or not ports:
        return None
    return ControllerLink(
        pull_url=str(pull),
        reply_url=str(reply),
        worker_port=ports[0],
        heartbeat_delay_s=float(r.get("lmcache_worker_heartbeat_delay_time", 10, (int, float))),
        heartbeat_s=float(beat) if beat is not None and beat > 0 else None,
        recv_timeout_s=r.extra("worker_socket_recv_timeout_ms", 30000) / 1000.0,
        kv_batch_size=max(1, int(r.extra("kv_msg_batch_size", 50))),
        kv_batch_timeout_s=r.extra("kv_msg_batch_timeout", 0.01),
        full_sync=full_sync,
    )


def chunk_capacity(nbytes: int, chunk_bytes: int) -> int:
    """Chunks of ``chunk_bytes`` that fit in ``nbytes`` (LMCache aligns each to 4 KiB)."""
    if chunk_bytes <= 0:
        return 0
    return nbytes // (-(-chunk_bytes // PAGE) * PAGE)


def load_profile(spec: str | None) -> PerfProfile:
    """``--sim-profile``: a bundled profile's name, or the path of a profile file."""
    choices = ", ".join(bundled_profiles())
    if not spec:
        raise SimConfigError(
            [Problem("--sim-profile", "is required with --engine sim", f"name one of {choices}")]
        )
    path = Path(spec)
    try:
        if path.suffix == ".json" or path.is_file():
            return parse_profile(path.read_bytes(), str(path))
        return bundled_profile(spec)
    except (ProfileError, OSError) as exc:
        fix = "pass a bundled profile's name or a profile file's path (protocol/README.md)"
        raise SimConfigError([Problem("--sim-profile", str(exc), fix)]) from exc


@dataclass(frozen=True)
class SimShape:
    """The pool's model (KV bytes per token) and the engine limits, from the flags."""

    num_layers: int | None
    num_kv_heads: int | None
    head_dim: int | None
    kv_dtype: str
    block_size: int
    max_model_len: int
    device_kv_gib: float | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    tensor_parallel_size: int = 1


def instance_config(
    profile: PerfProfile, shape: SimShape, lmc: LmcacheView | None, model: str
) -> InstanceConfig:
    """The simcore instance for this worker; SimConfigError naming each flag to fix."""
    problems: list[Problem] = []
    for flag, value in (
        ("--num-layers", shape.num_layers),
        ("--num-kv-heads", shape.num_kv_heads),
        ("--head-dim", shape.head_dim),
    ):
        if value is None:
            problems.append(
                Problem(flag, "is required with --engine sim", "pass the pool model's value")
            )
    if shape.tensor_parallel_size != 1:
        problems.append(
            Problem(
                "--tensor-parallel-size",
                f"is {shape.tensor_parallel_size}; the simulated engine is one LMCache worker "
                "(TP rank 0); its profile times the whole instance",
                "set it to 1",
            )
        )
    kv_bytes = 0
    if not problems:
        assert shape.num_layers and shape.num_kv_heads and shape.head_dim
        try:
            kv_bytes = ModelShape(
                model, shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.kv_dtype
            ).kv_bytes_per_token()
        except ProfileError as exc:
            problems.append(Problem("--kv-dtype", str(exc), "pass one of those dtypes"))
    chunk = lmc.chunk_size if lmc is not None else DEFAULT_CHUNK_SIZE
    if chunk % shape.block_size:
        problems.append(
            Problem(
                "--block-size",
                f"{shape.block_size} does not divide chunk_size {chunk}",
                "use the pool's block size (a divisor of its chunk size)",
            )
        )
    if problems:
        raise SimConfigError(problems)
    gib = shape.device_kv_gib if shape.device_kv_gib is not None else profile.device_kv_gib
    device_blocks = int(gib * GIB // (kv_bytes * shape.block_size))
    lmcache = lmc is not None
    cpu = lmc.cpu_bytes if lmc is not None and lmc.local_cpu else 0
    disk = lmc.disk_bytes if lmc is not None else 0
    config = InstanceConfig(
        profile=profile,
        chunk_size=chunk,
        block_size=shape.block_size,
        kv_bytes_per_token=kv_bytes,
        device_blocks=device_blocks,
        ddr_chunks=chunk_capacity(cpu, chunk * kv_bytes),
        disk_chunks=chunk_capacity(disk, chunk * kv_bytes),
        max_num_seqs=shape.max_num_seqs or profile.max_num_seqs,
        max_num_batched_tokens=shape.max_num_batched_tokens or profile.max_num_batched_tokens,
        max_model_len=shape.max_model_len,
        lmcache=lmcache,
        touch_on_hit=not (lmc is not None and lmc.async_loading),
    )
    if -(-shape.max_model_len // shape.block_size) > device_blocks:
        raise SimConfigError(
            [
                Problem(
                    "--sim-device-kv-gib",
                    f"{gib} GiB holds {device_blocks} blocks of {shape.block_size} tokens, "
                    f"fewer than one --max-model-len {shape.max_model_len} request needs",
                    "raise --sim-device-kv-gib or lower --max-model-len",
                )
            ]
        )
    return config


def instance_name(lmc: LmcacheView | None, fallback: str) -> str:
    """The instance's name (logs, ``/get_server_info``): the part of lmcache_instance_id before
    the fingerprint; ``fallback`` (unique per worker, e.g. its address) without one."""
    if lmc is None or not lmc.instance_id:
        return fallback
    name, _ = split_instance_id(lmc.instance_id)
    return name or lmc.instance_id
