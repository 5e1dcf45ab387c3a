"""The prefix scan of the chunk index: how far each instance holds a prompt, a block at a time.

Why this module exists: it is the hot loop of every routing decision and every P2P lookup
(:meth:`kvpool.protocol.index.ChunkIndex.prefix_hits`, ``prefix_groups``, ``p2p_lookup``), and
it needs nothing of the index but a way to fetch a chunk's slot mask and to decode a mask into
its instances. It fetches masks a block at a time in C and only does per-instance work where
the holder set changes; blocks grow from ``FIRST_BLOCK`` to ``SCAN_BLOCK`` hashes, so a prompt
that misses after a chunk or two (a cold prompt, a P2P probe of random hashes) costs a few
probes, not a block of 64; it stops once no instance can extend its prefix (at most
``SCAN_BLOCK`` hashes are read past that point). Pure.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import islice, repeat

from kvpool.protocol.index_slots import Decoded, Run

__all__ = ["FIRST_BLOCK", "SCAN_BLOCK", "scan"]

#: Hashes fetched per step of a prefix scan (the most it reads past where it stops).
SCAN_BLOCK = 64
#: The first step's size; each next step doubles up to ``SCAN_BLOCK``.
FIRST_BLOCK = 8


def scan(
    get: Callable[[int, int], int],
    decode: Callable[[int], Decoded],
    hashes: Iterable[int],
    slot_filter: int,
) -> tuple[list[tuple[int, int]], list[Run]]:
    """Leading hits of ``hashes`` counting only the slots in ``slot_filter`` (-1: all);
    ``get(hash, 0)`` is a chunk's slot mask (0: held nowhere), ``decode`` a mask's meaning.

    Returns the *ends* (hit chunks, bitmask of the instance indexes that stop there), the
    longest last, and the runs of equal (filtered) masks.
    """
    source = iter(hashes)
    zeros = repeat(0)
    ends: list[tuple[int, int]] = []
    runs: list[Run] = []
    alive = 0
    raw = -1  # last raw mask seen; no mask equals -1, so the first chunk opens a run
    prev = -1  # last filtered mask
    start = 0
    n = 0
    size = FIRST_BLOCK
    while True:
        block = list(map(get, islice(source, size), zeros))
        size = min(2 * size, SCAN_BLOCK)
        if not block:
            break
        if block[0] is raw and block.count(raw) == len(block):
            n += len(block)  # the whole block has the current holders: C speed
            continue
        for mask in block:
            if mask is not raw and mask != raw:
                raw = mask
                held = mask & slot_filter
                if held != prev:
                    still = decode(held).inst_mask if held else 0
                    if n:
                        still &= alive
                        runs.append(Run(prev, n - start, alive))
                        ended = alive & ~still
                        if ended:
                            ends.append((n, ended))
                    if not still:
                        return ends, runs
                    alive = still
                    prev = held
                    start = n
            n += 1
    if n and alive:
        runs.append(Run(prev, n - start, alive))
        ends.append((n, alive))
    return ends, runs
