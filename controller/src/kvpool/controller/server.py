"""The controller's sockets and background loops, all on one asyncio event loop.

Why this shape: LMCache's controller awaits one frame at a time and runs its health check in a
second thread with its own loop. Here each socket is awaited for readability once, then drained
synchronously (non-blocking ``recv`` on a shadow of the same socket) for up to ``drain_batch``
frames or ``drain_budget_ms`` per turn before yielding, so a burst of admit/evict batches costs
few loop wake-ups while lookups and heartbeats on the other sockets still wait at most about a
millisecond. Socket roles match LMCache: PULL for fire-and-forget, ROUTER for requests,
optional heartbeat ROUTER; plus ours: PUB of index deltas and a ROUTER answering snapshots.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket as pysocket
import time
from typing import Any, cast

import zmq
import zmq.asyncio

from kvpool.controller.allowlist import FILE_POLL_S, AllowlistFile
from kvpool.controller.control import ControlPlane
from kvpool.controller.orchestration import handle_zmq_orchestration
from kvpool.controller.persistence import RedisStore
from kvpool.controller.registry import WorkerRecord
from kvpool.controller.service import ControllerService
from kvpool.controller.settings import ControllerSettings
from kvpool.protocol import deltas as dl
from kvpool.protocol import lmcache_codec as codec
from kvpool.protocol import lmcache_wire as p

logger = logging.getLogger(__name__)

#: Keys of purged workers swept from the index per loop turn (about a millisecond of work).
SWEEP_STEP = 2048


def detect_ip() -> str:
    """The address of the default route (no packet is sent), or loopback."""
    with contextlib.suppress(OSError), pysocket.socket(pysocket.AF_INET, pysocket.SOCK_DGRAM) as s:
        s.connect(("10.255.255.255", 1))
        return str(s.getsockname()[0])
    return "127.0.0.1"


class ControllerServer:
    """Binds the sockets, runs the loops, and owns the service, persistence and control plane."""

    def __init__(self, settings: ControllerSettings) -> None:
        self.settings = settings
        self.ctx = zmq.asyncio.Context()
        self.service = ControllerService(
            settings, ControlPlane(self.ctx, settings.control_timeout_s)
        )
        self.store: RedisStore | None = None
        if settings.redis_url:
            self.store = RedisStore(
                settings.redis_url,
                settings.redis_namespace,
                self.service.metrics,
                settings.redis_queue_max_keys,
                settings.redis_batch_keys,
            )
            self.service.metrics.gauges["persistence_queue_keys"] = lambda: float(
                self.store.queued_keys if self.store else 0
            )
        self.service.record_deltas = settings.pub_port is not None or self.store is not None
        self.allowlist_file: AllowlistFile | None = None
        if settings.instances_file:  # read now: no registration is accepted before it
            self.allowlist_file = AllowlistFile(settings.instances_file)
            self.allowlist_file.load(self.service.allowlist)
        self.ports: dict[str, int] = {}
        self.ready = False
        self.ha: Any = None  # ha.Ha while elections run (``--lease-name``)
        self.loaded_from_redis = 0
        self._sockets: dict[str, zmq.asyncio.Socket] = {}
        self._shadows: dict[str, zmq.Socket[bytes]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    # ------------------------------------------------------------------ setup

    def _bind(self, role: str, kind: int, port: int) -> None:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if kind == zmq.PUB:
            sock.setsockopt(zmq.SNDHWM, 100_000)
        else:
            sock.setsockopt(zmq.RCVHWM, 100_000)
        host = self.settings.host
        if port == 0:
            port = sock.bind_to_random_port(f"tcp://{host}")
        else:
            sock.bind(f"tcp://{host}:{port}")
        self._sockets[role] = sock
        self._shadows[role] = zmq.Socket.shadow(sock.underlying)
        self.ports[role] = port

    def bind(self) -> dict[str, int]:
        """Bind every configured socket; port 0 picks a free one. Returns role → port."""
        s = self.settings
        self._bind("pull", zmq.PULL, s.monitor_ports["pull"])
        if "reply" in s.monitor_ports:
            self._bind("reply", zmq.ROUTER, s.monitor_ports["reply"])
        if "heartbeat" in s.monitor_ports:
            self._bind("heartbeat", zmq.ROUTER, s.monitor_ports["heartbeat"])
            host = s.advertise_host or (
                s.host if s.host not in ("0.0.0.0", "*", "") else detect_ip()
            )
            self.service.heartbeat_url = s.heartbeat_url or f"{host}:{self.ports['heartbeat']}"
        if s.pub_port is not None:
            self._bind("pub", zmq.PUB, s.pub_port)
        if s.snapshot_port is not None:
            self._bind("snapshot", zmq.ROUTER, s.snapshot_port)
        logger.info("controller sockets bound on %s: %s", s.host, self.ports)
        return dict(self.ports)

    async def restore(self) -> None:
        """Reload the index from Redis (if configured); on failure start empty and full-sync."""
        if self.store is None:
            return
        t0 = time.perf_counter()
        try:
            state = await self.store.load()
        except Exception as exc:
            self.service.metrics.persistence_errors += 1
            logger.error(
                "could not reload the index from %s (%s); workers will full-sync",
                self.store.url,
                exc,
            )
            return
        svc = self.service
        now = svc.clock()
        recording, svc.record_deltas = svc.record_deltas, False  # already in Redis
        for (instance_id, worker_id), w in state.workers.items():
            svc.registry.restore(
                WorkerRecord(
                    instance_id, worker_id, w.ip, w.port, w.peer_init_url, w.registration_time, now
                )
            )
            if svc.control is not None:
                svc.control.set_worker(instance_id, worker_id, f"{w.ip}:{w.port}")
        for instance_id, worker_id, location, keys in state.entries:
            svc.index.replace(instance_id, worker_id, location, keys)
        svc.record_deltas = recording
        self.loaded_from_redis = state.chunk_locations
        logger.info(
            "reloaded %d workers and %d chunk-locations from %s in %.3fs",
            len(state.workers),
            state.chunk_locations,
            self.store.url,
            time.perf_counter() - t0,
        )

    # ------------------------------------------------------------------ loops

    async def serve(self) -> None:
        """Run every loop until cancelled; with ``--lease-name``, as a standby until this replica
        wins the Lease (``ha.py``)."""
        if self.settings.lease_name is not None:
            from kvpool.controller.ha import run_elected  # noqa: PLC0415 (ha imports this module)

            await run_elected(self)
            return
        await self.lead()

    async def lead(self, restore: bool = True, serving: asyncio.Event | None = None) -> None:
        """Bind (if not yet), reload the index (``restore``; an adopted standby copy is instead
        written to Redis in full), run every loop; ``serving`` is set once they run."""
        if not self._sockets:
            self.bind()
        if restore:
            await self.restore()
        elif self.store is not None:
            self.store.rewrite()  # the old leader's last writes may not have reached Redis
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._drain_loop("pull", self._on_push))
            if "reply" in self._sockets:
                tg.create_task(self._drain_loop("reply", self._on_request))
            if "heartbeat" in self._sockets:
                tg.create_task(self._drain_loop("heartbeat", self._on_heartbeat))
            if "snapshot" in self._sockets:
                tg.create_task(self._drain_loop("snapshot", self._on_snapshot))
            if self.settings.purge_enabled:
                tg.create_task(self._purge_loop())
            tg.create_task(self._sweep_loop())
            if self.allowlist_file is not None:
                tg.create_task(self._allowlist_loop(self.allowlist_file))
            tg.create_task(self.service.metrics.watch_loop_lag())
            if self.store is not None:
                tg.create_task(self.store.run(self._snapshot_now))
            self.ready = True
            logger.info("controller ready (epoch %s)", self.service.epoch)
            if serving is not None:
                serving.set()

    async def _drain_loop(self, role: str, handle: Any) -> None:
        asock = self._sockets[role]
        budget = self.settings.drain_budget_ms / 1000.0
        # While a burst of pushes drains, requests waiting on the request sockets are answered
        # between two push frames: a lookup waits for at most one admit/evict batch, not for
        # the whole drain budget.
        urgent = (
            [(r, self._shadows[r], h) for r, h in self._request_roles() if r in self._shadows]
            if role == "pull"
            else []
        )
        clock = time.perf_counter
        metrics = self.service.metrics
        behind_at: float | None = None  # the PULL socket still held messages at this time
        while True:
            await asock.poll()  # default: wait (no timeout) for POLLIN
            start = clock()
            drained = self._drain(role, handle, start + budget, urgent)
            self.flush()
            if role == "pull":  # how long admit/evict messages waited (metrics.py says why)
                now = clock()
                since = behind_at if behind_at is not None else (None if drained else start)
                if since is not None:
                    metrics.backlog_seconds += now - since
                behind_at = None if drained else now
            await asyncio.sleep(0)

    def _request_roles(self) -> list[tuple[str, Any]]:
        return [("reply", self._on_request), ("heartbeat", self._on_heartbeat)]

    def _drain(
        self,
        role: str,
        handle: Any,
        deadline: float,
        urgent: list[tuple[str, zmq.Socket[bytes], Any]],
    ) -> bool:
        """Handle up to ``drain_batch`` frames of one socket without blocking, until the deadline;
        between two frames, answer whatever the ``urgent`` sockets hold. True when it stopped
        because the socket was empty."""
        ssock = self._shadows[role]
        clock = time.perf_counter
        for _ in range(self.settings.drain_batch):
            try:
                frames = ssock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return True
            self._handle(role, handle, frames)
            for other, osock, ohandle in urgent:
                if cast(int, osock.get(zmq.EVENTS)) & zmq.POLLIN:
                    self._drain(other, ohandle, float("inf"), [])  # at most drain_batch
            if clock() > deadline:
                break  # let the other sockets (lookups, heartbeats) have their turn
        return False

    def _handle(self, role: str, handle: Any, frames: list[bytes]) -> None:
        try:
            handle(frames)
        except Exception:
            self.service.bad("handler_error", f"handler error on {role}")
            logger.exception("handler error on %s socket", role)

    def _on_push(self, frames: list[bytes]) -> None:
        for frame in frames:  # LMCache workers batch several messages in one multipart
            try:
                msg = codec.decode(frame)
            except codec.ProtocolError as exc:
                self.service.bad(exc.kind, f"PULL frame: {exc.detail}")
                continue
            if isinstance(msg, p.ORCH_REQUESTS):
                self._spawn(handle_zmq_orchestration(self.service, msg))
            else:
                self.service.handle_push(msg)

    def _reply(self, role: str, identity: bytes, reply: Any) -> None:
        try:
            self._shadows[role].send_multipart([identity, b"", codec.encode(reply)], zmq.NOBLOCK)
        except zmq.Again:
            self.service.bad("reply_dropped", f"{role} reply dropped (peer gone or slow)")

    def _decode_request(self, role: str, frames: list[bytes]) -> tuple[bytes | None, Any]:
        try:
            identity, payload = codec.parse_router_frames(frames)
        except codec.ProtocolError as exc:
            self.service.bad(exc.kind, f"{role}: {exc.detail}")
            if len(frames) >= 2:
                self._reply(role, frames[0], p.ErrorMsg(str(exc)))
            return None, None
        try:
            return identity, codec.decode(payload)
        except codec.ProtocolError as exc:
            self.service.bad(exc.kind, f"{role} frame: {exc.detail}")
            self._reply(role, identity, p.ErrorMsg(str(exc)))
            return None, None

    def _on_request(self, frames: list[bytes]) -> None:
        identity, msg = self._decode_request("reply", frames)
        if identity is None:
            return
        if isinstance(msg, p.ORCH_REQUESTS):
            self._spawn(self._answer_orchestration(identity, msg))
            return
        self._reply("reply", identity, self.service.handle_request(msg))

    async def _answer_orchestration(self, identity: bytes, msg: Any) -> None:
        reply = await handle_zmq_orchestration(self.service, msg)
        self._reply("reply", identity, reply)

    def _on_heartbeat(self, frames: list[bytes]) -> None:
        identity, msg = self._decode_request("heartbeat", frames)
        if identity is None:
            return
        if not isinstance(msg, p.HeartbeatMsg):
            self.service.bad("unexpected_type", f"{type(msg).__name__} on the heartbeat socket")
            self._reply(
                "heartbeat",
                identity,
                p.ErrorMsg(f"Expected HeartbeatMsg, got {type(msg).__name__}"),
            )
            return
        self._reply("heartbeat", identity, self.service.handle_request(msg))

    def _on_snapshot(self, frames: list[bytes]) -> None:
        if len(frames) < 2:
            self.service.bad("frames", "snapshot request without identity")
            return
        identity = frames[0]
        self.flush()  # the snapshot must include everything numbered so far
        reply = dl.encode(self.service.snapshot())
        try:
            self._shadows["snapshot"].send_multipart([identity, b"", reply], zmq.NOBLOCK)
        except zmq.Again:
            self.service.bad("reply_dropped", "snapshot reply dropped")

    async def _purge_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_check_interval)
            self.service.purge_expired()
            self.flush()

    async def _sweep_loop(self) -> None:
        """Sweep purged workers' keys out of the index in ~1 ms steps between other work (a
        purge itself is O(1): see ``kvpool.protocol.index``)."""
        index = self.service.index
        while True:
            left = index.sweep(SWEEP_STEP)
            await asyncio.sleep(0 if left else 0.05)

    async def _allowlist_loop(self, file: AllowlistFile) -> None:
        """Apply the ``--instances-file`` again whenever the kubelet updates it."""
        while True:
            await asyncio.sleep(FILE_POLL_S)
            file.poll(self.service.allowlist)

    def _snapshot_now(self) -> dl.Snapshot:
        self.flush()
        return self.service.snapshot()

    def flush(self) -> None:
        """Hand the service's pending deltas to the PUB socket and the Redis writer."""
        deltas = self.service.take_deltas()
        if not deltas:
            return
        pub = self._shadows.get("pub")
        if pub is not None:
            svc = self.service
            frame = dl.encode(dl.DeltaBatch(svc.epoch, deltas, svc.term, svc.term_start))
            try:
                pub.send_multipart([dl.TOPIC, frame], zmq.NOBLOCK)
                self.service.metrics.deltas_published += len(deltas)
            except zmq.Again:
                self.service.bad("pub_dropped", "delta batch dropped at the PUB high-water mark")
        if self.store is not None:
            self.store.submit(deltas)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self.service.control is not None:
            self.service.control.close()
        for sock in self._sockets.values():
            sock.close(linger=0)
        self._sockets.clear()
        if self.store is not None:
            with contextlib.suppress(Exception):
                await self.store.close()
        self.ctx.destroy(linger=0)
