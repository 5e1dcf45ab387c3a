"""Tier names, tier health and per-tier statistics over LMCache's storage backends.

Why this module exists: kvpool speaks of tiers (``local_cpu``, ``local_disk``, ``redis``,
``mooncake``) while LMCache names backends (``LocalCPUBackend``, ``LocalDiskBackend``,
``RemoteBackend``; the one table of them is :mod:`kvpool.protocol.tiers`). The agent memory
API, the metrics and the benchmark all use kvpool's names. A remote tier that stops answering
is bypassed through LMCache's own ``StorageManager.set_backend_bypass`` (with a warning and a
counter) and probed again later, so requests keep being served from the remaining tiers.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from lmcache.v1.config import LMCacheEngineConfig

from kvpool.protocol.tiers import BACKENDS, LOCAL_CPU, LOCAL_DISK

__all__ = [
    "BACKEND_OF_TIER",
    "LOCAL_CPU",
    "LOCAL_DISK",
    "REMOTE_BACKEND",
    "HealthProber",
    "RemoteHealth",
    "backend_for",
    "configured_tiers",
    "local_tier_stats",
    "remote_probe_address",
    "remote_tier_name",
    "tier_of_backend",
]

logger = logging.getLogger(__name__)

#: kvpool tier name -> LMCache backend name, for the worker's local tiers (the one table is
#: kvpool.protocol.tiers).
BACKEND_OF_TIER = {b.local_name: b.name for b in BACKENDS if b.local_name is not None}
REMOTE_BACKEND = next(b.name for b in BACKENDS if b.tier == "remote")
_ALIASES = {"cpu": LOCAL_CPU, "ddr": LOCAL_CPU, "disk": LOCAL_DISK, "ssd": LOCAL_DISK}


def remote_tier_name(remote_url: str | None) -> str | None:
    """``redis`` / ``mooncake`` / the URL scheme; None when no remote tier is configured."""
    if not remote_url:
        return None
    scheme = urlparse(remote_url).scheme
    if scheme in ("redis", "rediss", "valkey", "resp"):
        return "redis"
    if scheme.startswith("mooncake"):
        return "mooncake"
    return scheme or "remote"


def configured_tiers(config: LMCacheEngineConfig) -> list[str]:
    """The tiers of this config, fastest first (LMCache's backend order)."""
    tiers = [LOCAL_CPU]
    if config.local_disk:
        tiers.append(LOCAL_DISK)
    remote = remote_tier_name(config.remote_url)
    if remote is not None:
        tiers.append(remote)
    return tiers


def backend_for(tier: str, tiers: Iterable[str]) -> str:
    """LMCache backend name for a kvpool tier name (aliases allowed); ValueError if unknown."""
    name = _ALIASES.get(tier, tier)
    known = list(tiers)
    if name not in known and name != "remote":
        raise ValueError(
            f"locations: unknown tier {tier!r}; this worker has tiers {known} "
            "(aliases: cpu/ddr, disk/ssd, remote)"
        )
    return BACKEND_OF_TIER.get(name, REMOTE_BACKEND)


def tier_of_backend(backend: str, tiers: Iterable[str]) -> str:
    for tier, name in BACKEND_OF_TIER.items():
        if name == backend:
            return tier
    remote = [t for t in tiers if t not in BACKEND_OF_TIER]
    return remote[0] if remote else backend


def remote_probe_address(config: LMCacheEngineConfig) -> tuple[str, int] | None:
    """host:port to probe for the remote tier: the Redis URL, or Mooncake's master."""
    url = config.remote_url
    if not url:
        return None
    if url.startswith("mooncake"):
        extra = config.extra_config or {}
        master = extra.get("master_server_address") or extra.get("mooncake_master_server_address")
        if not master:
            return None
        host, _, port = str(master).rpartition(":")
        return host or "127.0.0.1", int(port)
    parsed = urlparse(url)
    if parsed.hostname is None or parsed.port is None:
        return None
    return parsed.hostname, parsed.port


@dataclass
class RemoteHealth:
    """Probe the remote tier with a TCP connect at most every ``interval_s``."""

    tier: str
    address: tuple[str, int]
    interval_s: float = 2.0
    timeout_s: float = 0.25
    up: bool = True
    errors: int = 0
    _last: float = float("-inf")

    def refresh(self, now: float | None = None) -> bool | None:
        """Probe when due. Returns the new state when it changed, else None."""
        now = time.monotonic() if now is None else now
        if now - self._last < self.interval_s:
            return None
        self._last = now
        try:
            with socket.create_connection(self.address, timeout=self.timeout_s):
                ok = True
        except OSError as e:
            ok = False
            if self.up:
                logger.warning(
                    "tier %s at %s:%d is unreachable (%s): skipping it until it answers",
                    self.tier,
                    *self.address,
                    e,
                )
        if not ok:
            self.errors += 1
        if ok == self.up:
            return None
        self.up = ok
        if ok:
            logger.warning("tier %s at %s:%d answers again: using it", self.tier, *self.address)
        return ok


class HealthProber:
    """Probes a remote tier on its own daemon thread, never on the engine's compute thread.

    A TCP connect to a dead host can take its whole timeout; on the compute thread that was
    added to a request's time to first token. ``on_change(up)`` is called from this thread
    when the tier goes down or comes back.
    """

    def __init__(self, health: RemoteHealth, on_change: Callable[[bool], None]) -> None:
        self.health = health
        self._on_change = on_change
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"kvpool-probe-{health.tier}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.health.interval_s):
            try:
                changed = self.health.refresh()
                if changed is not None:
                    self._on_change(changed)
            except Exception:
                logger.exception("probing tier %s failed", self.health.tier)

    def stop(self) -> None:
        self._stop.set()


def local_tier_stats(storage: Any, config: LMCacheEngineConfig) -> dict[str, dict[str, object]]:
    """Chunks, bytes, capacity of the local CPU and local disk tiers, read under their locks."""
    gib = 1024**3
    out: dict[str, dict[str, object]] = {}
    cpu = storage.storage_backends.get(BACKEND_OF_TIER[LOCAL_CPU])
    if cpu is not None:
        with cpu.cpu_lock:
            objs = list(cpu.hot_cache.values())
        out[LOCAL_CPU] = {
            "chunks": len(objs),
            "bytes": sum(o.get_size() for o in objs),
            "capacity_bytes": int(config.max_local_cpu_size * gib),
            "up": True,
            # chunks LMCache itself holds pinned (lookups, a peer's pull in flight)
            "lmcache_pinned": sum(1 for o in objs if o.is_pinned),
        }
    disk = storage.storage_backends.get(BACKEND_OF_TIER[LOCAL_DISK])
    if disk is not None:
        with disk.disk_lock:
            chunks = len(disk.dict)
        out[LOCAL_DISK] = {
            "chunks": chunks,
            "bytes": int(disk.usage),
            "capacity_bytes": int(config.max_local_disk_size * gib),
            "up": True,
        }
    return out
