"""The controller's first asyncio client: a live replica of its chunk index, with the
controller's HTTP ``/v1/prefix_lookup`` as fallback.

Why this module exists: asking the controller over the network for every routing decision
adds a round trip per request and makes the controller a single point of failure. The
controller publishes every index change as numbered deltas on a ZMQ PUB socket and answers
snapshot requests on a ROUTER socket (controller/src/kvpool/controller/server.py); this
client subscribes, feeds the pure :class:`IndexReplica` (kvpool.protocol), and when the
replica reports a gap or a new controller epoch (a restart) fetches a snapshot and replays
what it buffered. The controller's ``GET /`` is polled every few seconds: it tells whether
the controller is alive and its epoch (a restart with no index change yet publishes
nothing). While the replica is out of sync, lookups go to ``/v1/prefix_lookup``; when that
fails too, :meth:`IndexClient.prefix_hits` returns ``None`` and the router falls back to
session/least-load.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import zmq
import zmq.asyncio

from kvpool.gateway.hitgroups import GroupedHits, name_of
from kvpool.gateway.metrics import GatewayMetrics
from kvpool.gateway.routing import PrefixHit
from kvpool.protocol import deltas as dl
from kvpool.protocol.http_api import (
    PREFIX_LOOKUP_PATH,
    prefix_lookup_hits,
    prefix_lookup_request,
)
from kvpool.protocol.snapshot_fetch import fetch_snapshot

logger = logging.getLogger(__name__)

SNAPSHOT_TIMEOUT_S = 5.0
LOOKUP_TIMEOUT_S = 0.5
#: A delta stream quiet this long is re-checked with a snapshot (bounded staleness).
QUIET_RESYNC_S = 30.0


class IndexClient:
    """Keeps :attr:`replica` current; answers prefix lookups from it or over HTTP."""

    def __init__(
        self,
        controller_url: str,
        pub_url: str | None,
        snapshot_url: str | None,
        http: httpx.AsyncClient,
        metrics: GatewayMetrics,
        poll_interval_s: float = 2.0,
        lookup_timeout_s: float = LOOKUP_TIMEOUT_S,
    ) -> None:
        self.controller_url = controller_url.rstrip("/")
        self.pub_url = pub_url
        self.snapshot_url = snapshot_url
        self.http = http
        self.metrics = metrics
        self.poll_interval_s = poll_interval_s
        self.lookup_timeout_s = lookup_timeout_s
        self.replica = dl.IndexReplica()
        #: told every delta batch received, before it is applied (``explain``: evictions)
        self.on_batch: Callable[[dl.DeltaBatch], None] | None = None
        self.controller_up = False
        self.controller_epoch: str | None = None
        self.last_error: str | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._resync = asyncio.Event()
        self._last_activity = time.monotonic()  # last delta received or snapshot loaded

    # ------------------------------------------------------------------ state

    @property
    def streaming(self) -> bool:
        """Whether deltas are subscribed to at all (the config names the PUB address)."""
        return self.pub_url is not None and self.snapshot_url is not None

    @property
    def in_sync(self) -> bool:
        r = self.replica
        return (
            self.streaming
            and self.controller_up
            and not r.needs_snapshot
            and (self.controller_epoch is None or r.epoch == self.controller_epoch)
        )

    @property
    def usable(self) -> bool:
        """Whether lookups can be answered (from the replica or the controller)."""
        return self.in_sync or self.controller_up

    def _quiet_for(self) -> float:
        return time.monotonic() - self._last_activity

    def describe(self) -> dict[str, Any]:
        r = self.replica
        return {
            "controller_up": self.controller_up,
            "mode": "replica" if self.in_sync else ("http" if self.controller_up else "down"),
            "epoch": r.epoch,
            "seq": r.seq,
            "gaps": r.gaps,
            "last_error": self.last_error,
        }

    # ------------------------------------------------------------------ lookups

    async def prefix_hits(self, hashes: Sequence[int]) -> dict[str, PrefixHit] | None:
        """Per configured instance name, what it holds of ``hashes``; None if unknown."""
        found = await self.lookup(hashes)
        return found.by_name() if isinstance(found, GroupedHits) else found

    async def lookup(self, hashes: Sequence[int]) -> GroupedHits | dict[str, PrefixHit] | None:
        """What the instances hold of ``hashes``: grouped from the replica, per name from the
        controller's HTTP lookup, None if unknown."""
        if not hashes:
            return {} if self.usable else None
        if self.in_sync:
            version, ids = self.replica.index.instance_names()
            return GroupedHits(self.replica.prefix_groups(hashes), ids, version)
        if not self.controller_up:
            return None
        try:
            resp = await self.http.post(
                f"{self.controller_url}{PREFIX_LOOKUP_PATH}",
                json=prefix_lookup_request(hashes),
                timeout=self.lookup_timeout_s,
            )
            resp.raise_for_status()
            hits = list(prefix_lookup_hits(resp.json()))
        except (httpx.HTTPError, ValueError, TypeError, AttributeError) as exc:
            self._down(f"prefix_lookup: {type(exc).__name__}: {exc}")
            return None
        return _by_name(hits)

    # ------------------------------------------------------------------ loops

    async def run(self) -> None:
        """Poll the controller, and subscribe to its deltas when configured; forever."""
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._poll_loop())
            if self.streaming:
                self._ctx = zmq.asyncio.Context()
                tg.create_task(self._subscribe_loop())
                tg.create_task(self._snapshot_loop())

    def _down(self, why: str) -> None:
        if self.controller_up:
            logger.warning("controller %s unreachable: %s", self.controller_url, why)
        self.controller_up = False
        self.last_error = why
        self.metrics.index_in_sync.set(0)

    async def _poll_loop(self) -> None:
        while True:
            try:
                resp = await self.http.get(
                    f"{self.controller_url}/", timeout=self.lookup_timeout_s * 4
                )
                resp.raise_for_status()
                epoch = resp.json().get("epoch")
            except (httpx.HTTPError, ValueError) as exc:
                self._down(f"{type(exc).__name__}: {exc}")
            else:
                if not self.controller_up:
                    logger.info("controller %s is up (epoch %s)", self.controller_url, epoch)
                self.controller_up = True
                self.last_error = None
                if isinstance(epoch, str) and epoch != self.controller_epoch:
                    self.controller_epoch = epoch
                if self.streaming and self.replica.epoch != self.controller_epoch:
                    self._resync.set()
                elif self.streaming and self._quiet_for() > QUIET_RESYNC_S:
                    # PUB has no heartbeat: a delta lost at the end of a burst stays invisible
                    # until the next one; a quiet stream is re-checked against a snapshot.
                    self._last_activity = time.monotonic()
                    self._resync.set()
            self.metrics.index_in_sync.set(1 if self.in_sync else 0)
            await asyncio.sleep(self.poll_interval_s)

    async def _subscribe_loop(self) -> None:
        assert self._ctx is not None and self.pub_url is not None
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.SUBSCRIBE, dl.TOPIC)
        sock.connect(self.pub_url)
        logger.info("subscribed to index deltas at %s", self.pub_url)
        try:
            while True:
                frames = await sock.recv_multipart()
                if len(frames) != 2 or frames[0] != dl.TOPIC:
                    continue
                try:
                    batch = dl.decode_batch(frames[1])
                except Exception as exc:  # a malformed frame must not stop the stream
                    logger.warning("undecodable delta batch dropped: %s", exc)
                    continue
                self._last_activity = time.monotonic()
                if self.on_batch is not None:
                    self.on_batch(batch)
                if self.replica.apply_batch(batch):
                    self.metrics.index_deltas.inc(len(batch.deltas))
                else:
                    self._resync.set()
        finally:
            sock.close(linger=0)

    async def _snapshot_loop(self) -> None:
        self._resync.set()  # the replica answers nothing before its first snapshot
        while True:
            await self._resync.wait()
            self._resync.clear()
            reason = "start" if self.replica.epoch is None else "gap_or_epoch"
            try:
                snapshot = await self.fetch_snapshot()
            except (TimeoutError, zmq.ZMQError, ValueError) as exc:
                self.last_error = f"snapshot: {type(exc).__name__}: {exc}"
                logger.warning("index snapshot from %s failed: %s", self.snapshot_url, exc)
                await asyncio.sleep(self.poll_interval_s)
                self._resync.set()
                continue
            t0 = time.perf_counter()
            ok = self.replica.load_snapshot(snapshot)
            self._last_activity = time.monotonic()
            self.metrics.index_resyncs.labels(reason).inc()
            logger.info(
                "index snapshot loaded: epoch %s seq %d, %d workers (%.3fs)%s",
                snapshot.epoch,
                snapshot.seq,
                len(snapshot.workers),
                time.perf_counter() - t0,
                "" if ok else "; still behind, fetching again",
            )
            if not ok:
                self._resync.set()
            self.metrics.index_in_sync.set(1 if self.in_sync else 0)

    async def fetch_snapshot(self) -> Any:
        """One snapshot over a fresh DEALER socket (a lost reply never wedges the next)."""
        assert self._ctx is not None and self.snapshot_url is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        return await fetch_snapshot(sock, self.snapshot_url, SNAPSHOT_TIMEOUT_S)

    def close(self) -> None:
        if self._ctx is not None:
            with contextlib.suppress(Exception):
                self._ctx.destroy(linger=0)
            self._ctx = None


def _by_name(rows: Any) -> dict[str, PrefixHit]:
    """Controller instance ids (``name~fingerprint``) → configured instance names."""
    out: dict[str, PrefixHit] = {}
    for instance_id, chunks, per_location in rows:
        name = name_of(instance_id)
        prev = out.get(name)
        if prev is None or chunks > prev.hit_chunks:
            out[name] = PrefixHit(chunks, dict(per_location))
    return out
