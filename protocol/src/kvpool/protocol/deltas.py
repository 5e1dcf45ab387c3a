"""The index change stream: what the controller publishes and how a replica follows it.

Why: the gateway routes every request by KV affinity; asking the controller over the network
for each decision adds a round trip. Instead the controller publishes every index change on a
ZMQ PUB socket as numbered deltas, and a gateway keeps a local replica. A replica that sees a
gap in the numbers (a slow subscriber drops messages; PUB never blocks the controller) or a new
controller epoch (a restart) asks the snapshot socket for the whole index and replays the deltas
it buffered meanwhile. The same deltas feed the controller's Redis write-behind. Publisher and
subscribers live in different components, so the wire types and the replica are defined here,
once, next to the index they both keep (:mod:`kvpool.protocol.index`).

Wire (msgpack of the array-like structs below):

- PUB (controller ``--pub-port``): multipart ``[TOPIC, encode(DeltaBatch)]``; subscribe to
  :data:`TOPIC`.
- Snapshot (controller ``--snapshot-port``, a ROUTER): a DEALER sends ``[b"",
  SNAPSHOT_REQUEST]`` and receives ``[b"", encode(Snapshot)]``; the snapshot includes every
  delta numbered before it was taken.

A loss is seen when the next delta arrives (its number is not the one expected); a loss at the
very end of a burst stays invisible until the controller publishes again, so a subscriber that
must bound its staleness re-fetches a snapshot when the stream has been quiet for a while.

Leadership terms. With two controller replicas the standby follows this same stream; when it
takes over it continues the same ``epoch`` and numbering, in a new ``term`` that starts at
``term_start`` (one past the last delta it had). A replica at exactly ``term_start - 1`` holds
what the new leader holds and simply continues; one that saw more of the old leader's stream
than the standby did (or less) cannot tell which of its deltas the new leader lacks, so it
fetches a snapshot, once. Batches of an older term (a deposed leader's last words) are ignored.

Everything here is pure: :class:`IndexReplica` never touches a socket.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import msgspec

from kvpool.protocol.index import ChunkIndex, HitGroup, InstanceHit

TOPIC = b"kvpool.delta"
SNAPSHOT_REQUEST = b"snapshot"


class DeltaOp(enum.Enum):
    ADMIT = "admit"  # keys added at (instance, worker, location)
    EVICT = "evict"  # keys removed
    REPLACE = "replace"  # the worker's location now holds exactly ``keys`` (full sync)
    CLEAR = "clear"  # drop every key of the worker at ``location`` ("" = every location)
    WORKER_UP = "worker_up"  # a worker registered; ``url``/``peer_init_url`` say where it is
    WORKER_DOWN = "worker_down"  # deregistered or purged: its keys are gone too


class Delta(msgspec.Struct, frozen=True, array_like=True):
    seq: int
    op: DeltaOp
    instance_id: str
    worker_id: int
    location: str = ""
    keys: list[int] = msgspec.field(default_factory=list)
    url: str | None = None
    peer_init_url: str | None = None


class DeltaBatch(msgspec.Struct, frozen=True, array_like=True):
    """One PUB message: consecutive deltas of one controller run (``epoch``), published by the
    leader of ``term``, whose first delta was number ``term_start`` (term 0 is not encoded:
    :func:`encode`)."""

    epoch: str
    deltas: list[Delta]
    term: int = 0
    term_start: int = 0


class WorkerEntry(msgspec.Struct, frozen=True, array_like=True):
    instance_id: str
    worker_id: int
    url: str
    peer_init_url: str | None


class LocationEntry(msgspec.Struct, frozen=True, array_like=True):
    instance_id: str
    worker_id: int
    location: str
    keys: list[int]


class Snapshot(msgspec.Struct, frozen=True, array_like=True):
    """The whole index as of delta ``seq`` of run ``epoch``, from the leader of ``term``."""

    epoch: str
    seq: int
    workers: list[WorkerEntry]
    entries: list[LocationEntry]
    term: int = 0


def apply_delta(index: ChunkIndex, delta: Delta) -> None:
    """Apply one delta to an index (used by the replica and by tests of the controller)."""
    match delta.op:
        case DeltaOp.ADMIT:
            index.admit(delta.instance_id, delta.worker_id, delta.location, delta.keys)
        case DeltaOp.EVICT:
            index.evict(delta.instance_id, delta.worker_id, delta.location, delta.keys)
        case DeltaOp.REPLACE:
            index.replace(delta.instance_id, delta.worker_id, delta.location, delta.keys)
        case DeltaOp.CLEAR:
            index.clear(delta.instance_id, delta.worker_id, delta.location or None)
        case DeltaOp.WORKER_DOWN:
            index.remove_worker(delta.instance_id, delta.worker_id)
        case DeltaOp.WORKER_UP:
            pass


class IndexReplica:
    """A local copy of the controller's index kept current from the delta stream.

    Feed it every :class:`DeltaBatch` with :meth:`apply_batch`; when :attr:`needs_snapshot` is
    true, fetch a :class:`Snapshot` and give it to :meth:`load_snapshot`. Until the first
    snapshot it answers nothing (it cannot know what it missed).
    """

    def __init__(self, max_buffered: int = 100_000) -> None:
        self.index = ChunkIndex()
        self.workers: dict[tuple[str, int], WorkerEntry] = {}
        self.epoch: str | None = None
        self.term = 0
        self.seq = -1
        self.needs_snapshot = True
        self.gaps = 0
        self.stale_batches = 0  # batches of an older term, ignored
        self._buffer: list[Delta] = []
        self._buffer_key: tuple[str, int] | None = None  # (epoch, term) of the buffered deltas
        self._max_buffered = max_buffered

    def apply_batch(self, batch: DeltaBatch) -> bool:
        """Apply a batch; returns False when a snapshot is needed before it can catch up."""
        if self.needs_snapshot or batch.epoch != self.epoch:
            if not self.needs_snapshot:
                self.gaps += 1  # the controller restarted: a new epoch starts at seq 0
                self.needs_snapshot = True
            self._buffer_deltas(batch.epoch, batch.term, batch.deltas)
            return False
        if batch.term != self.term:
            if batch.term < self.term:
                self.stale_batches += 1  # a deposed leader's: the newer term's stream wins
                return True
            if batch.term_start != self.seq + 1:
                # The new leader took over at another delta than the one this replica is at.
                self.gaps += 1
                self.needs_snapshot = True
                self._buffer_deltas(batch.epoch, batch.term, batch.deltas)
                return False
            self.term = batch.term
        for position, delta in enumerate(batch.deltas):
            if delta.seq <= self.seq:
                continue  # already contained in the snapshot, or a duplicate
            if delta.seq != self.seq + 1:
                self.gaps += 1
                self.needs_snapshot = True
                self._buffer_deltas(batch.epoch, batch.term, batch.deltas[position:])
                return False
            self._apply(delta)
        return True

    def _buffer_deltas(self, epoch: str, term: int, deltas: Sequence[Delta]) -> None:
        if (epoch, term) != self._buffer_key:
            self._buffer = []
            self._buffer_key = (epoch, term)
        self._buffer.extend(deltas)
        if len(self._buffer) > self._max_buffered:
            # Too far behind to replay all: keep the newest; a later snapshot covers the rest.
            self._buffer = self._buffer[-self._max_buffered :]

    def load_snapshot(self, snapshot: Snapshot) -> bool:
        """Replace the replica's state; returns True when it is then in sync."""
        index = ChunkIndex()
        for entry in snapshot.entries:
            index.replace(entry.instance_id, entry.worker_id, entry.location, entry.keys)
        self.index = index
        self.workers = {(w.instance_id, w.worker_id): w for w in snapshot.workers}
        self.epoch = snapshot.epoch
        self.term = snapshot.term
        self.seq = snapshot.seq
        self.needs_snapshot = False
        key = (snapshot.epoch, snapshot.term)
        buffered = self._buffer if self._buffer_key == key else []
        self._buffer = []
        ordered = sorted(buffered, key=lambda d: d.seq)
        for position, delta in enumerate(ordered):
            if delta.seq <= self.seq:
                continue
            if delta.seq != self.seq + 1:
                # still a hole: keep what follows it for the next snapshot to be replayed onto
                self.needs_snapshot = True
                self.gaps += 1
                self._buffer_deltas(snapshot.epoch, snapshot.term, ordered[position:])
                return False
            self._apply(delta)
        return True

    def _apply(self, delta: Delta) -> None:
        apply_delta(self.index, delta)
        key = (delta.instance_id, delta.worker_id)
        if delta.op is DeltaOp.WORKER_UP:
            self.workers[key] = WorkerEntry(
                delta.instance_id, delta.worker_id, delta.url or "", delta.peer_init_url
            )
        elif delta.op is DeltaOp.WORKER_DOWN:
            self.workers.pop(key, None)
        self.seq = delta.seq

    def prefix_hits(self, hashes: Sequence[int]) -> dict[str, InstanceHit]:
        """Longest cached prefix per instance, as the controller would answer it."""
        if self.needs_snapshot and self.epoch is None:
            return {}
        return self.index.prefix_hits(hashes)

    def prefix_groups(self, hashes: Sequence[int]) -> list[HitGroup]:
        """:meth:`prefix_hits` grouped (:meth:`ChunkIndex.prefix_groups`)."""
        if self.needs_snapshot and self.epoch is None:
            return []
        return self.index.prefix_groups(hashes)


