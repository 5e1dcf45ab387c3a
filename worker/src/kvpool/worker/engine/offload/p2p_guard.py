"""P2P lookups that a dead or frozen peer delays once, not for as long as it is gone.

Why this module exists: in LMCache 0.5.6 a P2P get (``P2PBackend.batched_get_non_blocking``)
waits for the peer's answer up to ``p2p_socket_recv_timeout_ms`` (30 s), three times, and
between tries re-handshakes with no timeout at all (:mod:`.nixl_peers`); and the storage
manager runs every lookup's loads, local CPU hits included, one at a time behind one lock
(``AsyncSingleSerializer``). So while a peer was dead or frozen, every lookup of its survivor
queued behind the one waiting for it and the worker recomputed every prompt, its own DDR hits
included (the chaos suite: ``ZMQ error occurred for lookup_id ... Resource temporarily
unavailable``, then ``lookup ... still unanswered after 3.0s``), although the controller
already answered that nobody else held the prompt.

:class:`P2PGuard` wraps the backend's instance (LMCache's files are untouched):

- the get is kvpool's: LMCache's wire messages, one try, the answer bounded by the lookup
  timeout (after it nobody uses the answer: the scheduler has recomputed the prompt);
- a peer that failed is *down* for a cool-down (2 s, doubling to 16 s while it keeps
  failing): lookups skip it (its chunks count as a miss) instead of each waiting for it;
- buffers a timed-out peer may still write into (a frozen peer resumes and sends what it was
  asked) stay allocated until that peer answered a later request and a grace period passed, or
  it turned out to be a new process: freeing them at once could let a late write land in a
  chunk the cache reuses;
- local CPU loads no longer wait behind other tiers' loads (they allocate nothing, which is
  what LMCache's serializer protects).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
from lmcache.v1.rpc_utils import get_zmq_socket_with_timeout
from lmcache.v1.storage_backend.p2p_backend import (
    BatchedLookupAndGetMsg,
    P2PErrorCode,
    P2PErrorMsg,
    P2PMsg,
)

from kvpool.worker.engine.offload import nixl_peers

logger = logging.getLogger(__name__)

COOLDOWN_S = 2.0  # a failed peer is skipped this long, doubling while it keeps failing
MAX_COOLDOWN_S = 16.0
#: After a peer that timed out answers again, its old requests are behind it: the buffers they
#: named are freed this long after that answer.
QUARANTINE_GRACE_S = 10.0
QUARANTINE_MAX_S = 600.0  # and in any case after this long


@dataclass
class _Peer:
    failures: int = 0
    down_until: float = 0.0
    answered_at: float = 0.0  # the last good answer
    held: list[tuple[float, list[Any]]] = field(default_factory=list)  # (since, buffers)


class _Serializer:
    """LMCache's ``AsyncSingleSerializer`` (one load at a time), except local CPU loads."""

    def __init__(self) -> None:
        self.lock: asyncio.Lock | None = None
        self.free: weakref.WeakSet[Any] = weakref.WeakSet()  # coroutines run without the lock

    async def run(self, coro: Coroutine[Any, Any, Any], *args: Any, **kwargs: Any) -> Any:
        if coro in self.free:
            return await coro
        if self.lock is None:
            self.lock = asyncio.Lock()  # on the storage manager's loop, as LMCache's does
        async with self.lock:
            return await coro


