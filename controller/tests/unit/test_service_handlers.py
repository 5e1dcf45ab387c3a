"""The protocol handlers of ``ControllerService``, driven with decoded structs (no sockets).

Covers registration and the fingerprint check, admit/evict batches with sequence checks, events
from unknown or refused workers, TP-rank-aware P2P lookup, heartbeat re-registration with the
full-sync command, a full sync replacing a worker's keys, and the heartbeat TTL purge.
"""

from __future__ import annotations

import pytest

from kvpool.controller.service import ControllerService
from kvpool.controller.settings import ControllerSettings
from kvpool.protocol import lmcache_wire as p
from kvpool.protocol.deltas import DeltaBatch, DeltaOp, IndexReplica

FP = "0123456789ab"
ADMIT, EVICT = p.OpType.ADMIT, p.OpType.EVICT


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(**kw: object) -> tuple[ControllerService, Clock]:
    clock = Clock()
    settings = ControllerSettings(monitor_ports={"pull": 0}, **kw)  # type: ignore[arg-type]
    return ControllerService(settings, clock=clock), clock


def register(
    svc: ControllerService, inst: str, worker: int = 0, peer: str | None = "peer"
) -> object:
    return svc.handle_request(p.RegisterMsg(inst, worker, "10.0.0.1", 9000 + worker, peer))


def batch(
    inst: str, ops: list[tuple[p.OpType, int, int]], worker: int = 0, loc: str = "LocalCPUBackend"
) -> p.BatchedKVOperationMsg:
    return p.BatchedKVOperationMsg(inst, worker, loc, [p.KVOpEvent(o, k, s) for o, k, s in ops])


def test_admit_evict_and_prefix_lookup() -> None:
    svc, _ = make()
    assert isinstance(register(svc, "a"), p.RegisterRetMsg)
    svc.handle_push(batch("a", [(ADMIT, 1, 0), (ADMIT, 2, 1), (ADMIT, 3, 2), (EVICT, 3, 3)]))
    hits = svc.prefix_lookup([1, 2, 3])
    assert hits["a"]["hit_chunks"] == 2
    assert hits["a"]["per_location"] == {"LocalCPUBackend": 2}
    assert hits["a"]["workers"][0]["url"] == "10.0.0.1:9000"


def test_stale_and_gap_sequence_numbers_are_counted_and_stale_ones_dropped() -> None:
    svc, _ = make()
    register(svc, "a")
    svc.handle_push(batch("a", [(ADMIT, 1, 0), (ADMIT, 2, 1)]))
    svc.handle_push(batch("a", [(EVICT, 1, 1)]))  # replay of an old number: must not evict
    assert svc.prefix_lookup([1])["a"]["hit_chunks"] == 1
    svc.handle_push(batch("a", [(ADMIT, 3, 5)]))  # gap: applied, counted
    assert svc.metrics.bad_input["seq_stale"] == 1
    assert svc.metrics.bad_input["seq_gap"] == 1
    assert svc.prefix_lookup([1, 2, 3])["a"]["hit_chunks"] == 3


def test_events_for_unknown_worker_are_dropped_and_counted() -> None:
    svc, _ = make()
    svc.handle_push(batch("ghost", [(ADMIT, 1, 0)]))
    assert svc.metrics.bad_input["unknown_worker"] == 1
    assert len(svc.index) == 0


def test_fingerprint_mismatch_is_refused_named_and_counted() -> None:
    svc, _ = make(fingerprint=FP)
    reply = register(svc, "pod-1~ffffffffffff")
    assert isinstance(reply, p.ErrorMsg)
    assert FP in reply.error and "ffffffffffff" in reply.error
    assert svc.metrics.refusals["fingerprint"] == 1
    svc.handle_push(batch("pod-1~ffffffffffff", [(ADMIT, 1, 0)]))
    assert svc.metrics.bad_input["refused_instance"] == 1
    assert len(svc.index) == 0 and len(svc.registry) == 0
    # heartbeats from it do not sneak it in
    hb = svc.handle_request(p.HeartbeatMsg("pod-1~ffffffffffff", 0, "h", 1, None))
    assert isinstance(hb, p.ErrorMsg) and len(svc.registry) == 0
    # the right fingerprint and an unsuffixed id are accepted
    assert isinstance(register(svc, f"pod-2~{FP}"), p.RegisterRetMsg)
    assert isinstance(register(svc, "legacy"), p.RegisterRetMsg)


def test_require_fingerprint_refuses_unsuffixed_ids() -> None:
    svc, _ = make(fingerprint=FP, require_fingerprint=True)
    reply = register(svc, "legacy")
    assert isinstance(reply, p.ErrorMsg) and "suffix" in reply.error


def test_p2p_lookup_is_tp_rank_aware_and_skips_the_requester() -> None:
    svc, _ = make()
    for inst in ("a", "b"):
        for rank in (0, 1):
            register(svc, inst, rank, peer=f"{inst}-peer-{rank}")
    svc.handle_push(batch("b", [(ADMIT, 1, 0), (ADMIT, 2, 1)], worker=1))
    svc.handle_push(batch("a", [(ADMIT, 1, 0), (ADMIT, 2, 1)], worker=1))
    reply = svc.handle_request(p.BatchedP2PLookupMsg([1, 2, 9], "a", 1))
    assert reply.layout_info == [("b", "LocalCPUBackend", 2, "b-peer-1")]
    miss = svc.handle_request(p.BatchedP2PLookupMsg([1, 2], "a", 0))
    assert miss.layout_info == [("", "", 0, "")]


