"""The simulated engine's LMCache controller client: LMCache 0.5.6's ``LMCacheWorker`` in asyncio.

Why this module exists: kvpool-controller must not be able to tell a simulated worker from a
real one, so this speaks the wire exactly as ``cache_controller/worker.py`` does
(/work/notes/lmcache-worker-protocol.md has the file:line references):

- sockets: PUSH to ``controller_pull_url`` (every fire-and-forget message, up to 50 per
  multipart), a DEALER to ``controller_reply_url`` (register, P2P lookup, full-sync start and
  status; ``[b"", payload]`` framing; one request at a time), a second DEALER to the
  ``heartbeat_url`` the registration answer names (no URL: no heartbeats), and a REP bound on
  ``lmcache_worker_ports[0]`` answering the controller's commands (:mod:`.control`);
- start: ``RegisterMsg`` and wait up to ``worker_socket_recv_timeout_ms``. Accepted: push, REP
  and heartbeat tasks start. Refused (kvpool's ``ErrorMsg("registration refused: ...")``):
  LMCache only logs it; here it also becomes :attr:`ControllerClient.refusal` (the runtime's
  ``/readyz`` then says refused, as the reference worker's registration check does). No answer:
  LMCache goes mute for the rest of its life, and so does this client (logged as an error);
- a timed-out DEALER is closed and recreated, and the caller gets LMCache's canned answer;
- heartbeats after ``lmcache_worker_heartbeat_delay_time``, every
  ``lmcache_worker_heartbeat_time`` plus the round trip; a ``FullSyncCommand`` starts
  :class:`~.full_sync.FullSync` unless one runs;
- admits and evicts through one :class:`~.kv_batch.KvOpBatcher` per location;
- close: what is queued in the batchers is dropped (LMCache closes its worker first), a
  ``DeRegisterMsg`` is pushed and given time to leave, the sockets close.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvpool.protocol import lmcache_codec as codec
from kvpool.protocol import lmcache_wire as w
from kvpool.worker.sim.config import ControllerLink
from kvpool.worker.sim.control import ControlTarget, reply_to
from kvpool.worker.sim.full_sync import FullSync
from kvpool.worker.sim.kv_batch import KvOpBatcher

logger = logging.getLogger(__name__)

REFUSED_PREFIX = "registration refused: "
PUSH_BATCH = 50  # LMCache's push() sends at most 50 queued messages per multipart


class ControllerClientError(RuntimeError):
    """The client cannot start (its REP port is taken); the message names the key."""


class ControllerClient:
    """One LMCache worker (TP rank ``worker_id``) talking to the controller."""

    def __init__(
        self,
        link: ControllerLink,
        *,
        instance_id: str,
        ip: str,
        bind_host: str,
        peer_init_url: str | None,
        control: ControlTarget,
        sync_keys: Callable[[], list[int]],
        set_frozen: Callable[[bool], None],
        worker_id: int = 0,
        ctx: zmq.asyncio.Context | None = None,
    ) -> None:
        self.link = link
        self.instance_id = instance_id
        self.worker_id = worker_id
        self.ip = ip
        self.port = link.worker_port
        self.peer_init_url = peer_init_url
        self._bind_host = "*" if bind_host in ("", "0.0.0.0", "::") else bind_host
        self._control = control
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._push: zmq.asyncio.Socket | None = None
        self._req: zmq.asyncio.Socket | None = None
        self._hb: zmq.asyncio.Socket | None = None
        self._hb_url: str | None = None
        self._rep: zmq.asyncio.Socket | None = None
        self._req_lock = asyncio.Lock()
        self._outbox: deque[bytes] = deque()
        self._outbox_ready = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []
        self._closed = False
        self.refusal: str | None = None
        self.registered = False
        self.mute = False
        self.batchers = {
            loc: KvOpBatcher(
                instance_id,
                worker_id,
                loc,
                self.push,
                batch_size=link.kv_batch_size,
                timeout_s=link.kv_batch_timeout_s,
            )
            for loc in ("LocalCPUBackend", "LocalDiskBackend")
        }
        self.full_sync = FullSync(
            link.full_sync,
            instance_id,
            worker_id,
            request=self.request,
            push=self.push,
            keys=sync_keys,
            set_frozen=set_frozen,
        )
        self.counters: dict[str, float] = {
            "requests": 0,
            "request_timeouts": 0,
            "heartbeats": 0,
            "control_requests": 0,
            "p2p_lookups": 0,
            "p2p_hit_chunks": 0,
            "frames_pushed": 0,
        }

    # --- sockets ---------------------------------------------------------------------------
    def _dealer(self, url: str) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.connect(f"tcp://{url}")
        return sock

    async def start(self) -> None:
        """Bind the REP socket, register, and (unless mute) start pushing, answering and
        heartbeating. Returns once the registration is answered or timed out."""
        rep = self._ctx.socket(zmq.REP)
        try:
            rep.bind(f"tcp://{self._bind_host}:{self.port}")
        except zmq.ZMQError as exc:
            rep.close(linger=0)
            raise ControllerClientError(
                f"lmcache_worker_ports[0]: cannot bind {self._bind_host}:{self.port} ({exc}); "
                "render a free port for this instance"
            ) from exc
        self._rep = rep
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.connect(f"tcp://{self.link.pull_url}")
        self._req = self._dealer(self.link.reply_url)
        await self._register()
        if self.mute:
            return
        for coro, name in (
            (self._push_loop(), "push"),
            (self._rep_loop(), "rep"),
            (self._heartbeat_loop(), "heartbeat"),
        ):
            self._tasks.append(asyncio.create_task(coro, name=f"{self.instance_id}-{name}"))
        self._outbox_ready.set()  # what was queued while registering

    async def _register(self) -> None:
        msg = w.RegisterMsg(
            instance_id=self.instance_id,
            worker_id=self.worker_id,
            ip=self.ip,
            port=self.port,
            peer_init_url=self.peer_init_url,
        )
        reply = await self.request(msg)
        if isinstance(reply, w.RegisterRetMsg):
            self.registered = True
            self._hb_url = reply.extra_config.get("heartbeat_url")
            if self._hb_url:
                self._hb = self._dealer(self._hb_url)
            else:
                logger.info("%s: no heartbeat_url from the controller: no heartbeats", self.ip)
        elif isinstance(reply, w.ErrorMsg):
            self._refused(reply.error)
        else:
            self.mute = True
            logger.error(
                "the controller at %s did not answer the registration of %s within %.1fs: "
                "this worker stays mute (no admits, evicts, heartbeats or commands), as "
                "LMCache 0.5.6 does; restart it once the controller is up",
                self.link.reply_url,
                self.instance_id,
                self.link.recv_timeout_s,
            )

    def _refused(self, error: str) -> None:
        reason = error[len(REFUSED_PREFIX) :] if error.startswith(REFUSED_PREFIX) else error
        if self.refusal is None:
            logger.error(
                "the controller at %s refused instance %s: %s — this worker is not ready (its "
                "chunks would never be found by the pool)",
                self.link.reply_url,
                self.instance_id,
                reason,
            )
        self.refusal = reason

    async def request(self, msg: msgspec.Struct, *, heartbeat: bool = False) -> object | None:
        """Send on a DEALER and wait for the reply; None on timeout (socket recreated) or a
        reply that does not decode."""
        if heartbeat:
            return await self._exchange(msg, heartbeat=True)
        async with self._req_lock:
            return await self._exchange(msg, heartbeat=False)

    async def _exchange(self, msg: msgspec.Struct, *, heartbeat: bool) -> object | None:
        sock = self._hb if heartbeat else self._req
        if sock is None or self._closed:
            return None
        self.counters["requests"] += 1
        try:
            await sock.send_multipart([b"", codec.encode(msg)])
            frames = await asyncio.wait_for(sock.recv_multipart(), self.link.recv_timeout_s)
        except (TimeoutError, zmq.ZMQError) as exc:
            self.counters["request_timeouts"] += 1
            logger.warning("%s to the controller: no answer (%r)", type(msg).__name__, exc)
            sock.close(linger=0)
            url = self._hb_url if heartbeat else self.link.reply_url
            fresh = self._dealer(url) if url and not self._closed else None
            if heartbeat:
                self._hb = fresh
            else:
                self._req = fresh
            return None
        try:
            reply: object = codec.decode(frames[-1])
            return reply
        except codec.ProtocolError as exc:
            logger.warning("undecodable answer to %s: %s", type(msg).__name__, exc)
            return None

    def push(self, msg: msgspec.Struct) -> None:
        """Queue a fire-and-forget message for the PUSH socket."""
        if self._closed or self.mute:
            return
        self._outbox.append(codec.encode(msg))
        if self._tasks:
            self._outbox_ready.set()

    async def _push_loop(self) -> None:
        assert self._push is not None
        while True:
            await self._outbox_ready.wait()
            while self._outbox:
                n = min(PUSH_BATCH, len(self._outbox))
                frames = [self._outbox.popleft() for _ in range(n)]
                await self._push.send_multipart(frames)
                self.counters["frames_pushed"] += n
            self._outbox_ready.clear()

    async def _rep_loop(self) -> None:
        assert self._rep is not None
        while True:
            raw = await self._rep.recv()
            self.counters["control_requests"] += 1
            try:
                reply = reply_to(codec.decode(raw), self._control)
            except codec.ProtocolError as exc:
                reply = w.ErrorMsg(error=f"Worker error: {exc}")
            await self._rep.send(codec.encode(reply))

    async def _heartbeat_loop(self) -> None:
        beat = self.link.heartbeat_s
        if beat is None or self._hb is None:
            return
        await asyncio.sleep(self.link.heartbeat_delay_s)
        msg = w.HeartbeatMsg(
            instance_id=self.instance_id,
            worker_id=self.worker_id,
            ip=self.ip,
            port=self.port,
            peer_init_url=self.peer_init_url,
        )
        while True:
            reply = await self.request(msg, heartbeat=True)
            self.counters["heartbeats"] += 1
            if isinstance(reply, w.HeartbeatRetMsg):
                for command in reply.commands:
                    if isinstance(command, w.FullSyncCommand):
                        if not self.full_sync.running:
                            self._tasks.append(
                                asyncio.create_task(
                                    self.full_sync.run(command.reason),
                                    name=f"{self.instance_id}-full-sync",
                                )
                            )
                    else:
                        logger.warning("unknown heartbeat command %r", command)
            elif isinstance(reply, w.ErrorMsg):
                logger.warning("heartbeat answered with an error: %s", reply.error)
                if reply.error.startswith(REFUSED_PREFIX):
                    self._refused(reply.error)
            await asyncio.sleep(beat)

    # --- what the engine calls -------------------------------------------------------------
    def kv_op(self, location: str, op: str, key: int) -> None:
        batcher = self.batchers.get(location)
        if batcher is not None and not self.mute and not self._closed:
            batcher.add(op, key)

    async def p2p_lookup(self, hashes: list[int]) -> int:
        """How many leading ``hashes`` a peer holds (``layout_info[0]``); 0 on any failure."""
        if not hashes or self.mute or self._closed:
            return 0
        self.counters["p2p_lookups"] += 1
        msg = w.BatchedP2PLookupMsg(
            hashes=hashes, instance_id=self.instance_id, worker_id=self.worker_id
        )
        reply = await self.request(msg)
        if not isinstance(reply, w.BatchedP2PLookupRetMsg) or not reply.layout_info:
            return 0
        instance, _, hit, _ = reply.layout_info[0]
        hit = max(0, min(int(hit), len(hashes))) if instance else 0
        self.counters["p2p_hit_chunks"] += hit
        return hit

    def metrics(self) -> dict[str, float]:
        out = {f"lmcache_{k}_total": v for k, v in self.counters.items()}
        out["lmcache_controller_registered"] = 1.0 if self.registered else 0.0
        out["lmcache_outbox_frames"] = float(len(self._outbox))
        for name, value in self.full_sync.counters.items():
            out[f"lmcache_full_syncs_{name}_total"] = float(value)
        return out

    async def close(self, budget_s: float = 1.0) -> None:
        """Deregister (given up to ``budget_s`` to leave) and close every socket."""
        if self._closed:
            return
        for batcher in self.batchers.values():
            batcher.close()
        if self.registered and self._push is not None:
            self._outbox.append(
                codec.encode(
                    w.DeRegisterMsg(
                        instance_id=self.instance_id,
                        worker_id=self.worker_id,
                        ip=self.ip,
                        port=self.port,
                    )
                )
            )
            self._outbox_ready.set()
            loop = asyncio.get_running_loop()
            end = loop.time() + budget_s
            while self._outbox and loop.time() < end:
                await asyncio.sleep(0.005)
        self._closed = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for sock in (self._req, self._hb, self._rep):
            if sock is not None:
                sock.close(linger=0)
        if self._push is not None:
            self._push.close(linger=int(max(budget_s, 0.1) * 1000))  # the DeRegister leaves