class P2PGuard:
    """Bounded P2P gets with a per-peer breaker (see the module docstring)."""

    def __init__(self, storage: Any, timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self.backend = backend = storage.storage_backends["P2PBackend"]
        self.timeout_s = timeout_s
        self.clock = clock
        self.shakes = nixl_peers.install(backend.transfer_channel)
        self.peers: dict[str, _Peer] = {}
        self.counters = {"p2p_peer_failures_total": 0.0, "p2p_lookups_skipped_total": 0.0}
        self._contains = backend.batched_async_contains
        self._connect = backend._ensure_peer_connection
        backend.batched_async_contains = self.contains
        backend._ensure_peer_connection = self.ensure_connection
        backend.batched_get_non_blocking = self.get
        if storage.async_serializer is not None:
            serializer = _Serializer()
            local = storage.storage_backends.get("LocalCPUBackend")
            if local is not None:
                local_get = local.batched_get_non_blocking

                def unserialized(*args: Any, **kwargs: Any) -> Any:
                    coro = local_get(*args, **kwargs)
                    serializer.free.add(coro)
                    return coro

                local.batched_get_non_blocking = unserialized
            storage.async_serializer = serializer

    # --- the breaker ---------------------------------------------------------------------------
    def _peer(self, url: str) -> _Peer:
        return self.peers.setdefault(url, _Peer())

    def is_down(self, url: str) -> bool:
        return self.clock() < self._peer(url).down_until

    def _failed(self, url: str, why: object) -> None:
        peer = self._peer(url)
        peer.failures += 1
        cooldown = min(COOLDOWN_S * 2 ** (peer.failures - 1), MAX_COOLDOWN_S)
        peer.down_until = self.clock() + cooldown
        self.counters["p2p_peer_failures_total"] += 1
        logger.warning("P2P peer %s failed (%s): skipped for %.0fs", url, why, cooldown)

    def _answered(self, url: str, new_process: bool = False) -> None:
        peer = self._peer(url)
        peer.failures, peer.down_until, peer.answered_at = 0, 0.0, self.clock()
        if new_process:  # the process that could still write into them is gone
            for _, buffers in peer.held:
                _release(buffers)
            peer.held.clear()

    def _sweep(self, url: str) -> None:
        """Free the held buffers of ``url`` that no late write can reach any more."""
        peer, now = self._peer(url), self.clock()
        keep = []
        for since, buffers in peer.held:
            caught_up = peer.answered_at > since and now - peer.answered_at >= QUARANTINE_GRACE_S
            if caught_up or now - since >= QUARANTINE_MAX_S:
                _release(buffers)
            else:
                keep.append((since, buffers))
        peer.held = keep

    # --- LMCache's P2P backend, wrapped --------------------------------------------------------
    async def ensure_connection(self, target: str, force_update: bool = False) -> None:
        if not force_update and target in self.backend.target_peer_info_mapping:
            return
        if self.is_down(target):
            raise nixl_peers.HandshakeError(f"P2P peer {target} is down; not connecting now")
        try:
            await self._connect(target, force_update)
        except Exception as e:
            self._failed(target, e)
            raise

    async def contains(self, lookup_id: str, keys: Any, pin: bool = False) -> int:
        """LMCache's controller lookup; a hit on a peer that is down counts as a miss."""
        hit = int(await self._contains(lookup_id, keys, pin))
        target = self.backend.lookup_id_to_peer_mapping.get(lookup_id, (None,))[0]
        if hit and target is not None and self.is_down(target):
            self.backend.lookup_id_to_peer_mapping.pop(lookup_id, None)
            self.counters["p2p_lookups_skipped_total"] += 1
            return 0
        return hit

    async def get(self, lookup_id: str, keys: list[Any], transfer_spec: Any = None) -> list[Any]:
        """``P2PBackend.batched_get_non_blocking``: the hit prefix's buffers, filled by the
        peer; [] when it is down, fails or does not answer within ``timeout_s``."""
        b = self.backend
        target, _ = b.lookup_id_to_peer_mapping.pop(lookup_id)
        self._sweep(target)
        if self.is_down(target):
            self.counters["p2p_lookups_skipped_total"] += 1
            return []
        cum = transfer_spec["cum_chunk_lengths"]
        buffers: list[Any] = []
        for i in range(len(keys)):
            full = not b.config.save_unfull_chunk or i < len(keys) - 1
            shapes = b.full_size_shapes if full else b._get_unfull_chunk_shapes(cum[i + 1] - cum[i])
            buf = b.local_cpu_backend.allocate(shapes, b.dtypes, b.fmt)
            if buf is None:  # the CPU tier is full: a miss
                _release(buffers)
                return []
            buffers.append(buf)
        msg = BatchedLookupAndGetMsg(
            lookup_id=lookup_id,
            receiver_id=b.peer_init_url,
            keys=[k.to_string() for k in keys],
            mem_indexes=b.transfer_channel.get_local_mem_indices(buffers),
        )
        answer = await self._ask(target, msg, buffers)
        if isinstance(answer, P2PErrorMsg) and (
            answer.error_code == P2PErrorCode.REMOTE_XFER_HANDLER_NOT_INITIALIZED
        ):
            self._answered(target, new_process=True)  # it does not know us: a new process
            try:
                await b._ensure_peer_connection(target, True)
            except Exception as e:
                logger.warning("P2P peer %s: handshake failed: %s", target, e)
                _release(buffers)
                return []
            answer = await self._ask(target, msg, buffers)
        if answer is None:
            return []  # buffers held: the peer may still write into them
        hits = 0 if isinstance(answer, P2PErrorMsg) else int(answer.num_hit_chunks)
        if isinstance(answer, P2PErrorMsg):
            logger.error("P2P error for lookup_id %s: %s", lookup_id, answer.error_code)
        for buf in buffers[:hits]:
            buf.pin()
        _release(buffers[hits:])
        return buffers[:hits]

    async def _ask(self, target: str, msg: Any, buffers: list[Any]) -> Any:
        """One request to ``target``; its answer, or None after a timeout or a socket error
        (the peer is then down, its REQ socket replaced, ``buffers`` held)."""
        b = self.backend
        peer = b.target_peer_info_mapping[target]
        async with peer.lookup_lock:
            sock = peer.lookup_socket
            try:
                async with asyncio.timeout(self.timeout_s):
                    await sock.send(msgspec.msgpack.encode(msg))
                    raw = await sock.recv()
            except (TimeoutError, zmq.ZMQError) as e:
                why = e if isinstance(e, zmq.ZMQError) else f"no answer in {self.timeout_s:g}s"
                self._failed(target, why)
                self._peer(target).held.append((self.clock(), buffers))
                # a REQ socket waiting for a lost answer is unusable: a new one, same address
                peer.update_lookup_socket(
                    get_zmq_socket_with_timeout(
                        b.async_context, peer.peer_lookup_url, "tcp", zmq.REQ, "connect",
                        b.socket_recv_timeout_ms, b.socket_send_timeout_ms,
                    )
                )  # fmt: skip
                return None
        self._answered(target)
        return msgspec.msgpack.decode(raw, type=P2PMsg)

    @property
    def held_buffers(self) -> int:
        return sum(len(bufs) for p in self.peers.values() for _, bufs in p.held)


def _release(buffers: list[Any]) -> None:
    for buf in buffers:
        try:
            buf.ref_count_down()
        except Exception as e:
            logger.error("releasing a P2P buffer failed: %s", e)


def install(storage: Any, timeout_s: float) -> P2PGuard | None:
    """A :class:`P2PGuard` on ``storage``'s P2P backend, if it has one."""
    if "P2PBackend" not in storage.storage_backends:
        return None
    return P2PGuard(storage, timeout_s)
