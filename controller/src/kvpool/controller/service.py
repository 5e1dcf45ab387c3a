"""The controller's brain: what each protocol message does to the registry and the index.

Why separate from the sockets: every message handler here is a plain method taking a decoded
struct, so the unit tests drive the whole protocol without ZMQ, and the transport
(``server.py``) stays a thin loop. Handlers never raise on bad input: they count it (by kind),
log it once per kind, and leave the index untouched.

Index changes are recorded as numbered :class:`~kvpool.protocol.deltas.Delta` s when someone
consumes them (the PUB stream or the Redis write-behind); ``take_deltas`` hands them over.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from kvpool.controller import fullsync
from kvpool.controller.allowlist import Allowlist
from kvpool.controller.control import ControlError, ControlPlane
from kvpool.controller.metrics import Metrics
from kvpool.controller.registry import Registry, WorkerRecord, check_fingerprint
from kvpool.controller.settings import ControllerSettings
from kvpool.protocol import lmcache_wire as p
from kvpool.protocol.deltas import Delta, DeltaOp, LocationEntry, Snapshot, WorkerEntry
from kvpool.protocol.hashing import chunk_hashes
from kvpool.protocol.http_api import prefix_lookup_entry
from kvpool.protocol.index import ChunkIndex, tier_rank

logger = logging.getLogger(__name__)

#: Refused instance ids kept (with their reason) for events, logs and /v1/stats: a stranger
#: trying ever new ids must not grow the controller's memory; counts stay in the metrics.
REFUSED_KEPT = 1024


class ControllerService:
    """Registry + index + the handlers of every LMCache controller message."""

    def __init__(
        self,
        settings: ControllerSettings,
        control: ControlPlane | None = None,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.index = ChunkIndex()
        self.registry = Registry()
        self.control = control
        self.metrics = metrics or Metrics()
        self.clock = clock
        self.epoch = uuid.uuid4().hex[:12]
        self.term = 0  # leadership term within the epoch (standby.adopt starts the next one)
        self.term_start = 0  # the first delta number of this term
        self.heartbeat_url: str | None = None  # told to workers at registration
        self.record_deltas = False
        self._deltas: list[Delta] = []
        self._seq = -1
        self._logged_kinds: set[str] = set()
        self._warned_unsuffixed: set[str] = set()
        self._refused: dict[str, str] = {}  # instance id -> reason, the last REFUSED_KEPT
        #: The instance ids that may register (allowlist.py; none given: every id may).
        self.allowlist = Allowlist()
        self.logged_unauthorized: set[str] = set()  # routes whose 401 was logged (auth.py)
        self._events: dict[str, str] = {}  # orchestration event id -> status
        m = self.metrics
        m.gauges["instances"] = lambda: float(len(self.registry.instances()))
        m.gauges["workers"] = lambda: float(len(self.registry))
        m.gauges["chunks"] = lambda: float(self.index.stats(sweep=False)["chunks"])
        m.gauges["full_sync_progress"] = self.registry.sync_progress
        m.location_counts = self._location_counts
        self._observe_p2p = m.lookup_seconds.labels("p2p").observe
        self._observe_prefix = m.lookup_seconds.labels("prefix").observe
        self._observe_lookup = m.lookup_seconds.labels("lookup").observe

    # ------------------------------------------------------------------ bookkeeping

    def _location_counts(self) -> dict[str, int]:
        return {
            k.removeprefix("location:"): v
            for k, v in self.index.stats(sweep=False).items()
            if k.startswith("location:")
        }

    @property
    def refused(self) -> dict[str, str]:
        """Refused instance ids and why, in the order they were first refused (read-only)."""
        return dict(self._refused)

    def bad(self, kind: str, detail: str) -> None:
        """Count one piece of bad input; log the first of each kind (the rest only count)."""
        self.metrics.bad_input[kind] += 1
        if kind not in self._logged_kinds:
            self._logged_kinds.add(kind)
            logger.warning(
                "bad input (%s): %s; further %s inputs are only counted", kind, detail, kind
            )

    def emit(
        self,
        op: DeltaOp,
        instance_id: str,
        worker_id: int,
        location: str = "",
        keys: list[int] | None = None,
        url: str | None = None,
        peer_init_url: str | None = None,
    ) -> None:
        if not self.record_deltas:
            return
        self._seq += 1
        self._deltas.append(
            Delta(self._seq, op, instance_id, worker_id, location, keys or [], url, peer_init_url)
        )

    def take_deltas(self) -> list[Delta]:
        deltas, self._deltas = self._deltas, []
        return deltas

    @property
    def last_seq(self) -> int:
        return self._seq

    def continue_stream(self, epoch: str, seq: int, term: int) -> None:
        """Number the next delta ``seq + 1`` of ``epoch``, in ``term`` (a standby taking over
        the leader's stream, ``standby.adopt``)."""
        self.epoch, self._seq, self.term, self.term_start = epoch, seq, term, seq + 1

    def snapshot(self) -> Snapshot:
        """The whole index and worker table, consistent with ``last_seq`` (call after taking)."""
        workers = [
            WorkerEntry(r.instance_id, r.worker_id, r.url, r.peer_init_url)
            for r in self.registry.records()
        ]
        entries = []
        for r in self.registry.records():
            for location in self.index.locations_of(r.instance_id, r.worker_id):
                keys = self.index.worker_keys(r.instance_id, r.worker_id, location)
                entries.append(LocationEntry(r.instance_id, r.worker_id, location, keys))
        return Snapshot(self.epoch, self._seq, workers, entries, self.term)

    # ------------------------------------------------------------------ membership

    def _refuse(self, instance_id: str, kind: str, reason: str) -> str:
        """Count and remember a refused registration (logged once per id); returns ``reason``."""
        self.metrics.refusals[kind] += 1
        if instance_id not in self._refused:
            logger.error("refusing instance %s: %s", instance_id, reason)
            if len(self._refused) >= REFUSED_KEPT:  # the oldest first refused goes
                del self._refused[next(iter(self._refused))]
        self._refused[instance_id] = reason
        return reason

    def _admit_identity(self, instance_id: str) -> str | None:
        """Fingerprint and allowlist checks; returns the refusal reason, or None when accepted."""
        verdict = check_fingerprint(
            instance_id, self.settings.fingerprint, require=self.settings.require_fingerprint
        )
        if not verdict.accepted:
            return self._refuse(instance_id, "fingerprint", verdict.reason)
        if not self.allowlist.allows(instance_id):
            return self._refuse(
                instance_id,
                "unknown_instance",
                f"instance id {instance_id!r} is not one the operator rendered for this domain "
                f"({len(self.allowlist.ids or ())} allowed, from {self.allowlist.source}): a pod "
                "of a deleted member or of another pool, or not kvpool's",
            )
        if (
            verdict.fingerprint is None
            and self.settings.fingerprint is not None
            and instance_id not in self._warned_unsuffixed
        ):
            self._warned_unsuffixed.add(instance_id)
            logger.warning(
                "instance %s carries no '~<fingerprint>' suffix; accepted without a "
                "cache-domain check (expected %s; --require-fingerprint refuses such ids)",
                instance_id,
                self.settings.fingerprint,
            )
        return None

    def register(
        self, instance_id: str, worker_id: int, ip: str, port: int, peer_init_url: str | None
    ) -> str | None:
        """Register (or re-register) a worker; returns the refusal reason when refused."""
        reason = self._admit_identity(instance_id)
        if reason is not None:
            return reason
        self._refused.pop(instance_id, None)  # refused before it was allowed (a scale-up)
        record, known = self.registry.register(
            instance_id, worker_id, ip, port, peer_init_url, self.clock()
        )
        if known:
            # A worker that registers again restarted: whatever it held is gone.
            self._drop_worker_keys(instance_id, worker_id)
            logger.info("worker %s/%s re-registered at %s", instance_id, worker_id, record.url)
        else:
            logger.info("worker %s/%s registered at %s", instance_id, worker_id, record.url)
        if self.control is not None:
            self.control.set_worker(instance_id, worker_id, record.url)
        self.emit(
            DeltaOp.WORKER_UP, instance_id, worker_id, url=record.url, peer_init_url=peer_init_url
        )
        return None

    def _drop_worker_keys(self, instance_id: str, worker_id: int) -> int:
        for location in self.index.locations_of(instance_id, worker_id):
            self.emit(DeltaOp.CLEAR, instance_id, worker_id, location)
        return self.index.remove_worker(instance_id, worker_id)

    def deregister(self, instance_id: str, worker_id: int, reason: str) -> bool:
        record = self.registry.deregister(instance_id, worker_id)
        if record is None:
            return False
        removed = self._drop_worker_keys(instance_id, worker_id)
        if self.control is not None:
            self.control.drop_worker(instance_id, worker_id)
        self.emit(DeltaOp.WORKER_DOWN, instance_id, worker_id)
        logger.info(
            "worker %s/%s removed (%s); %d chunk-locations dropped",
            instance_id,
            worker_id,
            reason,
            removed,
        )
        return True

    def purge_expired(self) -> list[WorkerRecord]:
        """Drop workers that missed the heartbeat TTL; also fail stuck full syncs."""
        now = self.clock()
        expired = self.registry.expired(now, self.settings.lmcache_worker_timeout)
        for record in expired:
            logger.warning(
                "purging worker %s/%s at %s: no heartbeat for %.1fs (timeout %gs)",
                record.instance_id,
                record.worker_id,
                record.url,
                now - record.last_heartbeat_time,
                self.settings.lmcache_worker_timeout,
            )
            self.deregister(record.instance_id, record.worker_id, "heartbeat TTL")
            self.metrics.purges += 1
        for record in self.registry.expire_syncs(now, self.settings.full_sync_timeout_s):
            self.metrics.full_syncs["timeout"] += 1
            logger.warning(
                "full sync of worker %s/%s timed out", record.instance_id, record.worker_id
            )
        return expired

    # ------------------------------------------------------------------ push messages

    def handle_push(self, msg: Any) -> None:
        """A fire-and-forget message from the PULL socket."""
        name = type(msg).__name__
        self.metrics.messages[name] += 1
        match msg:
            case p.BatchedKVOperationMsg():
                self._kv_batch(msg.instance_id, msg.worker_id, msg.location, msg.operations)
            case p.KVAdmitMsg() | p.KVEvictMsg():
                op = p.OpType.ADMIT if isinstance(msg, p.KVAdmitMsg) else p.OpType.EVICT
                self._kv_batch(
                    msg.instance_id,
                    msg.worker_id,
                    msg.location,
                    [p.KVOpEvent(op, msg.key, msg.seq_num)],
                )
            case p.RegisterMsg():
                self.register(msg.instance_id, msg.worker_id, msg.ip, msg.port, msg.peer_init_url)
            case p.DeRegisterMsg():
                if not self.deregister(msg.instance_id, msg.worker_id, "deregistered"):
                    self.bad(
                        "unknown_worker",
                        f"deregister of unknown worker {msg.instance_id}/{msg.worker_id}",
                    )
            case p.FullSyncBatchMsg():
                fullsync.sync_batch(self, msg)
            case p.FullSyncEndMsg():
                fullsync.sync_end(self, msg)
            case _:
                self.bad("unexpected_type", f"{name} is not a push message")

    def worker_for_event(self, instance_id: str, worker_id: int) -> WorkerRecord | None:
        record = self.registry.get(instance_id, worker_id)
        if record is None:
            if instance_id in self._refused:
                self.bad(
                    "refused_instance",
                    f"event from refused instance {instance_id}: {self._refused[instance_id]}",
                )
            else:
                self.bad(
                    "unknown_worker", f"event from unregistered worker {instance_id}/{worker_id}"
                )
        return record

    def _kv_batch(
        self, instance_id: str, worker_id: int, location: str, operations: list[p.KVOpEvent]
    ) -> None:
        record = self.worker_for_event(instance_id, worker_id)
        if record is None or not operations:
            return
        if self.registry.is_syncing(record):
            self.bad(
                "during_full_sync",
                f"incremental events of {instance_id}/{worker_id} during its full sync",
            )
            return
        seq = record.seq
        last = seq.get(location)
        first, n = operations[0].seq_num, len(operations)
        if (last is None or first > last) and operations[-1].seq_num == first + n - 1:
            # The common case (one sender, consecutive numbers, one kind): no per-event checks,
            # and one pass collects the keys while it checks the kind.
            op = operations[0].op_type
            keys = [ev.key for ev in operations if ev.op_type is op]
            if len(keys) == n:
                seq[location] = first + n - 1
                self._apply_run(instance_id, worker_id, location, op, keys)
                if last is not None and first != last + 1:
                    self.bad(
                        "seq_gap",
                        f"sequence gap in events of {instance_id}/{worker_id}/{location}",
                    )
                return
        gap = stale = 0
        run_op: p.OpType | None = None
        run: list[int] = []
        for ev in operations:
            n = ev.seq_num
            if last is not None:
                if n <= last:
                    stale += 1
                    continue
                if n != last + 1:
                    gap += 1
            last = n
            if ev.op_type is not run_op:
                if run:
                    self._apply_run(instance_id, worker_id, location, run_op, run)
                run_op, run = ev.op_type, []
            run.append(ev.key)
        if run:
            self._apply_run(instance_id, worker_id, location, run_op, run)
        if last is not None:
            seq[location] = last
        if gap:
            self.bad("seq_gap", f"sequence gap in events of {instance_id}/{worker_id}/{location}")
        if stale:
            self.bad(
                "seq_stale",
                f"{stale} stale or duplicate events of {instance_id}/{worker_id}/{location}",
            )

    def _apply_run(
        self, instance_id: str, worker_id: int, location: str, op: p.OpType | None, keys: list[int]
    ) -> None:
        if op is p.OpType.ADMIT:
            self.index.admit(instance_id, worker_id, location, keys)
            self.emit(DeltaOp.ADMIT, instance_id, worker_id, location, keys)
        else:
            self.index.evict(instance_id, worker_id, location, keys)
            self.emit(DeltaOp.EVICT, instance_id, worker_id, location, keys)

    # ------------------------------------------------------------------ requests

    def handle_request(self, msg: Any) -> Any:
        """A worker request from the ROUTER (or heartbeat ROUTER); returns the reply struct."""
        name = type(msg).__name__
        self.metrics.messages[name] += 1
        match msg:
            case p.BatchedP2PLookupMsg():
                return self.p2p_lookup(msg)
            case p.HeartbeatMsg():
                return self.heartbeat(msg)
            case p.RegisterMsg():
                reason = self.register(
                    msg.instance_id, msg.worker_id, msg.ip, msg.port, msg.peer_init_url
                )
                if reason is not None:
                    return p.ErrorMsg(f"registration refused: {reason}")
                extra = {"heartbeat_url": self.heartbeat_url} if self.heartbeat_url else {}
                return p.RegisterRetMsg(extra)
            case p.FullSyncStartMsg():
                return fullsync.sync_start(self, msg)
            case p.FullSyncStatusMsg():
                return fullsync.sync_status(self, msg)
            case _:
                self.bad("unexpected_type", f"{name} is not a worker request")
                return p.ErrorMsg(f"Unknown message type: {name}")

    def heartbeat(self, msg: p.HeartbeatMsg) -> p.HeartbeatRetMsg | p.ErrorMsg:
        record = self.registry.heartbeat(msg.instance_id, msg.worker_id, self.clock())
        if record is None:
            # Unknown (controller restarted, or purged): re-register and ask for everything.
            reason = self.register(
                msg.instance_id, msg.worker_id, msg.ip, msg.port, msg.peer_init_url
            )
            if reason is not None:
                return p.ErrorMsg(f"registration refused: {reason}")
            if self.settings.persistence == "none":
                return p.HeartbeatRetMsg()  # no recovery: the index refills from new admits
            record = self.registry.get(msg.instance_id, msg.worker_id)
            assert record is not None
            record.needs_full_sync = True
            return p.HeartbeatRetMsg([p.FullSyncCommand(reason="worker_re_registered")])
        if record.needs_full_sync and not self.registry.is_syncing(record):
            return p.HeartbeatRetMsg([p.FullSyncCommand(reason="sync_failed_retry")])
        return p.HeartbeatRetMsg()

    def p2p_lookup(self, msg: p.BatchedP2PLookupMsg) -> p.BatchedP2PLookupRetMsg:
        t0 = time.perf_counter()
        layout: list[tuple[str, str, int, str]] = []
        for instance_id, location, hits, worker_id in self.index.p2p_lookup(
            msg.hashes, msg.instance_id, msg.worker_id
        ):
            record = self.registry.get(instance_id, worker_id)
            if record is not None and record.peer_init_url:
                layout.append((instance_id, location, hits, record.peer_init_url))
        self._observe_p2p(time.perf_counter() - t0)
        return p.BatchedP2PLookupRetMsg(layout or [("", "", 0, "")])

    # ------------------------------------------------------------------ orchestration

    def token_hashes(self, tokens: list[int], chunk_size: int | None = None) -> list[int]:
        """The chunk hashes of ``tokens`` in the domain's regime (chunk size, algorithm, vLLM's
        seeded NONE_HASH), the trailing partial chunk included as in LMCache's ``/lookup``.
        Callers check ``settings.tokens_lookup_error`` first."""
        return chunk_hashes(tokens, self.settings.hash_config(chunk_size))

    def lookup_tokens(self, tokens: list[int]) -> dict[str, tuple[str, int]]:
        """LMCache's ``/lookup``: per instance, (the tier holding most of its prefix, fastest on
        a tie; end token)."""
        t0 = time.perf_counter()
        hashes = self.token_hashes(tokens)
        layout: dict[str, tuple[str, int]] = {}
        for instance_id, hit in self.index.prefix_hits(hashes).items():
            if hit.hit_chunks <= 0:
                continue
            # The tier holding most of the prefix; on a tie the fastest (not alphabetical).
            location = min(
                hit.per_location, key=lambda loc: (-hit.per_location[loc], tier_rank(loc), loc)
            )
            layout[instance_id] = (
                location,
                min(hit.hit_chunks * self.settings.chunk_size, len(tokens)),
            )
        self._observe_lookup(time.perf_counter() - t0)
        return layout

    def prefix_lookup(self, hashes: list[int]) -> dict[str, dict[str, Any]]:
        """The gateway's query: per instance hit chunks, per-tier counts and worker addresses."""
        t0 = time.perf_counter()
        out: dict[str, dict[str, Any]] = {}
        for instance_id, hit in self.index.prefix_hits(hashes).items():
            workers = []
            for record in self.registry.workers_of(instance_id):
                workers.append(
                    {
                        "worker_id": record.worker_id,
                        "url": record.url,
                        "peer_init_url": record.peer_init_url,
                        "holds_first_chunk": record.worker_id in hit.workers,
                    }
                )
            out[instance_id] = prefix_lookup_entry(hit.hit_chunks, hit.per_location, workers)
        self._observe_prefix(time.perf_counter() - t0)
        return out

    def query_worker_info(
        self, instance_id: str, worker_ids: list[int] | None
    ) -> list[p.WorkerInfo]:
        if instance_id == "all":
            records = self.registry.records()
        else:
            records = self.registry.workers_of(instance_id)
        if worker_ids:
            records = [r for r in records if r.worker_id in worker_ids]
        return [
            p.WorkerInfo(
                r.instance_id,
                r.worker_id,
                r.ip,
                r.port,
                r.peer_init_url,
                r.registration_time,
                r.last_heartbeat_time,
            )
            for r in sorted(records, key=lambda r: (r.instance_id, r.worker_id))
        ]

    def record_event(self, event_id: str, status: str) -> None:
        if len(self._events) > 10_000:
            self._events.pop(next(iter(self._events)))
        self._events[event_id] = status

    def event_status(self, event_id: str) -> str:
        return self._events.get(event_id, "not_found")


__all__ = ["ControlError", "ControllerService"]
