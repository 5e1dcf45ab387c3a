"""HTTP API: LMCache's controller endpoints with the same shapes, plus kvpool's own.

Why: the app is only the composition of three routers, each testable alone on a bare app whose
``state.server`` is set: :mod:`~kvpool.controller.routes_lmcache` (LMCache's ``/lookup``,
``/clear``, ``/pin``, ... generated from the orchestration table),
:mod:`~kvpool.controller.routes_kvpool` (``POST /v1/prefix_lookup``, the gateway's query, and
``POST /v1/deregister``, the operator's finalizer) and :mod:`~kvpool.controller.routes_ops`
(``/metrics``, ``/healthz``, ``/readyz``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from kvpool.controller import routes_kvpool, routes_lmcache, routes_ops
from kvpool.controller.server import ControllerServer

#: What a standby replica answers (the rest is the leader's: 503, retry at the Service).
STANDBY_PATHS = frozenset({"/", "/metrics", "/healthz", "/readyz"})


def create_app(server: ControllerServer) -> FastAPI:
    """The HTTP app for one controller; lifecycle (sockets, loops) is owned by the caller."""
    app = FastAPI(title="kvpool controller")
    app.state.server = server

    @app.middleware("http")
    async def standby_guard(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        """A standby replica (``ha.py``) holds no index of its own: lookups and operations get
        503 naming the leader (the controller Service reaches the leader only)."""
        ha = server.ha
        if ha is not None and not ha.leading and request.url.path not in STANDBY_PATHS:
            holder = ha.elector.observed.holder if ha.elector.observed else "none yet"
            return JSONResponse(
                {"detail": f"standby controller replica; the leader is {holder}"},
                status_code=503,
                headers={"Retry-After": "1"},
            )
        return await call_next(request)

    app.include_router(routes_ops.router)
    app.include_router(routes_lmcache.router())
    app.include_router(routes_kvpool.router)
    return app
