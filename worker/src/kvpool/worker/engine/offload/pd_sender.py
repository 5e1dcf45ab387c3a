"""The send side of PD: every transfer to a decoder ends, and a restarted decoder is found again.

Why this module exists: LMCache 0.5.6's PD sender (``PDBackendAsync``, role ``sender``) waits
without a bound at three places, and the chaos suite hung the PD pair at each when its decoder
was killed: the NIXL handshake (the engine step blocks on it), the decoder's answer to an
allocation request (awaited under a per-decoder lock, so every later transfer queued behind
it while the staging buffer filled and the sender's allocation, whose timeout is infinite by
default, blocked the engine step for good), and the sender's staging allocation itself. It
also keeps a decoder's connection for ever: after a restart every write went to the dead
process's NIXL agent (``NIXL_ERR_REMOTE_DISCONNECT``), no transfer completed again, and the
proxy learnt nothing, so every PD request waited its full transfer timeout.

:class:`SenderGuard` wraps that backend's instance (LMCache's files are untouched):

- the handshake is bounded (:mod:`.nixl_peers`), and so is the allocation answer
  (``send_timeout_s``) and the staging allocation;
- a decoder whose connection failed (a timeout, a ZMQ error, a failed write, or its alloc
  socket's TCP connection dropping, seen by a ZMQ socket monitor) is *stale*: its socket is
  closed at once (so transfers queued behind it fail now, not after the timeout) and the
  next transfer to it handshakes again, with the new process's NIXL metadata;
- each request's outcome is recorded (the proxy notified, or the request aborted), so the
  prefill worker answers only once its KV landed, and a retryable 503 when it did not
  (:meth:`result`), instead of leaving the proxy to wait for a notification that never comes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Coroutine, Iterator
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
from lmcache.v1.storage_backend.pd_backend_async import PDMsg
from zmq.utils.monitor import parse_monitor_message

from kvpool.worker.engine.offload import nixl_peers

logger = logging.getLogger(__name__)

#: Seconds a decoder has to answer an allocation request. A decoder answers at once unless its
#: buffer is over-subscribed (then it waits for space, at most the unclaimed-transfer TTL);
#: longer than this it is dead, frozen or cut off, and the request gets a retryable error. A
#: killed decoder is seen at once (its socket drops); this bound is for a frozen or cut-off
#: one, and a full buffer must not trip it: 15 s (at 5 s, pushes waiting for space in a full
#: buffer were aborted, the decoder marked stale, and the pair refused PD requests after the
#: buffer emptied). It should be the rendered unclaimed-transfer TTL; the sender is not given it.
SEND_TIMEOUT_S = 15.0
#: Seconds a prefill answer waits for its transfer's outcome: the allocation answer, then the
#: write (milliseconds between live processes) and the proxy's notification.
RESULT_TIMEOUT_S = 2 * SEND_TIMEOUT_S
RETRY_CONNECT_S = 1.0  # after a failed handshake, transfers to that decoder fail at once
OUTCOMES_KEPT = 4096  # request outcomes remembered (the worker asks once per request)


class PDSendError(RuntimeError):
    """A transfer to a decoder failed or could not start; the request may be retried."""


@dataclass
class _Outcome:
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    submitted: int = 0  # chunks handed to LMCache's sender


class SenderGuard:
    """Bounded, reconnecting transfers of one PD sender backend (see the module docstring)."""

    def __init__(
        self,
        backend: Any,
        send_timeout_s: float = SEND_TIMEOUT_S,
        handshake_timeout_s: float = nixl_peers.HANDSHAKE_TIMEOUT_S,
    ) -> None:
        self.backend = backend
        self.loop: asyncio.AbstractEventLoop = backend._sender_loop
        self.send_timeout_s = send_timeout_s
        self.shakes = nixl_peers.install(backend.transfer_channel, handshake_timeout_s)
        self._stale: set[str] = set()
        self._retry_at: dict[str, float] = {}  # a failed handshake is not retried before
        self._monitors: dict[str, asyncio.Task[None]] = {}
        self._outcomes: OrderedDict[str, _Outcome] = OrderedDict()
        self._lock = threading.Lock()
        self.counters = {"pd_send_failures_total": 0.0, "pd_reconnects_total": 0.0}
        # the staging buffer frees as transfers end, and every transfer now ends in bounded time
        backend._allocation_timeout = min(float(backend._allocation_timeout), send_timeout_s)
        self._write = backend.transfer_channel.async_batched_write
        self._notify = backend._send_proxy_notif
        self._abort = backend._abort_request
        self._submit = backend.batched_submit_put_task
        backend._ensure_peer_connection = self._ensure_peer_connection
        backend._async_remote_allocate = self._remote_allocate
        backend.transfer_channel.async_batched_write = self._guarded_write
        backend._send_proxy_notif = self._notified
        backend._abort_request = self._aborted
        backend.batched_submit_put_task = self._submitted

    # --- outcomes ----------------------------------------------------------------------------
    def begin(self, req_id: str) -> None:
        """A store for ``req_id`` starts: its outcome is now awaited."""
        with self._lock:
            self._outcomes[req_id] = _Outcome()
            while len(self._outcomes) > OUTCOMES_KEPT:
                self._outcomes.popitem(last=False)

    def _settle(self, req_id: str, error: str | None) -> None:
        with self._lock:
            outcome = self._outcomes.get(req_id)
        if outcome is None or outcome.done.is_set():
            return
        outcome.error = error
        outcome.done.set()
        if error is not None:
            self.counters["pd_send_failures_total"] += 1
            logger.warning("PD transfer %s failed: %s", req_id, error)

    def fail(self, req_id: str, why: str) -> None:
        """The transfer of ``req_id`` will not complete: tell the decoder to drop what it got
        (LMCache's abort sends it the keys sent so far) and record why."""
        self._settle(req_id, why)
        self.backend.cancel_request(req_id)

    def submitted(self, req_id: str, total_chunks: int) -> None:
        """Every store of ``req_id`` returned; fewer chunks than the prompt's (LMCache stores a
        prefix when its allocation fails) can never complete: fail it now."""
        with self._lock:
            outcome = self._outcomes.get(req_id)
        if outcome is not None and outcome.submitted < total_chunks and not outcome.done.is_set():
            self.fail(req_id, f"{outcome.submitted} of {total_chunks} chunks could be staged")

    async def result(self, req_id: str, timeout_s: float) -> str | None:
        """None once the decoder has the KV of ``req_id`` (or it was never tracked), else why
        not: the failure, or that no outcome came within ``timeout_s``."""
        with self._lock:
            outcome = self._outcomes.get(req_id)
        if outcome is None:
            return None
        deadline = time.monotonic() + timeout_s
        while not outcome.done.is_set():
            if time.monotonic() >= deadline:
                return f"the decoder confirmed no transfer within {timeout_s:g}s"
            await asyncio.sleep(0.005)
        with self._lock:
            self._outcomes.pop(req_id, None)
        return outcome.error

    # --- LMCache's sender, wrapped -------------------------------------------------------------
    def _submitted(
        self,
        keys: Any,
        memory_objs: Any,
        transfer_spec: Any = None,
        on_complete_callback: Any = None,
    ) -> None:
        """LMCache's submit of one group; a failure is recorded, never raised: LMCache's
        storage manager drops its staging references only after a submit that returns."""
        req_id = str(getattr(transfer_spec, "req_id", "") or "")
        with self._lock:
            outcome = self._outcomes.get(req_id)
        if outcome is not None and outcome.done.is_set():
            return  # the request failed already: stage nothing more for it
        try:
            self._submit(keys, memory_objs, transfer_spec, on_complete_callback)
        except Exception as e:  # LMCache rolled back its own references
            self._settle(req_id, f"{type(e).__name__}: {e}")
            return
        if outcome is not None:
            outcome.submitted += len(keys)

    async def _notified(self, transfer_spec: Any) -> None:
        await self._notify(transfer_spec)
        self._settle(str(getattr(transfer_spec, "req_id", "") or ""), None)

    async def _aborted(self, req_id: str) -> None:
        self._settle(req_id, "the transfer was aborted (see the sender's log)")
        await self._abort(req_id)

    def _on_loop(self, coro: Coroutine[Any, Any, Any], timeout_s: float) -> Any:
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout_s)
        except FutureTimeout:
            fut.cancel()
            raise

    def _ensure_peer_connection(
        self,
        receiver_id: str,
        receiver_host: str,
        receiver_init_port: int,
        receiver_alloc_port: int,
    ) -> None:
        """LMCache's connect, bounded, and again when the decoder's connection went stale."""
        b = self.backend
        if receiver_id in b.initialized_peers and receiver_id not in self._stale:
            return
        with b._peer_connection_lock:
            if receiver_id in b.initialized_peers and receiver_id not in self._stale:
                return
            wait = self._retry_at.get(receiver_id, 0.0) - time.monotonic()
            if wait > 0:  # it just failed: fail fast rather than stall another engine step
                raise PDSendError(f"decoder {receiver_id} unreachable (next try in {wait:.1f}s)")
            again = receiver_id in self._stale
            b.initialized_peers.discard(receiver_id)
            init_url = f"{receiver_host}:{receiver_init_port}"
            alloc_url = f"{receiver_host}:{receiver_alloc_port}"
            bound = 3 * self.shakes.timeout_s + 1.0
            try:
                self._on_loop(self._connect(receiver_id, init_url, alloc_url), bound)
            except (nixl_peers.HandshakeError, FutureTimeout, zmq.ZMQError) as e:
                self._retry_at[receiver_id] = time.monotonic() + RETRY_CONNECT_S
                raise PDSendError(f"decoder {init_url} unreachable: {e or type(e).__name__}") from e
            self._stale.discard(receiver_id)
            b.initialized_peers.add(receiver_id)
            if again:
                self.counters["pd_reconnects_total"] += 1
                logger.info("PD sender reconnected to decoder %s (new NIXL handshake)", init_url)

    async def _connect(self, receiver_id: str, init_url: str, alloc_url: str) -> None:
        b = self.backend
        self._close_socket(receiver_id)
        await b.transfer_channel.async_lazy_init_peer_connection(
            local_id=b.local_id, peer_id=receiver_id, peer_init_url=init_url
        )
        await b._async_create_alloc_socket(receiver_id, alloc_url)
        sock = b._async_alloc_sockets[receiver_id]
        sock.setsockopt(zmq.LINGER, 0)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._monitors[receiver_id] = asyncio.create_task(self._watch(receiver_id, sock, monitor))

    async def _watch(self, receiver_id: str, sock: Any, monitor: Any) -> None:
        """Mark the decoder stale when its alloc socket's TCP connection drops (it died)."""
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    if self.backend._async_alloc_sockets.get(receiver_id) is sock:
                        self._mark_stale(receiver_id, "its connection dropped")
                    return
        except (asyncio.CancelledError, zmq.ZMQError):
            return
        finally:
            monitor.close(linger=0)

    def _close_socket(self, receiver_id: str) -> None:
        """On the sender loop: close the decoder's alloc socket (a waiting recv fails now)."""
        task = self._monitors.pop(receiver_id, None)
        if task is not None:
            task.cancel()
        sock = self.backend._async_alloc_sockets.pop(receiver_id, None)
        if sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            sock.close(linger=0)

    def _mark_stale(self, receiver_id: str, why: object) -> None:
        """On the sender loop: the decoder's connection failed; reconnect before the next use."""
        if receiver_id not in self._stale:
            logger.warning("PD decoder %s connection is stale (%s): reconnecting", receiver_id, why)
        self._stale.add(receiver_id)
        self._close_socket(receiver_id)

    async def _remote_allocate(self, receiver_id: str, msg: Any) -> Any:
        """LMCache's allocation (or cancel) request, bounded; PDSendError when it fails."""
        b = self.backend
        lock = b._async_alloc_locks.setdefault(receiver_id, asyncio.Lock())
        try:
            async with asyncio.timeout(self.send_timeout_s), lock:
                sock = b._async_alloc_sockets.get(receiver_id)
                if sock is None or receiver_id in self._stale:
                    raise PDSendError(f"the connection to decoder {receiver_id} was reset")
                await sock.send_multipart([b"", msgspec.msgpack.encode(msg)])
                frames = await sock.recv_multipart()
        except TimeoutError:
            self._mark_stale(receiver_id, f"no answer within {self.send_timeout_s:g}s")
            raise PDSendError(
                f"decoder {receiver_id} did not answer within {self.send_timeout_s:g}s"
            ) from None
        except zmq.ZMQError as e:
            self._mark_stale(receiver_id, e)
            raise PDSendError(f"decoder {receiver_id}: {e}") from e
        return msgspec.msgpack.decode(frames[-1], type=PDMsg)

    async def _guarded_write(self, objects: Any, transfer_spec: Any = None) -> int:
        try:
            return int(await self._write(objects=objects, transfer_spec=transfer_spec))
        except Exception as e:
            self._mark_stale(str((transfer_spec or {}).get("receiver_id", "")), e)
            raise

    def close(self, timeout_s: float = 1.0) -> None:
        """Close the alloc sockets and their monitors (before LMCache terms its context)."""

        async def _close() -> None:
            tasks = list(self._monitors.values())
            for receiver_id in list(self.backend._async_alloc_sockets):
                self._close_socket(receiver_id)
            await asyncio.gather(*tasks, return_exceptions=True)

        if not self.loop.is_running():
            return
        try:
            self._on_loop(_close(), timeout_s)
        except Exception as e:
            logger.warning("closing the PD sender's decoder sockets failed: %s", e)


@contextlib.contextmanager
def tracking(guard: SenderGuard | None, params: Any, total_chunks: int) -> Iterator[None]:
    """Around the stores of one prompt: with a guard and PD transfer ``params``, its outcome
    is awaited from now on, a store that raised fails it, a partial one too."""
    if guard is None or params is None:
        yield
        return
    guard.begin(params.req_id)
    try:
        yield
    except Exception as e:
        guard.fail(params.req_id, f"{type(e).__name__}: {e}")
        raise
    guard.submitted(params.req_id, total_chunks)


def install(storage: Any, send_timeout_s: float = SEND_TIMEOUT_S) -> SenderGuard | None:
    """A :class:`SenderGuard` on ``storage``'s PD backend when it is an asynchronous sender
    (LMCache's default ``pd_backend_mode``), else None."""
    backend = storage.storage_backends.get("PDBackend")
    if backend is None or getattr(backend, "_sender_loop", None) is None:
        return None
    return SenderGuard(backend, send_timeout_s)
