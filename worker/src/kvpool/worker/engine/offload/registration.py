"""Did the controller accept this worker? LMCache's worker client never says.

Why this module exists: kvpool-controller refuses a worker of another cache domain (its
instance id carries another fingerprint) by answering LMCache's ``RegisterMsg`` with
``ErrorMsg("registration refused: <reason>")``. LMCache 0.5.6's client only logs
``Unexpected register response type`` and carries on: the pod stays Ready and serves 0 % hits.
This module asks again, on the wire LMCache speaks: the same ``RegisterMsg`` (a re-register
is idempotent), built with LMCache's own message classes, over a DEALER to
``controller_reply_url``, and returns the controller's reason when it refuses.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import msgspec
import zmq
from lmcache.v1.cache_controller.message import ErrorMsg, Msg, RegisterMsg, RegisterRetMsg

logger = logging.getLogger(__name__)

REFUSED_PREFIX = "registration refused: "


def ask_registration(engine: Any, reply_url: str, timeout_s: float = 5.0) -> str | None:
    """The controller's refusal reason, or None when it accepts this worker (or is silent)."""
    worker = getattr(engine, "lmcache_worker", None)
    if worker is None:
        return None
    msg = RegisterMsg(
        instance_id=worker.lmcache_instance_id,
        worker_id=worker.worker_id,
        ip=worker.lmcache_worker_ip,
        port=worker.lmcache_worker_port,
        peer_init_url=worker.p2p_init_url,
    )
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    try:
        sock.connect(f"tcp://{reply_url}")
        sock.send_multipart([b"", msgspec.msgpack.encode(msg)])
        reply = msgspec.msgpack.decode(sock.recv_multipart()[-1], type=Msg)
    except (zmq.ZMQError, msgspec.DecodeError) as exc:
        logger.warning("could not confirm registration with %s: %s", reply_url, exc)
        return None
    finally:
        sock.close()
    if isinstance(reply, ErrorMsg):
        reason = str(reply.error)
        return reason[len(REFUSED_PREFIX) :] if reason.startswith(REFUSED_PREFIX) else reason
    if not isinstance(reply, RegisterRetMsg):
        logger.warning("unexpected answer to RegisterMsg: %s", type(reply).__name__)
    return None


class RegistrationCheck:
    """Runs :func:`ask_registration` once on a daemon thread; ``refusal`` holds the verdict."""

    def __init__(self, engine: Any, reply_url: str, instance_id: str) -> None:
        self.refusal: str | None = None
        self.done = threading.Event()
        self._engine, self._url, self._instance = engine, reply_url, instance_id
        threading.Thread(target=self._run, name="kvpool-registration", daemon=True).start()

    def _run(self) -> None:
        try:
            reason = ask_registration(self._engine, self._url)
            if reason is not None:
                self.refusal = reason
                logger.error(
                    "the controller at %s refused instance %s: %s — this worker is not ready "
                    "(its chunks would never be found by the pool)",
                    self._url,
                    self._instance,
                    reason,
                )
        except Exception:
            logger.exception("registration check of %s failed", self._instance)
        finally:
            self.done.set()
