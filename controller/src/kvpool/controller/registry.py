"""Who is registered: workers, their addresses, heartbeats, sequence numbers and full-sync state.

Why a pure module: the decisions the controller takes about workers (accept or refuse a
registration, which workers missed the heartbeat TTL, whether a batch of events is stale or has
a gap, when a full sync is complete) are the ones that go wrong silently. Keeping them free of
sockets and clocks (``now`` is always passed in) lets unit tests pin every branch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvpool.protocol.domain import split_instance_id

WorkerKey = tuple[str, int]


# ---------------------------------------------------------------- cache-domain fingerprint


@dataclass(frozen=True)
class FingerprintVerdict:
    """Outcome of checking one instance id against the controller's expected fingerprint."""

    accepted: bool
    fingerprint: str | None
    reason: str = ""


def check_fingerprint(
    instance_id: str, expected: str | None, *, require: bool = False
) -> FingerprintVerdict:
    """Accept or refuse an instance id by the fingerprint suffix the operator rendered into it.

    The controller only compares strings: the operator computes the fingerprint (first 12 hex of
    sha256 over the domain's canonical settings) and renders ``<name>~<fingerprint>``.
    """
    _, got = split_instance_id(instance_id)
    if got is None:
        if require:
            return FingerprintVerdict(
                False,
                None,
                f"instance id {instance_id!r} carries no '~<fingerprint>' suffix and the "
                f"controller requires one (expected fingerprint {expected!r}); render "
                "lmcache_instance_id as '<name>~<fingerprint>'",
            )
        return FingerprintVerdict(True, None)
    if expected is not None and got != expected:
        return FingerprintVerdict(
            False,
            got,
            f"cache-domain fingerprint mismatch for instance {instance_id!r}: expected "
            f"{expected!r}, got {got!r} (hash seed, chunk size, model, KV dtype, block size or "
            "hash algorithm differ from this controller's domain)",
        )
    return FingerprintVerdict(True, got)


# ---------------------------------------------------------------- workers


class SyncState(enum.Enum):
    SYNCING = "syncing"
    COMPLETED = "completed"
    FAILED = "failed"


@dataclass
class FullSync:
    """One full-sync session of one worker and location; keys are staged until the end."""

    sync_id: str
    location: str
    expected_keys: int
    expected_batches: int
    started_at: float
    state: SyncState = SyncState.SYNCING
    received_batches: set[int] = field(default_factory=set)
    keys: list[int] = field(default_factory=list)
    last_activity: float = 0.0

    def missing_batches(self) -> list[int]:
        if self.state is not SyncState.SYNCING:
            return []
        return sorted(set(range(self.expected_batches)) - self.received_batches)


@dataclass
class WorkerRecord:
    instance_id: str
    worker_id: int
    ip: str
    port: int
    peer_init_url: str | None
    registration_time: float
    last_heartbeat_time: float
    seq: dict[str, int] = field(default_factory=dict)
    sync: FullSync | None = None
    needs_full_sync: bool = False

    @property
    def key(self) -> WorkerKey:
        return (self.instance_id, self.worker_id)

    @property
    def url(self) -> str:
        return f"{self.ip}:{self.port}"


class SeqVerdict(enum.Enum):
    OK = "ok"
    GAP = "gap"  # applied, but events were lost in between
    STALE = "stale"  # at or before the last applied number: a duplicate or a replay


