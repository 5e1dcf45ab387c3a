"""ChunkIndex against a naive reference model under random operation sequences.

The reference keeps one plain ``set`` of (chunk, instance, worker, location) facts and answers
every query by brute force, straight from the definitions in ``kvpool.protocol.index``.
Hypothesis drives both with the same operations and checks every query agrees after each.
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvpool.protocol import index as index_module
from kvpool.protocol.index import ChunkIndex, InstanceHit, tier_rank

INSTANCES = ["i0", "i1", "i2", "i3"]
WORKERS = [0, 1, 2]
LOCATIONS = ["LocalCPUBackend", "LocalDiskBackend", "RemoteBackend", "ZTier"]
# few distinct keys so that prompts hit; extremes of the 64-bit range and negatives included
KEYS = [0, 1, 2, 3, 4, 5, -1, -(2**63), 2**64 - 1, 2**63, 7, 8]

Fact = tuple[int, str, int, str]


class Reference:
    """Brute-force model of ChunkIndex."""

    def __init__(self) -> None:
        self.facts: set[Fact] = set()

    def admit(self, inst: str, wid: int, loc: str, keys: Sequence[int]) -> int:
        new = {(k, inst, wid, loc) for k in keys} - self.facts
        self.facts |= new
        return len(new)

    def evict(self, inst: str, wid: int, loc: str, keys: Sequence[int]) -> int:
        gone = {(k, inst, wid, loc) for k in keys} & self.facts
        self.facts -= gone
        return len(gone)

    def clear(self, inst: str, wid: int | None, loc: str | None) -> int:
        gone = {
            f
            for f in self.facts
            if f[1] == inst and (wid is None or f[2] == wid) and (loc is None or f[3] == loc)
        }
        self.facts -= gone
        return len(gone)

    def replace(self, inst: str, wid: int, loc: str, keys: Sequence[int]) -> None:
        self.clear(inst, wid, loc)
        self.admit(inst, wid, loc, keys)

    def holds(self, key: int, inst: str, wid: int | None = None) -> bool:
        return any(
            f[0] == key and f[1] == inst and (wid is None or f[2] == wid) for f in self.facts
        )

    def prefix_hits(self, hashes: Sequence[int]) -> dict[str, InstanceHit]:
        out = {}
        for inst in INSTANCES:
            n = 0
            while n < len(hashes) and self.holds(hashes[n], inst):
                n += 1
            if n == 0:
                continue
            per_loc: dict[str, int] = {}
            for key in hashes[:n]:
                for loc in {f[3] for f in self.facts if f[0] == key and f[1] == inst}:
                    per_loc[loc] = per_loc.get(loc, 0) + 1
            workers = tuple(
                sorted({f[2] for f in self.facts if f[0] == hashes[0] and f[1] == inst})
            )
            out[inst] = InstanceHit(inst, n, per_loc, workers)
        return out

    def p2p_lookup(
        self, hashes: Sequence[int], req: str, wid: int
    ) -> list[tuple[str, str, int, int]]:
        found = []
        for inst in INSTANCES:
            if inst == req:
                continue
            n = 0
            while n < len(hashes) and self.holds(hashes[n], inst, wid):
                n += 1
            if n:
                locs = {
                    f[3] for f in self.facts if f[0] == hashes[0] and f[1] == inst and f[2] == wid
                }
                found.append((inst, min(locs, key=tier_rank), n, wid))
        found.sort(key=lambda r: (-r[2], r[0]))
        return found

    def stats(self) -> dict[str, int]:
        out = {
            "chunk_locations": len(self.facts),
            "chunks": len({f[0] for f in self.facts}),
            "instances": len({f[1] for f in self.facts}),
            "workers": len({(f[1], f[2]) for f in self.facts}),
        }
        for f in self.facts:
            out[f"location:{f[3]}"] = out.get(f"location:{f[3]}", 0) + 1
        return out


insts = st.sampled_from(INSTANCES)
wids = st.sampled_from(WORKERS)
locs = st.sampled_from(LOCATIONS)
keylists = st.lists(st.sampled_from(KEYS), max_size=8)


@settings(max_examples=60, stateful_step_count=40, deadline=None)
class IndexMatchesReference(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = ChunkIndex()
        self.ref = Reference()

    @rule(inst=insts, wid=wids, loc=locs, keys=keylists)
    def admit(self, inst: str, wid: int, loc: str, keys: list[int]) -> None:
        assert self.index.admit(inst, wid, loc, keys) == self.ref.admit(inst, wid, loc, keys)

    @rule(inst=insts, wid=wids, loc=locs, keys=keylists)
    def evict(self, inst: str, wid: int, loc: str, keys: list[int]) -> None:
        assert self.index.evict(inst, wid, loc, keys) == self.ref.evict(inst, wid, loc, keys)

    @rule(inst=insts, wid=st.none() | wids, loc=st.none() | locs)
    def clear(self, inst: str, wid: int | None, loc: str | None) -> None:
        assert self.index.clear(inst, wid, loc) == self.ref.clear(inst, wid, loc)

    @rule(inst=insts, wid=wids)
    def remove_worker(self, inst: str, wid: int) -> None:
        assert self.index.remove_worker(inst, wid) == self.ref.clear(inst, wid, None)

    @rule(inst=insts)
    def remove_instance(self, inst: str) -> None:
        assert self.index.remove_instance(inst) == self.ref.clear(inst, None, None)

    @rule(inst=insts, wid=wids, loc=locs, keys=keylists)
    def replace(self, inst: str, wid: int, loc: str, keys: list[int]) -> None:
        self.index.replace(inst, wid, loc, keys)
        self.ref.replace(inst, wid, loc, keys)

    @rule(hashes=st.lists(st.sampled_from(KEYS), max_size=10))
    def prefix_hits(self, hashes: list[int]) -> None:
        assert self.index.prefix_hits(hashes) == self.ref.prefix_hits(hashes)

    @rule(hashes=st.lists(st.sampled_from(KEYS), max_size=10))
    def prefix_groups(self, hashes: list[int]) -> None:
        """The grouped answer, expanded, is the per-instance one; groups are disjoint."""
        _, names = self.index.instance_names()
        expanded: dict[str, tuple[int, dict[str, int]]] = {}
        seen = 0
        for group in self.index.prefix_groups(hashes):
            assert group.instances and not group.instances & seen
            seen |= group.instances
            for inst in range(len(names)):
                if group.instances >> inst & 1:
                    expanded[names[inst]] = (group.hit_chunks, group.per_location)
        want = {
            name: (hit.hit_chunks, dict(hit.per_location))
            for name, hit in self.ref.prefix_hits(hashes).items()
        }
        assert expanded == want

    @rule(hashes=st.lists(st.sampled_from(KEYS), max_size=10), req=insts, wid=wids)
    def p2p_lookup(self, hashes: list[int], req: str, wid: int) -> None:
        assert self.index.p2p_lookup(hashes, req, wid) == self.ref.p2p_lookup(hashes, req, wid)

    @invariant()
    def sizes_and_contents_agree(self) -> None:
        assert self.index.stats() == self.ref.stats()
        self.contents_agree()

    def contents_agree(self) -> None:
        assert len(self.index) == len(self.ref.facts)
        for inst in INSTANCES:
            for wid in WORKERS:
                held = {f[3] for f in self.ref.facts if f[1] == inst and f[2] == wid}
                assert self.index.locations_of(inst, wid) == sorted(held, key=tier_rank)
                for loc in LOCATIONS:
                    want = {f[0] for f in self.ref.facts if f[1:] == (inst, wid, loc)}
                    got = self.index.worker_keys(inst, wid, loc)
                    assert len(got) == len(want) and set(got) == want


TestIndexMatchesReference = IndexMatchesReference.TestCase


class CompactingIndexMatchesReference(IndexMatchesReference):
    """The same with no slack anywhere: key logs compacted at every chance and the memo tables
    dropped at nearly every insert, so those paths are exercised too."""

    def __init__(self) -> None:
        super().__init__()
        self.saved = (index_module._LOG_SLACK, index_module._MEMO_LIMIT)
        index_module._LOG_SLACK, index_module._MEMO_LIMIT = 0, 2

    def teardown(self) -> None:
        index_module._LOG_SLACK, index_module._MEMO_LIMIT = self.saved


TestCompactingIndexMatchesReference = CompactingIndexMatchesReference.TestCase


class LazyPurgeIndexMatchesReference(IndexMatchesReference):
    """Purged slots are swept one key per mutation, so queries run while masks still carry
    the bits of purged slots (and those slot ids wait to be reused); every query and listing
    must already be exact, and ``stats()`` (which sweeps everything) too."""

    def __init__(self) -> None:
        super().__init__()
        self.saved_sweep = (index_module._SWEEP_PER_KEY, index_module._SWEEP_MIN)
        index_module._SWEEP_PER_KEY, index_module._SWEEP_MIN = 0, 1
        self.steps = 0

    def teardown(self) -> None:
        index_module._SWEEP_PER_KEY, index_module._SWEEP_MIN = self.saved_sweep

    @rule(budget=st.integers(0, 3))
    def sweep(self, budget: int) -> None:
        left = self.index.sweep(budget)
        assert left >= 0

    @invariant()
    def sizes_and_contents_agree(self) -> None:
        self.steps += 1
        if self.steps % 7 == 0:  # stats() sweeps everything: only now and then
            assert self.index.stats() == self.ref.stats()
            assert self.index.sweep() == 0
        self.contents_agree()


TestLazyPurgeIndexMatchesReference = LazyPurgeIndexMatchesReference.TestCase
