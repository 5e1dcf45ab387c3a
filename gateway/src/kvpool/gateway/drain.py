"""Drain on SIGTERM: stop being ready, refuse new requests with a retryable 503, let what is
in flight finish (bounded), then exit.

Why this module exists: the gateway runs as several replicas behind one Service, and a
replica is stopped on every rollout, node drain or scale-down. uvicorn's own SIGTERM handling
closes the listening socket at once and waits for open connections, so its readiness probe
never fails first and a request that reaches it a moment later is refused at the TCP level.
Here SIGTERM starts a drain instead (:class:`DrainingServer`):

1. ``/readyz`` answers 503 ``draining`` (Kubernetes, and ``kvpool-operator up``'s Service,
   stop sending new connections here);
2. every new request (not the probes or ``/metrics``) gets 503 with ``Retry-After`` and
   ``Connection: close`` in OpenAI's shape (:class:`DrainGuard`): a client that retries goes
   to another replica on a new connection;
3. requests and streams already in flight run to their end;
4. once none is in flight and at least ``limits.drainMinSeconds`` passed, or after
   ``limits.drainTimeoutSeconds`` at most, uvicorn's own shutdown runs (it closes the port,
   waits briefly for what is left, then the app's lifespan stops the background loops).

A second SIGTERM, or SIGINT, stops at once as uvicorn does. With ``--workers N`` the parent
forwards the signal and each process drains on its own.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from kvpool.gateway.errors import upstream_error

logger = logging.getLogger(__name__)

#: Paths a draining gateway still answers as usual: the kubelet's probes and the scrape.
OPS_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})


@dataclass
class Drain:
    """Whether this process drains, since when, and how many requests are in flight."""

    timeout_s: float
    min_s: float
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    started_at: float | None = None
    inflight: int = 0

    @property
    def draining(self) -> bool:
        return self.started_at is not None

    def begin(self) -> bool:
        """Start draining; False when it already was."""
        if self.started_at is not None:
            return False
        self.started_at = self.clock()
        return True

    def finished(self) -> bool:
        """Draining, and nothing left to wait for (or waited long enough)."""
        if self.started_at is None:
            return False
        waited = self.clock() - self.started_at
        return waited >= self.timeout_s or (self.inflight == 0 and waited >= self.min_s)


class DrainGuard:
    """ASGI layer counting the requests in flight and refusing new ones while draining.
    ``on_refused(path)`` counts each refusal."""

    def __init__(self, app: ASGIApp, drain: Drain, on_refused: Callable[[str], None]) -> None:
        self.app = app
        self.drain = drain
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPS_PATHS:
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            self.on_refused(scope["path"])
            refusal = upstream_error(
                503,
                "this gateway replica is shutting down; send the request again (another "
                "replica answers it)",
                "draining",
            )
            refusal.headers["Connection"] = "close"  # the retry comes on a new connection
            await refusal.response()(scope, receive, send)
            return
        self.drain.inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.inflight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn's server, with SIGTERM starting :class:`Drain` instead of stopping at once."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self.should_exit and self.drain.begin():
            logger.info(
                "SIGTERM: draining (not ready, new requests 503); %d in flight, waiting up to "
                "%.0fs",
                self.drain.inflight,
                self.drain.timeout_s,
            )
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if not self.should_exit and self.drain.finished():
            logger.info(
                "drained: %d request(s) still in flight after %.1fs; stopping",
                self.drain.inflight,
                self.drain.clock() - (self.drain.started_at or 0.0),
            )
            self.should_exit = True
        return await super().on_tick(counter)
