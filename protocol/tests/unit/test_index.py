"""Named behaviours of the chunk index that the controller and the gateway rely on."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

import pytest

from kvpool.protocol.index import SCAN_BLOCK, TIER_ORDER, ChunkIndex, InstanceHit, tier_rank

CPU, DISK, REMOTE = "LocalCPUBackend", "LocalDiskBackend", "RemoteBackend"


class CountingPrompt(Sequence[int]):
    """A prompt that records how many of its hashes the index actually read."""

    def __init__(self, hashes: list[int]) -> None:
        self.hashes = hashes
        self.read = 0

    def __len__(self) -> int:
        return len(self.hashes)

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[int]: ...
    def __getitem__(self, i: int | slice) -> int | Sequence[int]:
        return self.hashes[i]

    def __iter__(self) -> Iterator[int]:
        for h in self.hashes:
            self.read += 1
            yield h


def test_admit_and_evict_are_idempotent() -> None:
    ix = ChunkIndex()
    assert ix.admit("a", 0, CPU, [1, 2, 2]) == 2
    assert ix.admit("a", 0, CPU, [1, 2]) == 0
    assert len(ix) == 2
    assert ix.evict("a", 0, CPU, [3]) == 0
    assert ix.evict("b", 0, CPU, [1]) == 0
    assert ix.evict("a", 0, CPU, [1, 1]) == 1
    assert ix.evict("a", 0, CPU, [1]) == 0
    assert ix.worker_keys("a", 0, CPU) == [2]


def test_prefix_hits_per_instance_tier_and_first_chunk_workers() -> None:
    ix = ChunkIndex()
    ix.admit("a", 0, CPU, [10, 11, 12])
    ix.admit("a", 1, CPU, [10, 11])
    ix.admit("a", 1, DISK, [10, 11, 12, 13])
    ix.admit("b", 0, DISK, [10])
    ix.admit("c", 0, CPU, [11, 12])  # no first chunk: not a prefix hit
    hits = ix.prefix_hits([10, 11, 12, 13, 14])
    assert hits == {
        "a": InstanceHit("a", 4, {CPU: 3, DISK: 4}, (0, 1)),
        "b": InstanceHit("b", 1, {DISK: 1}, (0,)),
    }


def test_prefix_scan_stops_at_first_chunk_nobody_holds() -> None:
    ix = ChunkIndex()
    ix.admit("a", 0, CPU, list(range(3)) + list(range(4, 10_000)))
    prompt = CountingPrompt(list(range(10_000)))
    assert ix.prefix_hits(prompt)["a"].hit_chunks == 3
    assert prompt.read <= 4 + SCAN_BLOCK  # hashes are fetched a block at a time
    missing_first = CountingPrompt([-5, *range(10_000)])
    assert ix.prefix_hits(missing_first) == {}
    assert missing_first.read <= SCAN_BLOCK


def test_prefix_scan_stops_when_every_instance_has_dropped_out() -> None:
    ix = ChunkIndex()
    ix.admit("a", 0, CPU, [1, 2])
    ix.admit("b", 0, CPU, [1, 3, 4, 5])  # 2 is missing for b, 3.. held by b only
    prompt = CountingPrompt([1, 2, 3, 4, 5])
    hits = ix.prefix_hits(prompt)
    assert {k: v.hit_chunks for k, v in hits.items()} == {"a": 2, "b": 1}
    assert prompt.read == 5


def test_prefix_scan_over_many_blocks_counts_runs_exactly() -> None:
    ix = ChunkIndex()
    n = 5 * SCAN_BLOCK + 7
    ix.admit("a", 0, CPU, range(n))
    ix.admit("a", 0, DISK, range(SCAN_BLOCK + 3))
    ix.admit("b", 1, CPU, range(2 * SCAN_BLOCK))
    ix.admit("b", 1, CPU, range(2 * SCAN_BLOCK + 1, n))
    prompt = CountingPrompt([*range(n), -1, *range(n, 100 * SCAN_BLOCK)])
    assert ix.prefix_hits(prompt) == {
        "a": InstanceHit("a", n, {CPU: n, DISK: SCAN_BLOCK + 3}, (0,)),
        "b": InstanceHit("b", 2 * SCAN_BLOCK, {CPU: 2 * SCAN_BLOCK}, (1,)),
    }
    assert prompt.read <= n + 1 + SCAN_BLOCK
    assert ix.p2p_lookup(prompt.hashes, "a", 1) == [("b", CPU, 2 * SCAN_BLOCK, 1)]
    assert ix.p2p_lookup(prompt.hashes, "b", 0) == [("a", CPU, n, 0)]


def test_p2p_lookup_is_tp_rank_aware() -> None:
    ix = ChunkIndex()
    ix.admit("peer", 1, CPU, [1, 2, 3])  # a TP=2 peer whose rank 1 alone holds the prompt
    ix.admit("me", 0, CPU, [1, 2, 3])
    assert ix.p2p_lookup([1, 2, 3], "me", 0) == []
    assert ix.p2p_lookup([1, 2, 3], "me", 1) == [("peer", CPU, 3, 1)]
    assert ix.p2p_lookup([1, 2, 3], "peer", 1) == []  # the requester never answers itself
    assert ix.p2p_lookup([1, 2, 3], "peer", 0) == [("me", CPU, 3, 0)]


def test_p2p_lookup_orders_longest_first_and_prefers_fastest_tier() -> None:
    ix = ChunkIndex()
    ix.admit("b", 0, DISK, [1, 2])
    ix.admit("b", 0, CPU, [1])
    ix.admit("a", 0, REMOTE, [1, 2])
    ix.admit("c", 0, DISK, [1, 2, 3])
    ix.admit("d", 0, DISK, [2, 3])
    assert ix.p2p_lookup([1, 2, 3], "x", 0) == [
        ("c", DISK, 3, 0),
        ("a", REMOTE, 2, 0),
        ("b", CPU, 2, 0),
    ]
    assert ix.p2p_lookup([], "x", 0) == []


def test_remove_worker_purges_only_that_worker() -> None:
    ix = ChunkIndex()
    ix.admit("a", 0, CPU, range(100))
    ix.admit("a", 0, DISK, range(50))
    ix.admit("a", 1, CPU, range(100))
    ix.admit("b", 0, CPU, range(10))
    assert ix.remove_worker("a", 0) == 150
    assert ix.remove_worker("a", 0) == 0
    assert ix.locations_of("a", 0) == []
    assert ix.prefix_hits(list(range(100)))["a"] == InstanceHit("a", 100, {CPU: 100}, (1,))
    assert ix.stats() == {
        "chunk_locations": 110,
        "chunks": 100,
        "instances": 2,
        "workers": 2,
        "location:LocalCPUBackend": 110,
    }
    assert ix.remove_instance("a") == 100
    assert set(ix.prefix_hits([0, 1])) == {"b"}
    assert ix.remove_instance("b") == 10
    assert ix.stats() == {"chunk_locations": 0, "chunks": 0, "instances": 0, "workers": 0}


def test_clear_by_worker_and_location() -> None:
    ix = ChunkIndex()
    for wid in (0, 1):
        ix.admit("a", wid, CPU, [1, 2])
        ix.admit("a", wid, DISK, [1, 2, 3])
    assert ix.clear("a", location=DISK) == 6
    assert ix.locations_of("a", 0) == [CPU]
    assert ix.clear("a", worker_id=1, location=CPU) == 2
    assert ix.clear("a", worker_id=1) == 0
    assert ix.prefix_hits([1, 2, 3]) == {"a": InstanceHit("a", 2, {CPU: 2}, (0,))}
    assert ix.clear("a") == 2
    assert ix.clear("nobody") == 0
    assert len(ix) == 0


def test_replace_makes_a_tier_hold_exactly_the_synced_keys() -> None:
    ix = ChunkIndex()
    ix.admit("a", 0, CPU, [1, 2, 3])
    ix.admit("a", 0, DISK, [1])
    ix.replace("a", 0, CPU, [3, 4])
    assert sorted(ix.worker_keys("a", 0, CPU)) == [3, 4]
    assert ix.worker_keys("a", 0, DISK) == [1]
    ix.replace("a", 0, DISK, [])
    assert ix.locations_of("a", 0) == [CPU]
    ix.replace("b", 2, REMOTE, [9])
    assert ix.worker_keys("b", 2, REMOTE) == [9]
    assert len(ix) == 3


def test_slots_are_reused_after_purge_without_ghost_holders() -> None:
    ix = ChunkIndex()
    ix.admit("a", 0, CPU, [1, 2])
    ix.prefix_hits([1, 2])  # fill the memo tables
    ix.remove_instance("a")
    ix.admit("z", 3, DISK, [1])  # takes over the freed slot
    assert ix.prefix_hits([1, 2]) == {"z": InstanceHit("z", 1, {DISK: 1}, (3,))}
    assert ix.p2p_lookup([1], "q", 0) == []
    assert ix.p2p_lookup([1], "q", 3) == [("z", DISK, 1, 3)]


def test_many_slots_and_64_bit_keys() -> None:
    ix = ChunkIndex()
    keys = [2**64 - 1, -(2**63), 0, 2**63 + 5]
    for i in range(70):
        for wid in range(2):
            ix.admit(f"inst{i:02d}", wid, CPU if i % 2 else DISK, keys[: 1 + i % 4])
    hits = ix.prefix_hits(keys)
    assert len(hits) == 70
    assert hits["inst03"] == InstanceHit("inst03", 4, {CPU: 4}, (0, 1))
    assert hits["inst68"] == InstanceHit("inst68", 1, {DISK: 1}, (0, 1))
    assert [row[0] for row in ix.p2p_lookup(keys, "inst03", 1)[:3]] == [
        "inst07",
        "inst11",
        "inst15",
    ]


@pytest.mark.parametrize(
    ("name", "before"),
    [(TIER_ORDER[0], TIER_ORDER[1]), ("LocalDiskBackend", "RemoteBackend"), ("P2PBackend", "Zzz")],
)
def test_tier_rank_orders_fastest_first(name: str, before: str) -> None:
    assert tier_rank(name) < tier_rank(before)


def test_key_log_compaction_keeps_exactly_the_live_keys() -> None:
    ix = ChunkIndex()
    keys = [k * 7919 - 2**62 for k in range(3000)] + [2**64 - k for k in range(1, 50)]
    ix.admit("a", 0, CPU, keys)
    for _ in range(3):  # churn: evict most, re-admit some, several times over
        assert ix.evict("a", 0, CPU, keys[100:]) == len(keys) - 100
        assert ix.admit("a", 0, CPU, keys[2000:2500]) == 500
        assert ix.evict("a", 0, CPU, keys[2000:2500]) == 500
        assert ix.admit("a", 0, CPU, keys[100:]) == len(keys) - 100
    assert ix.evict("a", 0, CPU, keys[50:]) == len(keys) - 50
    assert sorted(ix.worker_keys("a", 0, CPU)) == sorted(keys[:50])
    assert ix.remove_worker("a", 0) == 50
    assert len(ix) == 0


def test_keys_that_are_not_int64_stay_consistent() -> None:
    """The protocol layer validates types; the index still never loses track of a key."""
    ix = ChunkIndex()
    odd: list[Any] = [2**64 + 1, -(2**70), "not-a-hash", 5]
    assert ix.admit("a", 0, CPU, odd) == 4
    assert sorted(map(str, ix.worker_keys("a", 0, CPU))) == sorted(map(str, odd))
    assert ix.prefix_hits(odd)["a"].hit_chunks == 4
    assert ix.remove_worker("a", 0) == 4
    assert len(ix) == 0 and ix.stats()["chunks"] == 0


def test_stats_without_a_sweep_do_not_touch_the_purged_keys() -> None:
    """A scrape right after a large purge does no sweep: the purged keys stay for the sweep
    loop (``chunks`` counts them meanwhile, every other figure is exact), and a sweep makes
    ``chunks`` exact again."""
    ix = ChunkIndex()
    ix.admit("a", 0, CPU, range(10_000))
    ix.admit("b", 0, CPU, range(10))
    assert ix.remove_worker("a", 0) == 10_000
    quick = ix.stats(sweep=False)
    assert quick == {
        "chunk_locations": 10,
        "chunks": 10_000,  # a's keys not swept yet
        "instances": 1,
        "workers": 1,
        "location:LocalCPUBackend": 10,
    }
    assert ix.sweep(0) > 0  # still all to sweep: the scrape swept nothing
    assert ix.stats() == {**quick, "chunks": 10}