_BATCH_DECODER = msgspec.msgpack.Decoder(DeltaBatch)
_SNAPSHOT_DECODER = msgspec.msgpack.Decoder(Snapshot)
_ENCODER = msgspec.msgpack.Encoder()


class _TermlessBatch(msgspec.Struct, frozen=True, array_like=True):
    epoch: str
    deltas: list[Delta]


class _TermlessSnapshot(msgspec.Struct, frozen=True, array_like=True):
    epoch: str
    seq: int
    workers: list[WorkerEntry]
    entries: list[LocationEntry]


def encode(obj: DeltaBatch | Snapshot) -> bytes:
    """The msgpack frame of a batch (PUB) or a snapshot (snapshot reply). Term 0 is left out
    (msgspec encodes every field of an array-like struct), so a single controller's frames are
    byte for byte what they were before terms, and decode to term 0."""
    if isinstance(obj, DeltaBatch) and obj.term == 0 and obj.term_start == 0:
        return _ENCODER.encode(_TermlessBatch(obj.epoch, obj.deltas))
    if isinstance(obj, Snapshot) and obj.term == 0:
        return _ENCODER.encode(_TermlessSnapshot(obj.epoch, obj.seq, obj.workers, obj.entries))
    return _ENCODER.encode(obj)


def decode_batch(frame: bytes) -> DeltaBatch:
    """A PUB frame back into a batch; raises ``msgspec.DecodeError`` (or its
    ``ValidationError``) on a frame that is not one."""
    return _BATCH_DECODER.decode(frame)


def decode_snapshot(frame: bytes) -> Snapshot:
    """A snapshot reply back into a snapshot; raises like :func:`decode_batch`."""
    return _SNAPSHOT_DECODER.decode(frame)
