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

With several gateway replicas, LMCache's sender notifies the pair's proxy port through the
gateway's Service, so a notification may reach a replica other than the one that waits for
it. Each req_id therefore names its owner (``<uuid>@<pod ip>:<proxy port>``, from ``POD_IP``)
and a replica that receives another's notification relays it there (:func:`owner_of`); a
replica without ``POD_IP`` (run by hand, alone) names no owner and keeps every notification.

A transfer the proxy will not decode (the first token ended the answer, the client left, the
transfer landed after the decoder already recomputed) is released: once it has landed (never
before: the sender may still be writing into the pages), ``POST`` of the prompt to the
decoder's ``/pd/release`` (``kvpool.protocol.pd``) frees it at once instead of after the
decoder's unclaimed-transfer TTL. LMCache frees a receiver's buffer only when a decode
retrieves; without this, such transfers filled it and every later push waited forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvpool.gateway.config import DecodeRef, PDPairConfig
from kvpool.gateway.instances import InstanceSet
from kvpool.gateway.metrics import GatewayMetrics
from kvpool.gateway.upstream import CALL_ERRORS
from kvpool.protocol.pd import RELEASE_PATH, release_body

logger = logging.getLogger(__name__)

MAX_TRACKED = 65_536
MAX_RELAY_PEERS = 16  # replicas a notification is relayed to, each one PUSH socket (LRU)
RELAY_HWM = 1000  # notifications queued for one replica (not yet connected, or gone) at most
MAX_RELEASES = 4096  # releases waiting for their transfer at once; beyond, the decoder's TTL
RELEASE_TIMEOUT_S = 5.0
#: ``Upstream.post_json``: (url, body, timeout) → (status, JSON, text).
PostJson = Callable[[str, dict[str, Any], float], Awaitable[tuple[int, Any, str]]]


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


def owner_address(host: str, port: int) -> str:
    """``host:port`` as a ZMQ tcp endpoint takes it (an IPv6 host in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def new_req_id(owner: str | None) -> str:
    """A fresh transfer id, naming the replica that waits for it when ``owner`` is given."""
    rid = uuid.uuid4().hex
    return f"{rid}@{owner}" if owner else rid


def owner_of(req_id: str) -> str | None:
    """The ``host:port`` of the replica a transfer's notification belongs to, if it names one."""
    _, at, owner = req_id.partition("@")
    return owner if at and owner else None


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
class Transfer:
    """One prompt's KV on its way to a decode instance (``req_id`` names it on the wire)."""

    pair: str
    decode: str
    req_id: str
    tokens: list[int]
    landed: asyncio.Event


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


def _port_of(sock: zmq.asyncio.Socket) -> int:
    """The TCP port a bound socket listens on."""
    endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
    text = endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)
    return int(text.rsplit(":", 1)[1])


