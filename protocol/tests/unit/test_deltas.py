"""The delta stream's bytes are pinned, and the pure IndexReplica follows it through gaps,
restarts and snapshots, answering prefix lookups as the controller's own index would.

The golden frames were produced by the controller's deltas module before it moved here: a
change to them breaks every gateway replica that is not upgraded in the same instant.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.protocol.deltas import (
    Delta,
    DeltaBatch,
    DeltaOp,
    IndexReplica,
    LocationEntry,
    Snapshot,
    WorkerEntry,
    apply_delta,
    decode_batch,
    decode_snapshot,
    encode,
)
from kvpool.protocol.index import ChunkIndex

CPU, DISK = "LocalCPUBackend", "LocalDiskBackend"
GOLDEN_BATCH = bytes.fromhex(
    "92a26531929800a9776f726b65725f7570a4617e667000a090a97463703a2f2f683a31a97463703a2f2f683a"
    "329801a561646d6974a4617e667000af4c6f63616c4350554261636b656e649301fecf7fffffffffffffffc0c0"
)
GOLDEN_SNAPSHOT = bytes.fromhex(
    "94a26531019194a4617e667000a97463703a2f2f683a31c09194a4617e667000af4c6f63616c4350554261636b"
    "656e649201fe"
)


def test_frames_are_byte_identical_to_the_controllers() -> None:
    batch = DeltaBatch(
        "e1",
        [
            Delta(0, DeltaOp.WORKER_UP, "a~fp", 0, url="tcp://h:1", peer_init_url="tcp://h:2"),
            Delta(1, DeltaOp.ADMIT, "a~fp", 0, CPU, [1, -2, 2**63 - 1]),
        ],
    )
    snap = Snapshot(
        "e1",
        1,
        [WorkerEntry("a~fp", 0, "tcp://h:1", None)],
        [LocationEntry("a~fp", 0, CPU, [1, -2])],
    )
    assert encode(batch) == GOLDEN_BATCH
    assert encode(snap) == GOLDEN_SNAPSHOT
    assert decode_batch(GOLDEN_BATCH) == batch
    assert decode_snapshot(GOLDEN_SNAPSHOT) == snap


def test_a_frame_of_another_type_is_refused() -> None:
    with pytest.raises(msgspec.ValidationError):
        decode_batch(GOLDEN_SNAPSHOT)
    with pytest.raises(msgspec.DecodeError):
        decode_snapshot(b"\xc1not msgpack")


def admit(seq: int, keys: list[int], inst: str = "a", loc: str = CPU, worker: int = 0) -> Delta:
    return Delta(seq, DeltaOp.ADMIT, inst, worker, loc, keys)


def synced(epoch: str = "e1", seq: int = -1) -> IndexReplica:
    replica = IndexReplica()
    assert replica.load_snapshot(Snapshot(epoch, seq, [], []))
    return replica


def test_nothing_is_answered_before_the_first_snapshot() -> None:
    replica = IndexReplica()
    assert replica.needs_snapshot
    assert not replica.apply_batch(DeltaBatch("e1", [admit(0, [1])]))
    assert replica.prefix_hits([1]) == {}
    assert replica.load_snapshot(Snapshot("e1", -1, [], []))  # replays the buffered delta
    assert replica.prefix_hits([1])["a"].hit_chunks == 1


def test_longest_prefix_per_instance_with_tiers() -> None:
    replica = synced()
    assert replica.apply_batch(
        DeltaBatch(
            "e1",
            [
                admit(0, [1, 2, 3], "a", CPU),
                admit(1, [3, 4], "a", DISK),
                admit(2, [1], "b", CPU, worker=1),
            ],
        )
    )
    hits = replica.prefix_hits([1, 2, 3, 4, 5])
    assert hits["a"].hit_chunks == 4 and hits["a"].per_location == {CPU: 3, DISK: 2}
    assert hits["b"].hit_chunks == 1 and hits["b"].workers == (1,)


def test_a_gap_asks_for_a_snapshot_and_buffers_the_rest() -> None:
    replica = synced()
    assert replica.apply_batch(DeltaBatch("e1", [admit(0, [1])]))
    assert not replica.apply_batch(DeltaBatch("e1", [admit(2, [1, 2]), admit(3, [9], "b")]))
    assert replica.needs_snapshot and replica.gaps == 1
    # the snapshot covers 0..1 (delta 1 was lost on the wire); 2 and 3 are replayed from the buffer
    snap = Snapshot("e1", 1, [], [LocationEntry("a", 0, CPU, [1])])
    assert replica.load_snapshot(snap)
    assert replica.seq == 3 and not replica.needs_snapshot
    assert replica.prefix_hits([1, 2])["a"].hit_chunks == 2
    assert replica.prefix_hits([9])["b"].hit_chunks == 1


def test_duplicates_and_already_snapshotted_deltas_are_skipped() -> None:
    replica = synced(seq=5)
    assert replica.apply_batch(DeltaBatch("e1", [admit(4, [7]), admit(6, [1]), admit(6, [1])]))
    assert replica.seq == 6 and replica.prefix_hits([7]) == {}


def test_a_new_epoch_resyncs() -> None:
    replica = synced()
    assert replica.apply_batch(DeltaBatch("e1", [admit(0, [1, 2])]))
    assert not replica.apply_batch(DeltaBatch("e2", [admit(0, [5])]))  # controller restarted
    assert replica.needs_snapshot and replica.gaps == 1
    assert replica.prefix_hits([1])["a"].hit_chunks == 1  # still answers from the old state
    assert replica.load_snapshot(Snapshot("e2", -1, [], []))
    assert replica.epoch == "e2" and replica.prefix_hits([1]) == {}
    assert replica.prefix_hits([5])["a"].hit_chunks == 1


def test_a_gap_inside_the_buffer_asks_again() -> None:
    replica = IndexReplica()
    replica.apply_batch(DeltaBatch("e1", [admit(5, [1]), admit(7, [2])]))
    assert not replica.load_snapshot(Snapshot("e1", 4, [], []))
    assert replica.needs_snapshot and replica.seq == 5


def test_the_buffer_is_bounded() -> None:
    replica = IndexReplica(max_buffered=3)
    replica.apply_batch(DeltaBatch("e1", [admit(i, [i]) for i in range(10)]))
    assert not replica.load_snapshot(Snapshot("e1", 2, [], []))  # only 7..9 were kept
    assert replica.needs_snapshot
    assert replica.load_snapshot(Snapshot("e1", 6, [], []))  # ...and are replayed onto this one
    assert replica.seq == 9 and replica.prefix_hits([9])["a"].hit_chunks == 1


def test_workers_follow_up_and_down() -> None:
    replica = synced()
    up = Delta(0, DeltaOp.WORKER_UP, "a", 0, url="tcp://h:1", peer_init_url=None)
    down = Delta(2, DeltaOp.WORKER_DOWN, "a", 0)
    assert replica.apply_batch(DeltaBatch("e1", [up, admit(1, [1])]))
    assert replica.workers[("a", 0)].url == "tcp://h:1"
    assert replica.apply_batch(DeltaBatch("e1", [down]))
    assert replica.workers == {} and replica.prefix_hits([1]) == {}


ops_st = st.lists(
    st.tuples(
        st.sampled_from(
            [DeltaOp.ADMIT, DeltaOp.EVICT, DeltaOp.REPLACE, DeltaOp.CLEAR, DeltaOp.WORKER_DOWN]
        ),
        st.sampled_from(["a", "b"]),
        st.integers(0, 1),
        st.sampled_from([CPU, DISK]),
        st.lists(st.integers(0, 6), max_size=5),
    ),
    max_size=40,
)


@settings(max_examples=100, deadline=None)
@given(ops=ops_st, drop=st.sets(st.integers(0, 39)))
def test_replica_equals_the_source_index_after_any_losses(
    ops: list[tuple[DeltaOp, str, int, str, list[int]]], drop: set[int]
) -> None:
    """Whatever deltas are lost, the next delta that arrives reveals it and a snapshot of the
    source plus the buffered stream brings the replica level (the last delta is always
    delivered: a loss at the very end of the stream is only visible once another one comes)."""
    source = ChunkIndex()
    replica = synced()
    deltas = [
        Delta(seq, op, inst, worker, loc, keys)
        for seq, (op, inst, worker, loc, keys) in enumerate(ops)
    ]
    deltas.append(Delta(len(deltas), DeltaOp.WORKER_UP, "c", 0, url="tcp://c:1"))
    drop.discard(len(deltas) - 1)
    for delta in deltas:
        apply_delta(source, delta)
        if delta.seq not in drop:
            replica.apply_batch(DeltaBatch("e1", [delta]))
    if replica.needs_snapshot:
        entries = [
            LocationEntry(inst, worker, loc, source.worker_keys(inst, worker, loc))
            for inst in ("a", "b")
            for worker in (0, 1)
            for loc in (CPU, DISK)
        ]
        workers = [WorkerEntry("c", 0, "tcp://c:1", None)]
        assert replica.load_snapshot(Snapshot("e1", len(deltas) - 1, workers, entries))
    assert replica.seq == len(deltas) - 1 and ("c", 0) in replica.workers
    probe = list(range(7))
    for start in range(7):
        assert replica.prefix_hits(probe[start:]) == source.prefix_hits(probe[start:])


# ------------------------------------------------------------------ leadership terms


def test_term_zero_frames_are_unchanged_and_terms_round_trip() -> None:
    """A single controller's frames stay byte-identical (term 0 is not encoded); a standby that
    took over publishes its term and where it started."""
    assert encode(DeltaBatch("e1", [], 0, 0)) == encode(DeltaBatch("e1", []))
    batch = DeltaBatch("e1", [admit(7, [1])], term=2, term_start=7)
    assert decode_batch(encode(batch)) == batch
    snap = Snapshot("e1", 6, [], [], term=2)
    assert decode_snapshot(encode(snap)) == snap


def test_a_new_term_that_starts_where_the_replica_stands_continues() -> None:
    """The standby had every delta this replica had (0..1): the new leader's first batch
    (term 1, from delta 2) applies without a snapshot; the epoch stays."""
    replica = synced()
    assert replica.apply_batch(DeltaBatch("e1", [admit(0, [1]), admit(1, [2])]))
    assert replica.apply_batch(DeltaBatch("e1", [admit(2, [3])], term=1, term_start=2))
    assert replica.term == 1 and replica.seq == 2 and replica.epoch == "e1"
    assert replica.gaps == 0 and replica.prefix_hits([1, 2, 3])["a"].hit_chunks == 3


def test_a_replica_ahead_of_the_new_leader_resyncs_once() -> None:
    """This replica saw delta 2 of the old leader, the standby did not: the new leader numbers
    its own first change 2 too. Continuing would skip it, so the replica asks for a snapshot."""
    replica = synced()
    assert replica.apply_batch(DeltaBatch("e1", [admit(0, [1]), admit(1, [2]), admit(2, [8])]))
    assert not replica.apply_batch(DeltaBatch("e1", [admit(2, [3])], term=1, term_start=2))
    assert replica.needs_snapshot and replica.gaps == 1
    snap = Snapshot("e1", 1, [], [LocationEntry("a", 0, CPU, [1, 2])], term=1)
    assert replica.load_snapshot(snap)  # the new leader's snapshot, then its buffered delta 2
    assert replica.term == 1 and replica.seq == 2
    assert replica.prefix_hits([1, 2, 3])["a"].hit_chunks == 3
    assert replica.prefix_hits([8]) == {}  # the old leader's last delta is not in the index


def test_a_replica_behind_the_new_leader_resyncs() -> None:
    replica = synced()
    assert replica.apply_batch(DeltaBatch("e1", [admit(0, [1])]))
    assert not replica.apply_batch(DeltaBatch("e1", [admit(3, [3])], term=1, term_start=3))
    assert replica.needs_snapshot


def test_an_older_terms_batch_is_ignored() -> None:
    """A deposed leader's late batch never overwrites the new leader's numbering."""
    replica = synced()
    assert replica.apply_batch(DeltaBatch("e1", [admit(0, [1])], term=2, term_start=0))
    assert replica.apply_batch(DeltaBatch("e1", [admit(1, [9])], term=1, term_start=0))
    assert replica.seq == 0 and replica.stale_batches == 1 and replica.prefix_hits([9]) == {}


def test_buffered_deltas_of_another_term_are_not_replayed_onto_a_snapshot() -> None:
    replica = IndexReplica()
    replica.apply_batch(DeltaBatch("e1", [admit(5, [1])], term=1, term_start=0))
    replica.apply_batch(DeltaBatch("e1", [admit(5, [2])], term=2, term_start=5))
    assert replica.load_snapshot(Snapshot("e1", 4, [], [], term=2))
    assert replica.seq == 5 and replica.term == 2
    assert replica.prefix_hits([2])["a"].hit_chunks == 1 and replica.prefix_hits([1]) == {}