def test_unknown_heartbeat_reregisters_and_asks_for_full_sync() -> None:
    svc, _ = make()
    reply = svc.handle_request(p.HeartbeatMsg("a", 0, "10.0.0.1", 9000, "peer"))
    assert isinstance(reply.commands[0], p.FullSyncCommand)
    assert svc.registry.get("a", 0) is not None
    start = svc.handle_request(p.FullSyncStartMsg("a", 0, "LocalCPUBackend", "s1", 3, 2))
    assert start.accepted
    svc.handle_push(batch("a", [(ADMIT, 99, 0)]))  # incremental events during sync: dropped
    svc.handle_push(p.FullSyncBatchMsg("a", 0, "LocalCPUBackend", "s1", 0, [1, 2]))
    status = svc.handle_request(p.FullSyncStatusMsg("a", 0, "s1"))
    assert status.missing_batches == [1] and not status.is_complete
    svc.handle_push(p.FullSyncBatchMsg("a", 0, "LocalCPUBackend", "s1", 1, [3]))
    svc.handle_push(p.FullSyncEndMsg("a", 0, "LocalCPUBackend", "s1", 3))
    status = svc.handle_request(p.FullSyncStatusMsg("a", 0, "s1"))
    assert status.is_complete and status.can_exit_freeze
    assert sorted(svc.index.worker_keys("a", 0, "LocalCPUBackend")) == [1, 2, 3]
    assert svc.handle_request(p.HeartbeatMsg("a", 0, "10.0.0.1", 9000, "peer")).commands == []


def test_ttl_purge_removes_worker_and_its_keys() -> None:
    svc, clock = make(lmcache_worker_timeout=10, health_check_interval=1)
    register(svc, "a")
    register(svc, "b")
    svc.handle_push(batch("a", [(ADMIT, 1, 0)]))
    svc.handle_push(batch("b", [(ADMIT, 1, 0)]))
    clock.now += 5
    svc.handle_request(p.HeartbeatMsg("b", 0, "10.0.0.1", 9000, "peer"))
    clock.now += 6
    purged = svc.purge_expired()
    assert [r.instance_id for r in purged] == ["a"]
    assert svc.metrics.purges == 1
    assert set(svc.prefix_lookup([1])) == {"b"}
    assert svc.registry.get("a", 0) is None


def test_reregistration_drops_what_the_restarted_worker_held() -> None:
    svc, _ = make()
    register(svc, "a")
    svc.handle_push(batch("a", [(ADMIT, 1, 0)]))
    register(svc, "a")
    assert svc.prefix_lookup([1]) == {}
    svc.handle_push(batch("a", [(ADMIT, 1, 0)]))  # sequence restarts at 0 after re-register
    assert svc.prefix_lookup([1])["a"]["hit_chunks"] == 1


def test_deltas_rebuild_the_same_index_in_a_replica() -> None:
    svc, _ = make()
    svc.record_deltas = True
    register(svc, "a")
    register(svc, "b", 1)
    svc.handle_push(batch("a", [(ADMIT, 1, 0), (ADMIT, 2, 1), (EVICT, 1, 2), (ADMIT, 1, 3)]))
    svc.handle_push(batch("b", [(ADMIT, 1, 0)], worker=1))
    svc.deregister("b", 1, "test")
    deltas = svc.take_deltas()
    assert [d.seq for d in deltas] == list(range(len(deltas)))
    assert deltas[-1].op is DeltaOp.WORKER_DOWN
    replica = IndexReplica()
    empty = svc.snapshot()  # nothing taken since: consistent with last_seq
    assert empty.seq == deltas[-1].seq
    replica.load_snapshot(empty)
    assert replica.prefix_hits([1, 2]) == svc.index.prefix_hits([1, 2])


@pytest.mark.parametrize("op", [p.ClearWorkerMsg("e", "L"), p.RegisterRetMsg()])
def test_wrong_direction_messages_are_counted_not_crashing(op: object) -> None:
    svc, _ = make()
    svc.handle_push(op)
    assert isinstance(svc.handle_request(op), p.ErrorMsg)
    assert svc.metrics.bad_input["unexpected_type"] == 2


def test_replica_follows_batches_detects_gaps_and_epochs() -> None:
    svc, _ = make()
    svc.record_deltas = True
    replica = IndexReplica()
    replica.load_snapshot(svc.snapshot())
    register(svc, "a")
    svc.handle_push(batch("a", [(ADMIT, 1, 0)]))
    assert replica.apply_batch(DeltaBatch(svc.epoch, svc.take_deltas()))
    assert replica.prefix_hits([1])["a"].hit_chunks == 1
    svc.handle_push(batch("a", [(ADMIT, 2, 1)]))
    svc.take_deltas()  # lost on the wire
    svc.handle_push(batch("a", [(ADMIT, 3, 2)]))
    assert not replica.apply_batch(DeltaBatch(svc.epoch, svc.take_deltas()))
    assert replica.needs_snapshot and replica.gaps == 1
    svc.handle_push(batch("a", [(EVICT, 1, 3)]))
    later = svc.take_deltas()
    snap = svc.snapshot()  # the snapshot is taken after ``later`` was numbered
    assert replica.load_snapshot(snap)
    assert replica.apply_batch(DeltaBatch(svc.epoch, later))  # already included: skipped
    assert replica.prefix_hits([1]) == {}
    assert replica.prefix_hits([2, 3])["a"].hit_chunks == 2
    assert not replica.apply_batch(DeltaBatch("another-epoch", []))
    assert replica.needs_snapshot
