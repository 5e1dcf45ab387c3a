"""From one instance's settings, environment and rendered LMCache config to a ``SimEngine``.

Why this module exists: ``kvpool-worker serve --engine sim`` and every instance of
``kvpool-worker host`` must build the simulated engine identically, from what was passed to
them and nothing else (``host`` runs many instances in one process: no ``os.environ``). The
contract checks (rule 9 environment, fingerprint, instance id) have already run in
``kvpool.worker.cli``; this adds the sim's own: the profile, the pool's model shape, what of the
LMCache config it models, and the hashing regime of the reference engine (LMCache without vLLM,
with the config's chunk size, hash algorithm and ``save_unfull_chunk``).
"""

from __future__ import annotations

import functools
import ipaddress
import socket
from collections.abc import Mapping
from typing import Any

from kvpool.protocol.chat import TextTokenizer
from kvpool.protocol.hashing import HashConfig, HashConfigError
from kvpool.worker.contract import Problem
from kvpool.worker.settings import WorkerSettings
from kvpool.worker.sim.config import (
    SimConfigError,
    SimShape,
    instance_config,
    instance_name,
    lmcache_view,
    load_profile,
)
from kvpool.worker.sim.engine import SimEngine
from kvpool.worker.sim.kv_events import DeviceEventPublisher, parse_kv_events_config
from kvpool.worker.sim.lmcache_client import ControllerClient

__all__ = ["SimConfigError", "build_sim_engine", "ordinary_token_ids", "worker_ip"]


@functools.lru_cache(maxsize=8)
def ordinary_token_ids(tokenizer: TextTokenizer) -> tuple[int, ...]:
    """Every id of the vocabulary except the special tokens (shared by hosted instances)."""
    special = tokenizer.special_token_ids()
    return tuple(i for i in range(tokenizer.vocab_size) if i not in special)


def _default_route_ip() -> str:
    """LMCache's ``get_ip()``: the source address towards 8.8.8.8 (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("8.8.8.8", 80))
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def worker_ip(bind_host: str, env: Mapping[str, str]) -> str:
    """The address others dial (the controller for commands, a router for KV events): the bind
    address when it is one, else the pod's (``POD_IP``), else LMCache's default-route address."""
    try:
        if not ipaddress.ip_address(bind_host).is_unspecified:
            return bind_host
    except ValueError:
        if bind_host not in ("", "*"):
            return bind_host
    return env.get("POD_IP") or _default_route_ip()


def build_sim_engine(
    settings: WorkerSettings,
    env: Mapping[str, str],
    tokenizer: TextTokenizer,
    config: Mapping[str, Any] | None,
) -> SimEngine:
    """The engine (with its controller client when the config enables the controller);
    SimConfigError lists what to fix."""
    lmc = lmcache_view(config) if config is not None else None
    profile = load_profile(settings.sim_profile)
    events = parse_kv_events_config(settings.kv_events_config)
    shape = SimShape(
        num_layers=settings.num_layers,
        num_kv_heads=settings.num_kv_heads,
        head_dim=settings.head_dim,
        kv_dtype=settings.kv_dtype,
        block_size=settings.block_size,
        max_model_len=settings.max_model_len,
        device_kv_gib=settings.sim_device_kv_gib,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        tensor_parallel_size=settings.tensor_parallel_size,
    )
    inst = instance_config(profile, shape, lmc, settings.model)
    try:
        hashing = HashConfig(
            chunk_size=inst.chunk_size,
            hash_algorithm=lmc.hash_algorithm if lmc is not None else "builtin",
            save_unfull_chunk=lmc.save_unfull_chunk if lmc is not None else False,
            vllm=False,  # the reference engine's regime: LMCache without vLLM
        )
    except HashConfigError as exc:
        key = "pre_caching_hash_algorithm" if exc.field == "hash_algorithm" else exc.field
        raise SimConfigError([Problem(key, exc.reason, "re-render the config")]) from exc
    engine = SimEngine(
        instance_name(lmc, f"{settings.host}:{settings.port}"),
        inst,
        model_name=settings.model,
        hashing=hashing,
        vocab=ordinary_token_ids(tokenizer),
        vocab_size=tokenizer.vocab_size,
        speedup=settings.sim_speedup,
        p2p=lmc.p2p if lmc is not None else False,
        cpu_bytes=lmc.cpu_bytes if lmc is not None and lmc.local_cpu else 0,
        disk_bytes=lmc.disk_bytes if lmc is not None else 0,
        worker_port=lmc.controller.worker_port if lmc is not None and lmc.controller else 0,
        controller_wait_s=settings.controller_wait_s,
    )
    if events is not None and events.enabled:
        engine.kv_events = DeviceEventPublisher(
            events,
            block_size=inst.block_size,
            chunk_size=inst.chunk_size,
            bind_host=settings.host,
            advertise_host=worker_ip(settings.host, env),
        )
    if lmc is not None and lmc.controller is not None:
        engine.client = ControllerClient(
            lmc.controller,
            instance_id=lmc.instance_id,
            ip=worker_ip(settings.host, env),
            bind_host=settings.host,
            peer_init_url=lmc.peer_init_url,
            control=engine.memory,
            sync_keys=engine.ddr_keys,
            set_frozen=engine.set_frozen,
        )
    return engine
