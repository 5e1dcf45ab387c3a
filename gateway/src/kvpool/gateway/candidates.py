"""The instances one routing decision chooses among, held column by column. Pure: no I/O.

Why this module exists: a pool of a thousand instances must be routed in well under a
millisecond, by the gateway and by the fleet simulator alike. One object per instance per
request (its load, its hit) costs that much on its own, and nearly all of them say the same
thing: "holds nothing of this prompt, this loaded". So :class:`Candidates` keeps the loads as
arrays (in-flight requests, queued prefill tokens, recent TTFT), the few instances that hold a
prefix of the prompt as a sparse map, and the hit that whole groups share (a P2P group member can
pull what any member holds) once per group. :class:`Candidate` is the same facts for one
instance, for small pools, tests and explanations.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

__all__ = [
    "BoolArray",
    "Candidate",
    "Candidates",
    "FloatArray",
    "InstanceLoad",
    "IntArray",
    "PrefixHit",
]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]


@dataclass(frozen=True)
class PrefixHit:
    """What one instance holds of the prompt: leading chunks, and how many each tier holds."""

    hit_chunks: int
    per_location: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class InstanceLoad:
    """How busy an instance is right now (see :class:`kvpool.gateway.load.LoadTracker`)."""

    inflight: int = 0
    queued_prefill_tokens: int = 0
    ttft_s: float | None = None  # recent TTFT (EWMA); None until measured


@dataclass(frozen=True)
class Candidate:
    """One instance that may serve the request (healthy, breaker closed)."""

    name: str
    load: InstanceLoad = InstanceLoad()
    hit: PrefixHit | None = None


class Candidates:
    """Candidates in a fixed order: ``names[i]`` has ``inflight[i]`` requests in flight,
    ``queued[i]`` prefill tokens queued, ``ttft[i]`` recent TTFT (NaN until measured), and holds
    ``hits[i]`` when ``i`` is in ``hits``, else the hit of the last ``shared`` group it is in
    (each a position array and the hit every one of them holds), else nothing."""

    __slots__ = ("hits", "inflight", "names", "queued", "shared", "ttft")

    def __init__(
        self,
        names: Sequence[str],
        inflight: IntArray,
        queued: IntArray,
        ttft: FloatArray,
        hits: Mapping[int, PrefixHit] | None = None,
        shared: Sequence[tuple[IntArray, PrefixHit]] = (),
    ) -> None:
        n = len(names)
        if not len(inflight) == len(queued) == len(ttft) == n:
            raise ValueError("candidate columns differ in length")
        self.names = names
        self.inflight = inflight
        self.queued = queued
        self.ttft = ttft
        self.hits: Mapping[int, PrefixHit] = hits or {}
        self.shared = shared

    @classmethod
    def of(cls, rows: Iterable[Candidate]) -> Candidates:
        """From one object per instance (small pools and tests)."""
        rows = list(rows)
        return cls(
            [c.name for c in rows],
            np.array([c.load.inflight for c in rows], dtype=np.int64),
            np.array([c.load.queued_prefill_tokens for c in rows], dtype=np.int64),
            np.array(
                [math.nan if c.load.ttft_s is None else c.load.ttft_s for c in rows],
                dtype=np.float64,
            ),
            {i: c.hit for i, c in enumerate(rows) if c.hit is not None},
        )

    def __len__(self) -> int:
        return len(self.names)

    def __bool__(self) -> bool:
        return len(self.names) > 0

    def __iter__(self) -> Iterator[Candidate]:
        return (self.candidate(i) for i in range(len(self.names)))

    def hit(self, i: int) -> PrefixHit | None:
        own = self.hits.get(i)
        if own is not None:
            return own
        for positions, hit in reversed(self.shared):  # a later entry counts (as in scoring)
            if np.any(positions == i):
                return hit
        return None

    def load(self, i: int) -> InstanceLoad:
        ttft = float(self.ttft[i])
        return InstanceLoad(
            int(self.inflight[i]), int(self.queued[i]), None if math.isnan(ttft) else ttft
        )

    def candidate(self, i: int) -> Candidate:
        return Candidate(self.names[i], self.load(i), self.hit(i))

    def position(self, name: str) -> int:
        return list(self.names).index(name)