class PDCoordinator:
    """Owns one PULL socket per PD pair and the transfer waits."""

    def __init__(
        self,
        pairs: Sequence[PDPairConfig],
        instances: InstanceSet,
        bind_host: str,
        metrics: GatewayMetrics,
        transfer_timeout_s: float,
        own_host: str | None = None,
    ) -> None:
        self.pairs = {p.name: p for p in pairs}
        self.own_host = own_host
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
        self._releases: set[asyncio.Task[None]] = set()
        self._relay_ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._relays: OrderedDict[str, zmq.Socket[bytes]] = OrderedDict()

    def owner(self, port: int) -> str | None:
        """This replica's address for notifications arriving on ``port`` (None: alone)."""
        return owner_address(self.own_host, port) if self.own_host else None

    async def start(self) -> None:
        """Bind every pair's PULL socket before any prefill can be sent."""
        self.bind_ports(self.pairs.values())

    def bind_ports(self, pairs: Iterable[PDPairConfig]) -> None:
        """A PULL socket on each proxy port of ``pairs`` not bound yet (a live reconfiguration
        binds a new pair's port before it routes to it); ``OSError`` naming a port that cannot
        be bound (those bound before it stay, unused until a pair names them)."""
        ports = sorted({p.proxy_port for p in pairs} - set(self.bound.values()))
        for port in ports:
            if self._ctx is None:
                self._ctx = zmq.asyncio.Context()
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
            receive = asyncio.create_task(self._receive(sock, port), name=f"pd-receive-{port}")
            self._tasks.append(receive)
        if ports:
            logger.info(
                "PD proxy listening for transfer-done on %s ports %s", self.bind_host, ports
            )

    def use_pairs(self, pairs: Sequence[PDPairConfig]) -> None:
        """Route to ``pairs`` from now on (their ports bound first by :meth:`bind_ports`). The
        port of a pair no longer listed is closed after the transfer timeout, by when every
        transfer in flight through it has landed or timed out."""
        self.pairs = {p.name: p for p in pairs}
        self.targets = {d.name: DecodeTarget.of(d) for p in pairs for d in p.decode}
        for port in set(self.bound.values()) - {p.proxy_port for p in pairs}:
            self._tasks.append(asyncio.create_task(self._close_later(port)))

    async def _close_later(self, port: int) -> None:
        await asyncio.sleep(self.transfer_timeout_s)
        if port in {p.proxy_port for p in self.pairs.values()} or str(port) not in self.bound:
            return  # named again meanwhile, or closed already
        del self.bound[str(port)]
        for task in [t for t in self._tasks if t.get_name() == f"pd-receive-{port}"]:
            task.cancel()
            self._tasks.remove(task)
        for sock in [s for s in self._sockets if _port_of(s) == port]:
            sock.close(linger=0)
            self._sockets.remove(sock)
        logger.info("PD proxy port %d closed (no pair names it)", port)

    async def _receive(self, sock: zmq.asyncio.Socket, port: int) -> None:
        while True:
            frame = await sock.recv()
            req_id = decode_notification(frame)
            if req_id is None:
                logger.warning("PD proxy port %d: dropped a message that is not ProxyNotif", port)
                continue
            owner = owner_of(req_id)
            if owner is None or owner == self.owner(port):
                self.waits.notified(req_id)
            else:
                self._relay(owner, frame)

    def _relay(self, owner: str, frame: bytes) -> None:
        """Pass another replica's notification on to it (never blocks: dropped when its queue
        is full, and that replica's wait then ends at its timeout)."""
        sock = self._relays.pop(owner, None)
        if sock is None:
            if self._relay_ctx is None:
                self._relay_ctx = zmq.Context()
            sock = self._relay_ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, RELAY_HWM)
            sock.connect(f"tcp://{owner}")
        self._relays[owner] = sock
        while len(self._relays) > MAX_RELAY_PEERS:
            self._relays.popitem(last=False)[1].close(linger=0)
        try:
            sock.send(frame, zmq.NOBLOCK)
        except zmq.ZMQError:
            self.metrics.pd_relays.labels("dropped").inc()
            return
        self.metrics.pd_relays.labels("relayed").inc()

    def expect(self, pair: str, target: DecodeTarget, tokens: list[int]) -> Transfer:
        """A new transfer of ``tokens`` to ``target``, waited for from now on (before its
        prefill is sent); ended by :meth:`wait_transfer`, :meth:`release` or :meth:`forget`."""
        req_id = new_req_id(self.owner(self.pairs[pair].proxy_port))
        landed = self.waits.expect(req_id, len(target.init_ports))
        return Transfer(pair, target.name, req_id, tokens, landed)

    def forget(self, transfer: Transfer) -> None:
        self.waits.done(transfer.req_id)

    async def wait_transfer(self, transfer: Transfer) -> bool:
        """True once every rank reported; False after the timeout (decode recomputes; the
        wait stays open so that :meth:`release` can free a late transfer)."""
        try:
            await asyncio.wait_for(transfer.landed.wait(), self.transfer_timeout_s)
        except TimeoutError:
            logger.warning(
                "PD pair %s: no transfer-done for %s within %.0fs; decoding anyway",
                transfer.pair,
                transfer.req_id,
                self.transfer_timeout_s,
            )
            self.metrics.pd_transfers.labels(transfer.pair, "transfer_timeout").inc()
            return False
        self.forget(transfer)
        return True

    def release(self, transfer: Transfer, post: PostJson) -> None:
        """The proxy will not decode ``transfer``: in the background, once it has landed
        (bounded by the transfer timeout), ask its decode instance to free it."""
        if len(self._releases) >= MAX_RELEASES:
            self.forget(transfer)
            self._count_release(transfer, "dropped")  # the decoder's TTL frees it
            return
        task = asyncio.create_task(self._release(transfer, post))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release(self, transfer: Transfer, post: PostJson) -> None:
        try:
            await asyncio.wait_for(transfer.landed.wait(), self.transfer_timeout_s)
        except TimeoutError:
            # Never free pages the sender may still be writing: the decoder's TTL will.
            self._count_release(transfer, "not_landed")
            return
        finally:
            self.forget(transfer)
        inst = self.instances.get(transfer.decode)
        outcome = "unknown_decoder"
        if inst is not None:
            body = release_body(transfer.req_id, transfer.tokens)
            try:
                status, _, text = await post(inst.url + RELEASE_PATH, body, RELEASE_TIMEOUT_S)
                outcome = "released" if status == 200 else f"status_{status}"
                if status != 200:
                    logger.warning("PD release %s on %s: %d %s", transfer.req_id, inst.name,
                                   status, text[:200])  # fmt: skip
            except CALL_ERRORS as exc:
                outcome = "failed"
                logger.warning("PD release %s on %s failed: %r", transfer.req_id, inst.name, exc)
        self._count_release(transfer, outcome)

    def _count_release(self, transfer: Transfer, outcome: str) -> None:
        self.metrics.pd_releases.labels(transfer.pair, outcome).inc()

    async def stop(self) -> None:
        for task in [*self._tasks, *self._releases]:
            task.cancel()
        for task in [*self._tasks, *self._releases]:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for sock in [*self._sockets, *self._relays.values()]:
            sock.close(linger=0)
        if self._relay_ctx is not None:
            self._relay_ctx.destroy(linger=0)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
        self._tasks.clear()
        self._releases.clear()
        self._sockets.clear()
        self._relays.clear()
        self._ctx = self._relay_ctx = None
