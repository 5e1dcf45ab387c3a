"""HTTP API: LMCache's controller endpoints with the same shapes, plus kvpool's own.

Why: the app is only the composition of three routers, each testable alone on a bare app whose
``state.server`` is set: :mod:`~kvpool.controller.routes_lmcache` (LMCache's ``/lookup``,
``/clear``, ``/pin``, ... generated from the orchestration table),
:mod:`~kvpool.controller.routes_kvpool` (``POST /v1/prefix_lookup``, the gateway's query, and
``POST /v1/deregister``, the operator's finalizer) and :mod:`~kvpool.controller.routes_ops`
(``/metrics``, ``/healthz``, ``/readyz``).
"""

from __future__ import annotations

from fastapi import FastAPI

from kvpool.controller import routes_kvpool, routes_lmcache, routes_ops
from kvpool.controller.server import ControllerServer


def create_app(server: ControllerServer) -> FastAPI:
    """The HTTP app for one controller; lifecycle (sockets, loops) is owned by the caller."""
    app = FastAPI(title="kvpool controller")
    app.state.server = server
    app.include_router(routes_ops.router)
    app.include_router(routes_lmcache.router())
    app.include_router(routes_kvpool.router)
    return app
