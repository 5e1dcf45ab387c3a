"""A prefix scan's answer as groups of instances that hold exactly the same of the prompt.

Why this module exists: on a pool whose prompts share a system prompt, every instance that ever
served a request holds its first chunks, so a prefix lookup at fleet scale has hundreds of
holders, and nearly all of them hold the same thing (the same chunks, in the same tiers).
Answering per instance costs a Python object (and a dictionary of tier counts) per holder per
request, several milliseconds at a thousand instances. The scan already knows where holders
stop (:class:`kvpool.protocol.index_slots.Run`): instances that stop at the same chunk and held
each run in the same tiers form one :class:`HitGroup`, a bitmask of instance ids, whatever their
number. The gateway maps the bitmask to its candidates with numpy. Pure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpool.protocol.index_slots import Decoded, Run

__all__ = ["HitGroup", "hit_groups", "per_instance"]


@dataclass(frozen=True)
class HitGroup:
    """Instances holding the same of a prompt: ``instances`` is a bitmask of index instance
    ids (bit ``i``: the instance the index names ``i``), each holds ``hit_chunks`` leading chunks
    of which each location holds ``per_location`` (a chunk in two tiers counts in both)."""

    instances: int
    hit_chunks: int
    per_location: dict[str, int]


def hit_groups(
    ends: Sequence[tuple[int, int]], runs: Sequence[Run], decode: Callable[[int], Decoded]
) -> list[HitGroup]:
    """Groups from a scan's ``ends`` (chunks held, bitmask of the instances that stop there)
    and ``runs``: each ending set split by the tiers its members held each run in."""
    out: list[HitGroup] = []
    for chunks, ending in ends:
        parts: list[tuple[int, dict[str, int]]] = [(ending, {})]
        for run in runs:
            if not run.alive & ending:
                break  # runs come in order; these instances stopped before this one
            for location, holders in decode(run.mask).locations.items():
                split: list[tuple[int, dict[str, int]]] = []
                for mask, counts in parts:
                    inside = mask & holders
                    if inside:
                        counted = dict(counts)
                        counted[location] = counted.get(location, 0) + run.length
                        split.append((inside, counted))
                        if mask & ~holders:
                            split.append((mask & ~holders, counts))
                    else:
                        split.append((mask, counts))
                parts = split
        out += [HitGroup(mask, chunks, counts) for mask, counts in parts]
    return out


def per_instance(ends: Sequence[tuple[int, int]]) -> dict[int, int]:
    """{instance index: hit chunks} of a scan's ends (the per-instance answers)."""
    hits: dict[int, int] = {}
    for n, ending in ends:
        rest = ending
        while rest:
            low = rest & -rest
            rest ^= low
            hits[low.bit_length() - 1] = n
    return hits
