"""The PD proxy role: prefill on one instance, wait until its KV landed on the decoder,
then decode there — the proxy of lmcache 0.5.6's disaggregated prefill.

Why this module exists: in a PDPair the prefill worker computes the prompt's KV and LMCache
pushes it into buffers the decode worker allocated; the decode worker must not start before
the data is there (it reports a hit as soon as its buffer is allocated, before the bytes
land). LMCache's PD sender tells the proxy by sending ``ProxyNotif(req_id)`` (msgpack of a
tagged struct) to a ZMQ PULL socket at the pair's ``pd_proxy_port``, once per TP rank. The
worker-side contract is /tmp/kvpool-team/pd-contract.md (mirrors LMCache's example proxy):

1. prefill: ``POST /v1/completions`` with the prompt ids, ``max_tokens: 1``, no stream and
   ``kv_transfer_params = {"ret_first_tok": true, "disagg_spec": {req_id, receiver_host,
   receiver_init_port[], receiver_alloc_port[]}}``; the answer carries
   ``kv_transfer_params.first_tok``;
2. wait for ``len(receiver_init_port)`` notifications of ``req_id`` (bounded by a timeout: a
   chunk that never landed is recomputed by the decoder, so output stays correct);
3. decode: ``POST /v1/completions`` with ``prompt + [first_tok]`` and ``max_tokens - 1``.

The prefill instance is chosen by KV affinity, the decode instance by load.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from kvpool.gateway.config import DecodeRef, PDPairConfig
from kvpool.gateway.instances import InstanceSet
from kvpool.gateway.metrics import GatewayMetrics

logger = logging.getLogger(__name__)

MAX_TRACKED = 65_536


class ProxyNotif(msgspec.Struct, tag=True):
    """LMCache 0.5.6's ``pd_backend.ProxyNotif`` on the wire: ``{"type": "ProxyNotif",
    "req_id": ...}`` (a test checks this against LMCache's own class)."""

    req_id: str


_NOTIF = msgspec.msgpack.Decoder(ProxyNotif)


def decode_notification(frame: bytes) -> str | None:
    """The req_id of a transfer-done notification, or None for any other message."""
    try:
        return _NOTIF.decode(frame).req_id
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


class TransferWaits:
    """req_id → notifications received, with an event set when all ranks reported.

    Bounded: at most ``MAX_TRACKED`` ids (oldest dropped), so stale notifications of
    requests that timed out never accumulate.
    """

    def __init__(self, max_tracked: int = MAX_TRACKED) -> None:
        self.max_tracked = max_tracked
        self._counts: OrderedDict[str, int] = OrderedDict()
        self._waiters: dict[str, tuple[int, asyncio.Event]] = {}

    def expect(self, req_id: str, ranks: int) -> asyncio.Event:
        event = asyncio.Event()
        self._waiters[req_id] = (ranks, event)
        if self._counts.get(req_id, 0) >= ranks:
            event.set()
        return event

    def notified(self, req_id: str) -> None:
        n = self._counts.pop(req_id, 0) + 1
        self._counts[req_id] = n
        while len(self._counts) > self.max_tracked:
            self._counts.popitem(last=False)
        waiter = self._waiters.get(req_id)
        if waiter is not None and n >= waiter[0]:
            waiter[1].set()

    def done(self, req_id: str) -> None:
        self._waiters.pop(req_id, None)
        self._counts.pop(req_id, None)


@dataclass(frozen=True)
class DecodeTarget:
    """Where the prefill worker pushes the KV: the decode instance's PD receiver ports."""

    name: str
    host: str
    init_ports: tuple[int, ...]
    alloc_ports: tuple[int, ...]

    @classmethod
    def of(cls, ref: DecodeRef) -> DecodeTarget:
        return cls(ref.name, ref.host, tuple(ref.init_ports), tuple(ref.alloc_ports))

    def disagg_spec(self, req_id: str) -> dict[str, object]:
        return {
            "req_id": req_id,
            "receiver_host": self.host,
            "receiver_init_port": list(self.init_ports),
            "receiver_alloc_port": list(self.alloc_ports),
        }


class PDCoordinator:
    """Owns one PULL socket per PD pair and the transfer waits."""

    def __init__(
        self,
        pairs: Sequence[PDPairConfig],
        instances: InstanceSet,
        bind_host: str,
        metrics: GatewayMetrics,
        transfer_timeout_s: float,
    ) -> None:
        self.pairs = {p.name: p for p in pairs}
        self.instances = instances
        self.bind_host = bind_host
        self.metrics = metrics
        self.transfer_timeout_s = transfer_timeout_s
        self.waits = TransferWaits()
        self.targets = {d.name: DecodeTarget.of(d) for p in pairs for d in p.decode}
        self.bound: dict[str, int] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._sockets: list[zmq.asyncio.Socket] = []
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Bind every pair's PULL socket before any prefill can be sent."""
        if not self.pairs:
            return
        self._ctx = zmq.asyncio.Context()
        ports = sorted({p.proxy_port for p in self.pairs.values()})
        for port in ports:
            sock = self._ctx.socket(zmq.PULL)
            sock.setsockopt(zmq.LINGER, 0)
            try:
                sock.bind(f"tcp://{self.bind_host}:{port}")
            except zmq.ZMQError as exc:
                sock.close(linger=0)
                raise OSError(
                    f"cannot bind the PD proxy port {self.bind_host}:{port} ({exc}); the "
                    "PDPair's spec.proxy.port must be free on the gateway"
                ) from None
            self._sockets.append(sock)
            self.bound[str(port)] = port
            self._tasks.append(asyncio.create_task(self._receive(sock, port)))
        logger.info("PD proxy listening for transfer-done on %s ports %s", self.bind_host, ports)

    async def _receive(self, sock: zmq.asyncio.Socket, port: int) -> None:
        while True:
            frame = await sock.recv()
            req_id = decode_notification(frame)
            if req_id is None:
                logger.warning("PD proxy port %d: dropped a message that is not ProxyNotif", port)
                continue
            self.waits.notified(req_id)

    async def wait_transfer(self, req_id: str, event: asyncio.Event, pair: str) -> bool:
        """True once every rank reported; False after the timeout (decode recomputes)."""
        try:
            await asyncio.wait_for(event.wait(), self.transfer_timeout_s)
        except TimeoutError:
            logger.warning(
                "PD pair %s: no transfer-done for %s within %.0fs; decoding anyway",
                pair,
                req_id,
                self.transfer_timeout_s,
            )
            self.metrics.pd_transfers.labels(pair, "transfer_timeout").inc()
            return False
        finally:
            self.waits.done(req_id)
        return True

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for sock in self._sockets:
            sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
        self._tasks.clear()
        self._sockets.clear()
        self._ctx = None
