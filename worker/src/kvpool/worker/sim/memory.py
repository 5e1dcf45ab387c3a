"""The simulated engine's cache operations: the agent memory API and the controller's commands.

Why this module exists: ``/memory/evict|prefetch|pin|unpin|stats`` and the controller's
``Clear``/``Pin``/``Compress`` requests act on the same caches a request hits, and every change
they make must reach the controller (and the device-event subscribers) as the admit and evict
events a real worker would send. Both go through :class:`SimMemory` over one
:class:`~kvpool.protocol.simcore.instance.SimInstance`: prefixes are named by token ids and
hashed exactly as LMCache hashes them (``kvpool.protocol.hashing``), the tiers are simcore's,
and each operation hands its events to the engine's ``emit``.

Memory-API semantics follow the reference worker (``engine/offload/memory_ops.py``): evict skips
chunks the memory API pinned; pin pins each chunk of the prefix in every local tier holding it
and stops at the first chunk no tier holds; unpin undoes exactly those pins. Tier names are
kvpool's (``local_cpu``, ``local_disk``; aliases ``cpu``/``ddr``, ``disk``/``ssd``) plus
``device`` (vLLM's prefix cache, which the simulated engine models too).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvpool.protocol.hashing import HashConfig, chunk_hashes
from kvpool.protocol.simcore.instance import CPU_BACKEND, DISK_BACKEND, SimInstance
from kvpool.protocol.simcore.kvcache import DEVICE, KvEvent, LRUTier
from kvpool.protocol.tiers import LOCAL_CPU, LOCAL_DISK

Emit = Callable[[list[KvEvent]], None]

#: kvpool tier name -> simcore location.
LOCATION_OF_TIER = {LOCAL_CPU: CPU_BACKEND, LOCAL_DISK: DISK_BACKEND, DEVICE: DEVICE}
TIER_OF_LOCATION = {loc: tier for tier, loc in LOCATION_OF_TIER.items()}
_ALIASES = {"cpu": LOCAL_CPU, "ddr": LOCAL_CPU, "disk": LOCAL_DISK, "ssd": LOCAL_DISK}


class SimMemory:
    """Cache operations of one simulated instance (see the module docstring)."""

    def __init__(
        self,
        inst: SimInstance,
        hashing: HashConfig,
        emit: Emit,
        *,
        cpu_bytes: int = 0,
        disk_bytes: int = 0,
        worker_port: int = 0,
        p2p: bool = False,
    ) -> None:
        self.inst = inst
        self.hashing = hashing
        self.chunk_size = hashing.chunk_size
        self._emit = emit
        self._capacity = {LOCAL_CPU: cpu_bytes, LOCAL_DISK: disk_bytes}
        self._worker_port = worker_port
        self._p2p = p2p
        self._pins: dict[int, list[LRUTier]] = {}  # memory-API pins: chunk -> tiers pinned in
        self.counters: dict[str, float] = {}

    # --- naming ------------------------------------------------------------------------------
    def keys(self, token_ids: Sequence[int]) -> list[int]:
        """LMCache's chunk hashes of ``token_ids``."""
        return chunk_hashes(token_ids, self.hashing)

    def tiers(self) -> list[str]:
        """The tiers this instance has, fastest first."""
        out = [DEVICE]
        if self.inst.config.lmcache:
            out.append(LOCAL_CPU)
            if self.inst.disk.capacity:
                out.append(LOCAL_DISK)
        return out

    def location(self, tier: str) -> str:
        """simcore location of a kvpool tier name; ValueError naming the choices."""
        name = _ALIASES.get(tier, tier)
        if name not in self.tiers():
            raise ValueError(
                f"locations: unknown tier {tier!r}; this worker has tiers {self.tiers()} "
                "(aliases: cpu/ddr, disk/ssd)"
            )
        return LOCATION_OF_TIER[name]

    def _tier(self, location: str) -> LRUTier | None:
        if location == CPU_BACKEND and self.inst.config.lmcache:
            return self.inst.ddr
        if location == DISK_BACKEND and self.inst.disk.capacity:
            return self.inst.disk
        return None

    def _tokens(self, chunks: int, token_ids: Sequence[int]) -> int:
        return min(chunks * self.chunk_size, len(token_ids))

    def _count(self, name: str, value: float = 1.0) -> None:
        self.counters[name] = self.counters.get(name, 0.0) + value

    # --- the agent memory API ----------------------------------------------------------------
    def evict(
        self,
        *,
        token_ids: Sequence[int] | None = None,
        chunk_hashes: Sequence[int] | None = None,
        locations: Sequence[str] | None = None,
    ) -> int:
        """Remove a prefix's chunks (or the given hashes) from ``locations`` (all tiers when
        None); chunks the memory API pinned stay. Returns the chunks removed."""
        if (token_ids is None) == (chunk_hashes is None):
            raise ValueError("evict: give exactly one of token_ids or chunk_hashes")
        where = None if locations is None else [self.location(t) for t in locations]
        if token_ids is not None:
            keys = self.keys(token_ids)
        else:
            keys = [int(h) for h in chunk_hashes or ()]
        kept = [k for k in keys if k in self._pins]
        if kept:
            self._count("evict_skipped_pinned", len(kept))
        events = self.inst.evict([k for k in keys if k not in self._pins], where)
        self._emit(events)
        removed = len({e.key for e in events})
        self._count("evicted_chunks", removed)
        return removed

    def lookup(self, token_ids: Sequence[int]) -> int:
        """Leading tokens whose chunks DDR or the disk holds (reads only)."""
        held = 0
        for key in self.keys(token_ids):
            if not any(key in t for t in (self.inst.ddr, self.inst.disk)):
                break
            held += 1
        return self._tokens(held, token_ids)

    def prefetch(self, token_ids: Sequence[int]) -> int:
        """Bring the prefix's chunks that only the disk holds into DDR; tokens now in DDR."""
        n, events = self.inst.prefetch(self.keys(token_ids))
        self._emit(events)
        self._count("prefetched_chunks.local_disk", sum(1 for e in events if e.op == "admit"))
        return self._tokens(n, token_ids)

    def pin(self, token_ids: Sequence[int]) -> int:
        """Pin the prefix chunk by chunk in every local tier holding it; tokens pinned."""
        pinned_to = 0
        for i, key in enumerate(self.keys(token_ids)):
            if key not in self._pins:
                held = [t for t in (self.inst.ddr, self.inst.disk) if key in t]
                if not held:
                    break
                for tier in held:
                    tier.pin([key])
                self._pins[key] = held
            pinned_to = self._tokens(i + 1, token_ids)
        return pinned_to

    def unpin(self, token_ids: Sequence[int]) -> int:
        """Undo :meth:`pin` for the prefix; tokens unpinned."""
        unpinned_to = 0
        for i, key in enumerate(self.keys(token_ids)):
            held = self._pins.pop(key, None)
            if held is None:
                break
            for tier in held:
                tier.unpin([key])
            unpinned_to = self._tokens(i + 1, token_ids)
        return unpinned_to

    def stats(self, hit_tokens: float, miss_requests: float) -> dict[str, object]:
        """Per tier chunks, bytes and capacity (the reference worker's shape, plus device)."""
        inst = self.inst
        chunk_bytes = inst.config.chunk_bytes
        out: dict[str, dict[str, object]] = {
            DEVICE: {
                "chunks": len(inst.device),
                "blocks": inst.device.used_blocks,
                "capacity_blocks": inst.config.device_blocks,
                "bytes": inst.device.used_blocks
                * inst.config.block_size
                * inst.config.kv_bytes_per_token,
                "up": True,
            }
        }
        for name, tier in ((LOCAL_CPU, inst.ddr), (LOCAL_DISK, inst.disk)):
            if name in self.tiers():
                out[name] = {
                    "chunks": len(tier),
                    "bytes": len(tier) * chunk_bytes,
                    "capacity_bytes": self._capacity[name],
                    "capacity_chunks": tier.capacity,
                    "up": True,
                    "lmcache_pinned": tier.pinned,
                }
        return {
            "tiers": out,
            "pinned_chunks": len(self._pins),
            "chunk_size": self.chunk_size,
            "hit_tokens": hit_tokens,
            "miss_requests": miss_requests,
        }

    # --- the controller's commands (control.ControlTarget) -----------------------------------
    @property
    def has_p2p(self) -> bool:
        return self._p2p

    @property
    def internal_url(self) -> str:
        return f"*:{self._worker_port}"

    def _prefix(self, tier: LRUTier, keys: Sequence[int]) -> list[int]:
        n = 0
        for key in keys:
            if key not in tier:
                break
            n += 1
        return list(keys[:n])

    def lookup_pinned(self, tokens: Sequence[int], location: str) -> int:
        tier = self._tier(location)
        if tier is None:
            return 0
        hit = self._prefix(tier, self.keys(tokens))
        tier.pin(hit)  # LMCache never releases a controller's pins
        for key in reversed(hit):  # LMCache's touch_cache: chunk 0 ends up most recent
            tier.touch(key)
        return self._tokens(len(hit), tokens)

    def clear_location(self, location: str) -> int:
        if location != CPU_BACKEND:  # LMCache's disk backend has no clear(): 0
            return 0
        tier = self._tier(location)
        if tier is None:
            return 0
        events: list[KvEvent] = []
        removed = tier.remove(tier.keys(), events)
        self._emit(events)
        return removed * self.chunk_size

    def recompress(self, tokens: Sequence[int], location: str) -> int:
        tier = self._tier(location)
        if tier is None:
            return 0
        hit = self._prefix(tier, self.keys(tokens))
        if not hit:
            return 0
        events: list[KvEvent] = []
        tier.remove(hit, events)
        tier.put(hit, events)
        self._emit(events)
        return self._tokens(len(hit), tokens)
