"""The gateway's ASGI app: its routers, error handlers and lifespan around one state.

Why this module exists: ``build_app`` is the one place that assembles the app from the
router modules (``api_openai``, ``api_memory``, ``api_ops``) and the completion routes' ASGI
layer (``api_openai.CompletionRoutes``); the CLI and the tests build it the same way from a
:class:`GatewayState`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from kvpool.gateway import api_admin, api_explain, api_memory, api_openai, api_ops
from kvpool.gateway.drain import DrainGuard
from kvpool.gateway.errors import ENDPOINTS, install_handlers
from kvpool.gateway.state import GatewayState


def build_app(state: GatewayState) -> FastAPI:
    """The app for ``state``; its background loops run for the app's lifespan."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(title="kvpool gateway", lifespan=lifespan)
    app.state.gateway = state

    def count(endpoint: str, status: int) -> None:
        state.metrics.requests.labels(endpoint, str(status)).inc()

    install_handlers(app, count)
    # the completion routes, answered before the app's own routing (see api_openai)
    app.add_middleware(api_openai.CompletionRoutes, state=state, on_error=count)

    def refused(path: str) -> None:
        state.metrics.rejections.labels("draining").inc()
        count(ENDPOINTS.get(path, path), 503)

    # outermost: while draining (SIGTERM), nothing new reaches the routes (see drain)
    app.add_middleware(DrainGuard, drain=state.drain, on_refused=refused)
    app.include_router(api_ops.router)
    app.include_router(api_openai.router)
    app.include_router(api_memory.router)
    app.include_router(api_explain.router)
    app.include_router(api_admin.router)
    return app