class Registry:
    """Registered workers by (instance id, worker id / TP rank)."""

    def __init__(self) -> None:
        self._workers: dict[WorkerKey, WorkerRecord] = {}
        self._by_instance: dict[str, dict[int, WorkerRecord]] = {}

    # --- membership -------------------------------------------------------------------------

    def register(
        self,
        instance_id: str,
        worker_id: int,
        ip: str,
        port: int,
        peer_init_url: str | None,
        now: float,
    ) -> tuple[WorkerRecord, bool]:
        """Add or refresh a worker; returns ``(record, was_known)``.

        A known worker that registers again has restarted: its sequence numbers and any
        full-sync session start over (the caller drops its index entries).
        """
        key = (instance_id, worker_id)
        old = self._workers.get(key)
        record = WorkerRecord(instance_id, worker_id, ip, port, peer_init_url, now, now)
        self._workers[key] = record
        self._by_instance.setdefault(instance_id, {})[worker_id] = record
        return record, old is not None

    def restore(self, record: WorkerRecord) -> None:
        """Put back a worker loaded from persistence (heartbeat clock restarts at load time)."""
        self._workers[record.key] = record
        self._by_instance.setdefault(record.instance_id, {})[record.worker_id] = record

    def deregister(self, instance_id: str, worker_id: int) -> WorkerRecord | None:
        record = self._workers.pop((instance_id, worker_id), None)
        if record is None:
            return None
        workers = self._by_instance.get(instance_id)
        if workers is not None:
            workers.pop(worker_id, None)
            if not workers:
                del self._by_instance[instance_id]
        return record

    def get(self, instance_id: str, worker_id: int) -> WorkerRecord | None:
        return self._workers.get((instance_id, worker_id))

    def heartbeat(self, instance_id: str, worker_id: int, now: float) -> WorkerRecord | None:
        record = self._workers.get((instance_id, worker_id))
        if record is not None:
            record.last_heartbeat_time = max(record.last_heartbeat_time, now)
        return record

    def expired(self, now: float, timeout_s: float) -> list[WorkerRecord]:
        """Workers whose last heartbeat (or registration) is older than ``timeout_s``."""
        return [r for r in self._workers.values() if now - r.last_heartbeat_time > timeout_s]

    def __len__(self) -> int:
        return len(self._workers)

    def records(self) -> list[WorkerRecord]:
        return list(self._workers.values())

    def instances(self) -> list[str]:
        return sorted(self._by_instance)

    def worker_ids(self, instance_id: str) -> list[int]:
        return sorted(self._by_instance.get(instance_id, {}))

    def workers_of(self, instance_id: str) -> list[WorkerRecord]:
        workers = self._by_instance.get(instance_id, {})
        return [workers[w] for w in sorted(workers)]

    def instance_by_ip(self, ip: str) -> str | None:
        for instance_id in sorted(self._by_instance):
            if any(r.ip == ip for r in self._by_instance[instance_id].values()):
                return instance_id
        return None

    # --- sequence numbers -------------------------------------------------------------------

    def check_seq(self, record: WorkerRecord, location: str, seq_num: int) -> SeqVerdict:
        """Classify one event's sequence number and advance the tracker when it is applied."""
        last = record.seq.get(location)
        if last is not None and seq_num <= last:
            return SeqVerdict.STALE
        record.seq[location] = seq_num
        if last is not None and seq_num != last + 1:
            return SeqVerdict.GAP
        return SeqVerdict.OK

    # --- full sync ----------------------------------------------------------------------------

    def start_sync(
        self,
        record: WorkerRecord,
        location: str,
        sync_id: str,
        total_keys: int,
        batch_count: int,
        now: float,
    ) -> str | None:
        """Open a full-sync session; returns an error text when it cannot be accepted."""
        current = record.sync
        if current is not None and current.state is SyncState.SYNCING:
            if current.sync_id != sync_id:
                return f"worker {record.key} is already syncing with sync_id {current.sync_id!r}"
            return None  # a retried start of the same session
        if total_keys < 0 or batch_count < 0:
            return f"invalid full sync sizes: total_keys={total_keys}, batch_count={batch_count}"
        record.sync = FullSync(sync_id, location, total_keys, batch_count, now, last_activity=now)
        record.seq.pop(location, None)
        return None

    @staticmethod
    def sync_batch(
        record: WorkerRecord, sync_id: str, batch_id: int, keys: list[int], now: float
    ) -> bool:
        sync = record.sync
        if sync is None or sync.sync_id != sync_id or sync.state is not SyncState.SYNCING:
            return False
        if batch_id in sync.received_batches:
            return True  # a resent batch: keys are already staged
        sync.received_batches.add(batch_id)
        sync.keys.extend(keys)
        sync.last_activity = now
        return True

    @staticmethod
    def end_sync(record: WorkerRecord, sync_id: str, now: float) -> FullSync | None:
        """Close the session; returns it (with its staged keys) when it was open."""
        sync = record.sync
        if sync is None or sync.sync_id != sync_id or sync.state is not SyncState.SYNCING:
            return None
        sync.state = SyncState.COMPLETED
        sync.last_activity = now
        record.needs_full_sync = False
        return sync

    def expire_syncs(self, now: float, timeout_s: float) -> list[WorkerRecord]:
        """Mark sessions idle for longer than ``timeout_s`` as failed (to be asked again)."""
        failed = []
        for record in self._workers.values():
            sync = record.sync
            if (
                sync is not None
                and sync.state is SyncState.SYNCING
                and now - sync.last_activity > timeout_s
            ):
                sync.state = SyncState.FAILED
                sync.keys = []
                record.needs_full_sync = True
                failed.append(record)
        return failed

    def sync_progress(self) -> float:
        """Fraction of workers ready to serve: not syncing, not failed, not awaiting a sync."""
        if not self._workers:
            return 1.0
        ready = sum(1 for r in self._workers.values() if self.is_ready(r))
        return ready / len(self._workers)

    @staticmethod
    def is_ready(record: WorkerRecord) -> bool:
        if record.needs_full_sync:
            return False
        return record.sync is None or record.sync.state is SyncState.COMPLETED

    @staticmethod
    def is_syncing(record: WorkerRecord) -> bool:
        return record.sync is not None and record.sync.state is SyncState.SYNCING
