"""The worker's HTTP app: the runtime state its routes share (readiness, drain, in-flight), the
gate in front of the API while it is not ready, the error handlers, and the routers mounted
(``ops_api``: health, readiness, metrics; ``openai_api``: OpenAI and vLLM's render routes;
``memory_api``: the internal agent memory API; ``pd_api``: the PD routes).

Why this module exists: every route answers errors the same OpenAI way and none answers while
the engine is starting, refused, stalled or draining; the runtime counts what is in flight so
SIGTERM can drain it, and reports readiness only once the engine has started.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from kvpool.protocol.chat import TextTokenizer
from kvpool.protocol.http_api import error_body
from kvpool.protocol.pd import RELEASE_PATH
from kvpool.worker.engine_api import Engine, EngineError
from kvpool.worker.memory_api import SessionStore, build_memory_router
from kvpool.worker.metrics import RuntimeMetrics
from kvpool.worker.openai_api import build_openai_router
from kvpool.worker.openai_models import OpenAIError
from kvpool.worker.openai_render import validation_body
from kvpool.worker.ops_api import build_ops_router
from kvpool.worker.pd_api import build_pd_router

logger = logging.getLogger(__name__)

GUARDED_PREFIXES = ("/v1/", "/tokenize", "/memory/", RELEASE_PATH)


class WorkerRuntime:
    """State shared by the routes, the drain logic and the CLI: engine, readiness, in-flight."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: TextTokenizer,
        *,
        session_capacity: int = 4096,
        pd_info: dict[str, Any] | None = None,
        memory_budget_bytes: int | None = None,
        stall_timeout_s: float = 120.0,
    ):
        self.engine = engine
        self.stall_timeout_s = stall_timeout_s
        self.pd_info = pd_info or {"enabled": False}  # GET /pd/info; PD sender or not
        self.tokenizer = tokenizer
        self.sessions = SessionStore(session_capacity)
        self.metrics = RuntimeMetrics(engine.metrics, memory_budget_bytes)
        self.started = False
        self.draining = False
        self.start_error: str | None = None
        self.inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def refusal(self) -> str | None:
        """The controller's reason for refusing this worker (another domain's fingerprint):
        the engine's own ``controller_refusal`` (the simulated engine's controller client) or
        its KV offload's (the reference engine's LMCache)."""
        reason = getattr(self.engine, "controller_refusal", None)
        if reason is None:
            reason = getattr(getattr(self.engine, "offload", None), "controller_refusal", None)
        return reason if isinstance(reason, str) else None

    @property
    def waiting_for_controller(self) -> str | None:
        """The KV controller's URL while the engine waits for it to answer before LMCache
        registers (:mod:`kvpool.worker.controller_wait`); the worker is starting meanwhile."""
        url = getattr(self.engine, "waiting_for_controller", None)
        return url if isinstance(url, str) else None

    @property
    def frozen(self) -> bool:
        """LMCache's full-sync freeze (after a controller restart): stores are dropped until
        the controller confirms the sync; the engine's own ``lmcache_frozen`` or its offload's."""
        for owner in (self.engine, getattr(self.engine, "offload", None)):
            value = getattr(owner, "lmcache_frozen", None)
            if isinstance(value, bool):
                return value
        return False

    @property
    def stalled(self) -> bool:
        """One engine job (a step, a store, a lookup) has run past ``stall_timeout_s``: the
        engine is stuck, so the worker stops being ready and the gateway routes around it."""
        busy = getattr(self.engine, "busy_s", 0.0)
        return isinstance(busy, float) and busy > self.stall_timeout_s

    @property
    def ready(self) -> bool:
        return (
            self.started
            and not self.draining
            and self.start_error is None
            and self.refusal is None
            and not self.stalled
        )

    @property
    def state(self) -> str:
        """Why not ready: draining, failed, refused, stalled or starting."""
        if self.draining:
            return "draining"
        if self.start_error:
            return "failed"
        if self.refusal is not None:
            return "refused"
        return "stalled" if self.stalled else "starting"

    def _update_ready(self) -> None:
        self.metrics.ready.set(1 if self.ready else 0)

    async def start_engine(self) -> None:
        try:
            await self.engine.start()
        except Exception as exc:
            self.start_error = f"{type(exc).__name__}: {exc}"
            logger.exception("engine %s failed to start", self.engine.model_name)
            raise
        self.started = True
        self._update_ready()
        logger.info("engine %s started; worker ready", self.engine.model_name)

    def begin_drain(self) -> None:
        self.draining = True
        self._update_ready()

    def enter(self) -> None:
        self.inflight += 1
        self._idle.clear()
        self.metrics.inflight.set(self.inflight)

    def leave(self) -> None:
        self.inflight -= 1
        self.metrics.inflight.set(self.inflight)
        if self.inflight == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """True when nothing is in flight, False if ``timeout_s`` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), max(timeout_s, 0.0))
        except TimeoutError:
            return False
        return True


class _GateMiddleware:
    """Counts in-flight API requests (until their last byte) and refuses them while the
    engine is starting or draining (503), so SIGTERM can drain exactly what was admitted."""

    def __init__(self, app: ASGIApp, runtime: WorkerRuntime) -> None:
        self.app = app
        self.runtime = runtime

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith(GUARDED_PREFIXES):
            await self.app(scope, receive, send)
            return
        rt = self.runtime
        if not rt.ready:
            state = rt.state
            msg = {
                "draining": "the worker is shutting down; retry on another instance",
                "failed": f"the engine failed to start: {rt.start_error}",
                "refused": f"the KV controller refused this worker: {rt.refusal}",
                "stalled": "the engine is stuck on one step; retry on another instance",
                "starting": "the engine is still starting; retry when /readyz is 200",
            }[state]
            if state == "starting" and rt.waiting_for_controller is not None:
                msg = f"the engine waits for the KV controller at {rt.waiting_for_controller}"

            body = json.dumps(error_body(msg, code=state, type_="service_unavailable"))
            await send(
                {
                    "type": "http.response.start",
                    "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1")],
                }
            )
            await send({"type": "http.response.body", "body": body.encode()})
            return
        rt.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            rt.leave()


def build_app(runtime: WorkerRuntime, *, start_engine: bool = True) -> FastAPI:
    """The ASGI app. With ``start_engine`` the engine starts in the background at startup
    (``/healthz`` answers at once, ``/readyz`` turns 200 when it is up)."""
    engine = runtime.engine
    tok = runtime.tokenizer

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(runtime.start_engine()) if start_engine else None
        yield
        if task is not None and not task.done():
            task.cancel()

    app = FastAPI(title="kvpool worker", lifespan=lifespan)
    app.add_middleware(_GateMiddleware, runtime=runtime)

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        retry = {"retry-after": "1"} if exc.status == 503 else None  # the same request may pass
        return JSONResponse(exc.body(), status_code=exc.status, headers=retry)

    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, exc: EngineError) -> JSONResponse:
        return JSONResponse(error_body(str(exc)), status_code=400)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(validation_body(exc), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            error_body(f"{request.method} {request.url.path}: {exc.detail}", type_=kind),
            status_code=exc.status_code,
        )

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(
            error_body(f"internal error: {type(exc).__name__}", type_="internal_error"),
            status_code=500,
        )

    app.include_router(build_ops_router(runtime))
    app.include_router(build_openai_router(runtime))
    app.include_router(build_memory_router(engine, tok, runtime.sessions))
    app.include_router(build_pd_router(runtime.pd_info, engine))
    return app
