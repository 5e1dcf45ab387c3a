"""A standby controller's warm copy of the leader's index, and the takeover that adopts it.

Why: a controller that starts empty after the leader dies makes every worker full-sync (and
LMCache drops every store while it does). The standby instead follows the leader exactly as a
gateway does — the delta stream (PUB) and snapshots (the snapshot ROUTER), through the
controller Service, which reaches the leader only — into the shared pure
:class:`~kvpool.protocol.deltas.IndexReplica`. When it wins the Lease, :func:`adopt` turns the
replica into the service's own index and registry: the workers are known (their next
heartbeat is answered as usual, no re-registration, no full sync), and the new leader
continues the same epoch and delta numbering in a new term, so gateways' replicas continue too.

What the copy lacks: per-worker LMCache sequence numbers (the first batch of each worker after
a takeover is accepted as it comes), full-sync sessions in progress, orchestration event ids
and refused ids; deltas the old leader had not yet published when it died; the allowlist the
operator pushed to the leader (the new leader reads its mounted ConfigMap).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import zmq
import zmq.asyncio

from kvpool.controller.registry import WorkerRecord
from kvpool.controller.service import ControllerService
from kvpool.protocol import deltas as dl
from kvpool.protocol.snapshot_fetch import fetch_snapshot

logger = logging.getLogger(__name__)

SNAPSHOT_TIMEOUT_S = 10.0
#: A stream quiet this long is checked against a snapshot (a delta lost at the end of a burst
#: stays invisible until the next one; the gateway's index client does the same).
QUIET_RESYNC_S = 30.0


class Follower:
    """Keeps :attr:`replica` current from the leader's PUB and snapshot sockets."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        pub_url: str,
        snapshot_url: str,
        retry_s: float = 1.0,
        quiet_resync_s: float = QUIET_RESYNC_S,
    ) -> None:
        self.ctx = ctx
        self.pub_url = pub_url
        self.snapshot_url = snapshot_url
        self.retry_s = retry_s
        self.quiet_resync_s = quiet_resync_s
        self.replica = dl.IndexReplica()
        self.snapshots = 0
        self.deltas = 0
        self.last_error: str | None = None
        self._resync = asyncio.Event()
        self._last_activity = time.monotonic()
        self._sub: zmq.asyncio.Socket | None = None

    @property
    def warm(self) -> bool:
        """Holds a copy of the leader's index that is current as far as it can tell."""
        return self.replica.epoch is not None and not self.replica.needs_snapshot

    def describe(self) -> dict[str, Any]:
        r = self.replica
        return {
            "warm": self.warm,
            "epoch": r.epoch,
            "term": r.term,
            "seq": r.seq,
            "workers": len(r.workers),
            "chunk_locations": len(r.index),
            "snapshots": self.snapshots,
            "gaps": r.gaps,
            "last_error": self.last_error,
        }

    async def run(self) -> None:
        """Subscribe and keep the replica in sync until cancelled (sockets stay open for
        :meth:`drain`; :meth:`close` closes them)."""
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.SUBSCRIBE, dl.TOPIC)
        sock.connect(self.pub_url)
        self._sub = sock
        logger.info("standby: following the leader's deltas at %s", self.pub_url)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._subscribe_loop(sock))
            tg.create_task(self._snapshot_loop())

    def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 2 or frames[0] != dl.TOPIC:
            return
        try:
            batch = dl.decode_batch(frames[1])
        except Exception as exc:  # a malformed frame must not stop the stream
            logger.warning("standby: undecodable delta batch dropped: %s", exc)
            return
        self._last_activity = time.monotonic()
        if self.replica.apply_batch(batch):
            self.deltas += len(batch.deltas)
        else:
            self._resync.set()

    async def _subscribe_loop(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            self._on_frames(await sock.recv_multipart())

    async def _snapshot_loop(self) -> None:
        self._resync.set()
        while True:
            try:
                await asyncio.wait_for(self._resync.wait(), self.quiet_resync_s)
            except TimeoutError:
                if time.monotonic() - self._last_activity < self.quiet_resync_s:
                    continue
            self._resync.clear()
            try:
                snapshot = await self.fetch_snapshot()
            except (TimeoutError, zmq.ZMQError, ValueError) as exc:
                self.last_error = f"snapshot: {type(exc).__name__}: {exc}"
                await asyncio.sleep(self.retry_s)
                self._resync.set()
                continue
            self._last_activity = time.monotonic()
            ok = self.replica.load_snapshot(snapshot)
            self.snapshots += 1
            self.last_error = None
            logger.info(
                "standby: snapshot of epoch %s term %d seq %d loaded (%d workers)%s",
                snapshot.epoch,
                snapshot.term,
                snapshot.seq,
                len(snapshot.workers),
                "" if ok else "; still behind, fetching again",
            )
            if not ok:
                self._resync.set()

    async def fetch_snapshot(self) -> dl.Snapshot:
        """One snapshot over a fresh DEALER (a lost reply never wedges the next request)."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        return await fetch_snapshot(sock, self.snapshot_url, SNAPSHOT_TIMEOUT_S)

    def drain(self) -> int:
        """Apply every batch already received (the old leader's last words); returns how many."""
        sock = self._sub
        if sock is None:
            return 0
        shadow: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        n = 0
        while True:
            try:
                frames = shadow.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return n
            self._on_frames(frames)
            n += 1

    def close(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sub.close(linger=0)
            self._sub = None


def adopt(service: ControllerService, replica: dl.IndexReplica, now: float) -> int:
    """Make the replica the service's index and registry, continuing its epoch and numbering
    in the next term (every worker's heartbeat clock restarts now). Returns the new term; a
    replica that never loaded a snapshot is not adopted (the service keeps its own fresh epoch,
    term 0: a cold start)."""
    if replica.epoch is None:
        return service.term
    service.index = replica.index
    for w in replica.workers.values():
        host, _, port = w.url.rpartition(":")
        record = WorkerRecord(
            w.instance_id, w.worker_id, host, int(port or 0), w.peer_init_url, now, now
        )
        service.registry.restore(record)
        if service.control is not None:
            service.control.set_worker(w.instance_id, w.worker_id, w.url)
    service.continue_stream(replica.epoch, replica.seq, replica.term + 1)
    return service.term
