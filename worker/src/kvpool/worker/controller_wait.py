"""Wait, bounded and logged, for a KV controller that answers before LMCache registers.

Why this module exists: LMCache 0.5.6's worker (``cache_controller/worker.py``,
``start_all``) sends its ``RegisterMsg`` once when its engine starts and waits
``worker_socket_recv_timeout_ms`` for the answer; with none it logs the error and its worker
thread ends: no admits, evicts, heartbeats or controller commands for the rest of the
process's life, and the pool serves that instance 0 % hits. A worker meets that whenever it
starts while no controller answers behind the Service: every workload of a domain rolls at
once after a fingerprint change, and the new controller replicas are still electing their
leader (the Service has no Ready endpoint); or the controller's node is being replaced.

So before LMCache's engine (or vLLM, which builds it) starts, the worker asks the controller's
ROUTER a question without side effects, on LMCache's wire: a ``BatchedP2PLookupMsg`` of no
chunk (kvpool-controller answers it with an empty layout and records nothing). Each attempt
uses a fresh DEALER: a message written into a connection the Service's proxy then drops is
lost, and ZMQ does not send it again. The first decodable answer ends the wait; LMCache
registers right after. Progress is logged every ``log_every_s``; after ``timeout_s``
:class:`ControllerUnreachableError` says what to check, the worker exits 1 and the kubelet starts
it again (``timeout_s`` 0: no wait, LMCache's behaviour alone).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time

import zmq

from kvpool.protocol import lmcache_codec as codec
from kvpool.protocol import lmcache_wire as w

logger = logging.getLogger(__name__)


class ControllerUnreachableError(RuntimeError):
    """No controller answered within the wait; the message names the URL and the setting."""


def _ask(ctx: zmq.Context[zmq.Socket[bytes]], reply_url: str, probe: bytes, wait_s: float) -> bool:
    """One attempt on a fresh DEALER: did a controller answer ``probe`` within ``wait_s``?"""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{reply_url}")
        sock.send_multipart([b"", probe])
        if not sock.poll(int(wait_s * 1000), zmq.POLLIN):
            return False
        codec.decode(sock.recv_multipart()[-1])
        return True
    except codec.ProtocolError as exc:
        logger.warning("%s answered something that is not LMCache's wire: %s", reply_url, exc)
        return False
    finally:
        sock.close()


def wait_for_controller(
    reply_url: str,
    instance_id: str,
    *,
    timeout_s: float,
    attempt_s: float = 1.0,
    log_every_s: float = 10.0,
    stop: threading.Event | None = None,
) -> float:
    """Seconds waited until the controller at ``reply_url`` (host:port of its ROUTER)
    answered; raises :class:`ControllerUnreachableError` after ``timeout_s`` (0 or less:
    returns 0 at once)."""
    if timeout_s <= 0:
        return 0.0
    probe = codec.encode(w.BatchedP2PLookupMsg(hashes=[], instance_id=instance_id, worker_id=0))
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    start = time.monotonic()
    next_log = start + log_every_s
    attempts = 0
    while stop is None or not stop.is_set():
        attempts += 1
        try:
            answered = _ask(ctx, reply_url, probe, attempt_s)
        except zmq.ZMQError as exc:  # e.g. the Service's name does not resolve yet
            logger.debug("controller %s: %s", reply_url, exc)
            time.sleep(attempt_s)
            answered = False
        now = time.monotonic()
        if answered:
            if attempts > 1:
                logger.info(
                    "the KV controller at %s answered after %.1f s (%d attempts); LMCache "
                    "registers %s now",
                    reply_url,
                    now - start,
                    attempts,
                    instance_id,
                )
            return now - start
        if now - start >= timeout_s:
            raise ControllerUnreachableError(
                f"the KV controller at {reply_url} did not answer in {timeout_s:.0f} s "
                f"({attempts} attempts), so LMCache's engine was not started (it registers "
                "once and goes mute without an answer): check that the pool's controller is "
                "Ready and its Service selects it; the worker exits and is restarted. A "
                "controller slower to start: raise --controller-wait "
                "(KVPOOL_WORKER_CONTROLLER_WAIT_S)"
            )
        if now >= next_log:
            next_log = now + log_every_s
            logger.warning(
                "waiting for the KV controller at %s to answer before LMCache registers %s "
                "(%.0f of %.0f s, %d attempts); this worker is not ready meanwhile",
                reply_url,
                instance_id,
                now - start,
                timeout_s,
                attempts,
            )
    return time.monotonic() - start


async def await_controller(
    reply_url: str, instance_id: str, *, timeout_s: float, **kw: float
) -> float:
    """:func:`wait_for_controller` on a daemon thread, for an event loop; cancelling the
    awaiting task stops the thread at its next attempt."""
    if timeout_s <= 0:
        return 0.0
    loop = asyncio.get_running_loop()
    done: asyncio.Future[float] = loop.create_future()
    stop = threading.Event()

    def settle(result: float | None, exc: BaseException | None) -> None:
        if done.done():
            return
        if exc is not None:
            done.set_exception(exc)
        else:
            done.set_result(result or 0.0)

    def run() -> None:
        try:
            waited = wait_for_controller(
                reply_url, instance_id, timeout_s=timeout_s, stop=stop, **kw
            )
        except Exception as exc:
            outcome: tuple[float | None, BaseException | None] = (None, exc)
        else:
            outcome = (waited, None)
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=run, name=f"kvpool-controller-wait-{instance_id}", daemon=True).start()
    try:
        return await done
    finally:
        stop.set()
