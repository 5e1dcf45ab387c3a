"""The most a router could hit with a fleet's caches: one LRU cache the size of all of them.

Why this module exists: the fleet benchmark judges kvpool's hit ratio against "what a router
that knows every cache exactly and ignores load would reach with the same caches" (issue 14).
Read literally as a router (the simulator's ``oracle`` policy: the longest prefix held, whatever
the load), it degenerates on any trace whose prompts share a first block (every Mooncake
conversation starts with the same system block): the first instance to hold that block holds
the longest prefix of every later request, so every request goes there, one instance's cache
serves the window and the others stay empty (a hit ratio *below* round-robin's). The bound a
router is measured against is instead the fleet's cache pooled: every instance's device and
DDR (and disk) capacity as one LRU cache of chunks, in arrival order, every request served by
it. No partition of the same capacity across instances does better under LRU in practice: a
router can only lose hits, by sending a prefix where it is not held or by holding a chunk twice
(the shared first block sits on every instance). Pure: numbers in, a ratio out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvpool.gateway.fleetsim.fleet import FleetConfig
from kvpool.gateway.fleetsim.keys import chunk_keys
from kvpool.gateway.traces.mooncake import TraceRequest

__all__ = ["pooled_capacity_chunks", "pooled_hit_ratio"]


def pooled_capacity_chunks(config: FleetConfig) -> int:
    """Chunks the whole fleet holds: per instance its device KV (in whole chunks), its DDR and
    its disk, times the instances."""
    inst = config.instance_config()
    device = inst.device_blocks * inst.block_size // inst.chunk_size
    return config.instances * (device + inst.ddr_chunks + inst.disk_chunks)


def pooled_hit_ratio(
    requests: Sequence[TraceRequest],
    config: FleetConfig,
    *,
    keys_of: Callable[[TraceRequest], tuple[int, ...]] | None = None,
) -> float:
    """Cached prompt tokens / prompt tokens when one LRU cache of
    :func:`pooled_capacity_chunks` serves ``requests`` in arrival order: a request reuses its
    leading chunks held (at most its prompt less one token, as an engine computes the last),
    then its chunks are the most recently used (stored, as LMCache stores a prompt's chunks)."""
    capacity = pooled_capacity_chunks(config)
    if keys_of is None:

        def keys_of(r: TraceRequest) -> tuple[int, ...]:
            return chunk_keys(r.hash_ids, r.input_length, chunk_size=config.chunk_size,
                              block_tokens=config.trace_block_tokens)  # fmt: skip

    cache: OrderedDict[int, None] = OrderedDict()
    prompt = cached = 0
    for r in sorted(requests, key=lambda r: (r.arrival_s, r.index)):
        keys = keys_of(r)
        held = 0
        while held < len(keys) and keys[held] in cache:
            held += 1
        cached += min(held * config.chunk_size, r.input_length - 1)
        prompt += r.input_length
        for key in keys:
            cache[key] = None
            cache.move_to_end(key)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return cached / prompt if prompt else 0.0
