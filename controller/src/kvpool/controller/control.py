"""Controller → worker control requests (clear, pin, compress, decompress, move, health).

Why a DEALER and not LMCache's REQ: each LMCache worker binds a REP socket on its
``lmcache_worker_ports[rank]``. A REQ socket that never gets an answer (a dead worker) is stuck
forever in LMCache's controller. A DEALER speaks to the same REP (empty delimiter frame first),
takes a timeout per request, and is recreated after a timeout so the next request starts clean.
Sockets are created lazily, on the first control request, so registering thousands of workers
(or a benchmark's fake addresses) opens no connection.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvpool.protocol import lmcache_codec as codec

logger = logging.getLogger(__name__)


class ControlError(RuntimeError):
    """A control request failed; the message names the worker and what went wrong."""


class WorkerChannel:
    """One worker's control connection; requests to it are serialised (REP is lockstep)."""

    def __init__(self, ctx: zmq.asyncio.Context, url: str, name: str) -> None:
        self._ctx = ctx
        self.url = url
        self.name = name
        self._socket: zmq.asyncio.Socket | None = None
        self._lock = asyncio.Lock()

    def _open(self) -> zmq.asyncio.Socket:
        if self._socket is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{self.url}")
            self._socket = sock
        return self._socket

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    async def request(self, msg: msgspec.Struct, timeout_s: float) -> Any:
        async with self._lock:
            sock = self._open()
            try:
                async with asyncio.timeout(timeout_s):
                    await sock.send_multipart([b"", codec.encode(msg)])
                    frames = await sock.recv_multipart()
            except TimeoutError:
                self.close()  # a late reply must not answer the next request
                raise ControlError(
                    f"worker {self.name} at {self.url} did not answer "
                    f"{type(msg).__name__} within {timeout_s:g}s"
                ) from None
            except zmq.ZMQError as exc:
                self.close()
                raise ControlError(f"worker {self.name} at {self.url}: {exc}") from exc
        try:
            return codec.decode(frames[-1])
        except codec.ProtocolError as exc:
            raise ControlError(f"worker {self.name} sent an undecodable reply: {exc}") from exc


class ControlPlane:
    """Channels to all registered workers, keyed by (instance id, worker id)."""

    def __init__(self, ctx: zmq.asyncio.Context, timeout_s: float) -> None:
        self._ctx = ctx
        self.timeout_s = timeout_s
        self._channels: dict[tuple[str, int], WorkerChannel] = {}

    def set_worker(self, instance_id: str, worker_id: int, url: str) -> None:
        key = (instance_id, worker_id)
        old = self._channels.get(key)
        if old is not None and old.url == url:
            return
        if old is not None:
            old.close()
        self._channels[key] = WorkerChannel(self._ctx, url, f"{instance_id}/{worker_id}")

    def drop_worker(self, instance_id: str, worker_id: int) -> None:
        channel = self._channels.pop((instance_id, worker_id), None)
        if channel is not None:
            channel.close()

    async def fan_out(self, instance_id: str, worker_ids: list[int], make: Any) -> list[Any]:
        """Send ``make(worker_id)`` to every listed worker of the instance concurrently."""
        if not worker_ids:
            raise ControlError(f"instance {instance_id!r} has no registered worker")
        channels = []
        for worker_id in worker_ids:
            channel = self._channels.get((instance_id, worker_id))
            if channel is None:
                raise ControlError(f"worker {instance_id}/{worker_id} is not registered")
            channels.append(channel)
        return list(
            await asyncio.gather(
                *(
                    c.request(make(w), self.timeout_s)
                    for c, w in zip(channels, worker_ids, strict=True)
                )
            )
        )

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()
