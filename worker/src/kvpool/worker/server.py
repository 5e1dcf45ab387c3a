"""The worker's HTTP API: OpenAI completions and chat (streaming and not), models, tokenize,
vLLM's render endpoints, health, readiness, Prometheus metrics, and the internal agent memory
API.

Why this module exists: the gateway, benchmarks, e2e tests and people with ``curl`` all talk
to a worker the way they talk to vLLM. This module is the glue between HTTP and an
``engine_api.Engine``: it validates at the boundary (OpenAI-shaped 400s, never a traceback),
tokenizes, renders text, counts what is in flight so SIGTERM can drain it, and reports
readiness only once the engine has started and while it is not draining.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from kvpool.protocol.chat import ChatMessage, TextTokenizer
from kvpool.protocol.http_api import SESSION as SESSION_HEADER
from kvpool.protocol.http_api import error_body, session_of
from kvpool.protocol.pd import RELEASE_PATH
from kvpool.worker.engine_api import (
    Engine,
    EngineError,
    GenerationRequest,
    SamplingParams,
)
from kvpool.worker.generation import Delta, Outcome, generate_text
from kvpool.worker.memory_api import SessionStore, build_memory_router
from kvpool.worker.metrics import RuntimeMetrics
from kvpool.worker.openai_models import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    TokenizeRequest,
    new_id,
    now,
    usage,
)
from kvpool.worker.openai_render import (
    Prepared,
    chat_chunk,
    completion_chunk,
    sse,
    validation_body,
)
from kvpool.worker.pd_api import (
    answer_params,
    build_pd_router,
    check_transfer,
    parse_kv_transfer,
)
from kvpool.worker.render_api import build_render_router

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
    served = engine.model_name

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

    @app.get("/health")  # vLLM and SGLang servers serve /health; sglang-router requires it
    @app.get("/healthz")
    async def healthz() -> JSONResponse:
        if runtime.start_error:
            return JSONResponse({"status": "failed", "error": runtime.start_error}, 500)
        return JSONResponse({"status": "ok"})

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        runtime.metrics.ready.set(1 if runtime.ready else 0)
        if runtime.ready:
            # frozen: ready, but what is prefilled now is not stored (the gateway prefers others)
            return JSONResponse({"status": "ready", "model": served, "frozen": runtime.frozen})
        body = {"status": runtime.state}
        if runtime.refusal is not None:
            body["reason"] = runtime.refusal
        return JSONResponse(body, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(runtime.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": served,
            "object": "model",
            "created": now(),
            "owned_by": "kvpool",
            "max_model_len": engine.max_model_len,
        }
        return {"object": "list", "data": [card]}

    def check_model(model: str | None) -> str:
        if model is not None and model != served:
            raise OpenAIError(
                f"the model {model!r} does not exist on this worker; it serves {served!r}",
                param="model",
                code="model_not_found",
            )
        return served

    def chat_prompt(messages: list[Any], add_generation_prompt: bool) -> list[int]:
        try:
            msgs = [ChatMessage(m.role, m.text()) for m in messages]
            return tok.chat_token_ids(msgs, add_generation_prompt=add_generation_prompt)
        except ValueError as exc:
            raise OpenAIError(str(exc), param="messages") from exc

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        if body.messages is not None:
            ids = chat_prompt(body.messages, body.add_generation_prompt)
        else:
            ids = tok.encode(body.prompt or "")
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    def prepare(
        endpoint: str,
        body: CompletionRequest | ChatCompletionRequest,
        prompt_ids: list[int],
        max_tokens: int | None,
        stop_ids: tuple[int, ...],
        session: str | None,
        prefix: str,
    ) -> Prepared:
        model = check_model(body.model)
        limit = engine.max_model_len
        param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
        if not prompt_ids:
            raise OpenAIError("the prompt is empty; send at least one token", param=param)
        if len(prompt_ids) >= limit:
            raise OpenAIError(
                f"this model's maximum context length is {limit} tokens, but the prompt has "
                f"{len(prompt_ids)} tokens; shorten it",
                param=param,
                code="context_length_exceeded",
            )
        room = limit - len(prompt_ids)
        if max_tokens is None:
            max_tokens = room
        elif max_tokens > room:
            raise OpenAIError(
                f"this model's maximum context length is {limit} tokens, but you requested "
                f"{len(prompt_ids) + max_tokens} ({len(prompt_ids)} in the prompt, {max_tokens} "
                f"to generate); lower max_tokens to at most {room}",
                param="max_tokens",
                code="context_length_exceeded",
            )
        extra_ids = tuple(body.stop_token_ids or ())
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
            stop_token_ids=tuple(dict.fromkeys(stop_ids + extra_ids)),
            ignore_eos=body.ignore_eos,
        )
        if session is not None:
            runtime.sessions.remember(session, prompt_ids)
        return Prepared(new_id(prefix), endpoint, prompt_ids, sampling, body.stop_strings(), model)

    async def run(
        prep: Prepared, stream: bool, include_usage: bool, chunk: Callable[..., dict[str, Any]]
    ) -> Response:
        outcome = Outcome(prompt_tokens=len(prep.prompt_ids))
        deltas = generate_text(
            engine,
            tok,
            GenerationRequest(prep.request_id, prep.prompt_ids, prep.sampling, prep.kv_transfer),
            prep.stop,
            outcome,
            on_first_token=runtime.metrics.ttft.labels(prep.endpoint).observe,
            on_token=runtime.metrics.token,
        )
        created = now()
        try:
            first = await anext(deltas)  # an EngineError surfaces here, before any byte
        except BaseException:
            await deltas.aclose()
            raise

        def done() -> None:
            runtime.metrics.observe(
                prep.endpoint,
                prompt_tokens=outcome.prompt_tokens,
                cached_tokens=outcome.cached_tokens,
                finish_reason=outcome.finish_reason,
            )

        def use() -> dict[str, Any]:
            return usage(outcome.prompt_tokens, outcome.completion_tokens, outcome.cached_tokens)

        if not stream:
            parts = [first]
            try:
                parts += [d async for d in deltas]
            finally:
                await deltas.aclose()  # a cancelled request (client gone) aborts in the engine
                done()
            text = "".join(d.text for d in parts)
            body = chunk(prep, created, text, outcome.finish_reason, final=True)
            body["usage"] = use()
            if prep.return_token_ids:
                body["choices"][0]["prompt_token_ids"] = prep.prompt_ids
                body["choices"][0]["token_ids"] = outcome.token_ids
            if prep.kv_transfer is not None:  # PD prefill: the proxy sends first_tok on
                await check_transfer(engine, prep.kv_transfer)
                n = outcome.prompt_tokens
                body["kv_transfer_params"] = answer_params(prep.kv_transfer, outcome.first_token, n)
            return JSONResponse(body)

        async def events() -> AsyncIterator[bytes]:
            try:
                if chunk is chat_chunk:  # chat streams open with the assistant role
                    yield sse(chunk(prep, created, None, None, opening=True))
                delta: Delta | None = first
                while delta is not None:
                    if delta.text or delta.finish_reason:
                        yield sse(chunk(prep, created, delta.text, delta.finish_reason))
                    try:
                        delta = await anext(deltas, None)
                    except Exception as exc:  # headers are sent: report in the stream
                        logger.exception("request %s failed mid-stream", prep.request_id)
                        msg = f"generation failed: {exc}"
                        yield sse(error_body(msg, type_="internal_error"))
                        break
                if include_usage:
                    tail = chunk(prep, created, None, None)
                    yield sse({**tail, "choices": [], "usage": use()})
                yield sse("[DONE]")
            finally:
                await deltas.aclose()
                done()

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        ids = completion_prompt_ids(tok, body.prompt)
        kv_transfer = parse_kv_transfer(body.kv_transfer_params, runtime.pd_info)
        session = session_of(request.headers.get(SESSION_HEADER), body.user)
        prep = prepare("completions", body, ids, body.max_tokens, (), session, "cmpl")
        prep.kv_transfer = kv_transfer
        prep.return_token_ids = body.return_token_ids
        return await run(prep, body.stream, body.include_usage(), completion_chunk)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        ids = chat_prompt(body.messages, body.add_generation_prompt)
        session = session_of(request.headers.get(SESSION_HEADER), body.user)
        prep = prepare(
            "chat",
            body,
            ids,
            body.requested_max_tokens(),
            tok.chat_stop_token_ids(),
            session,
            "chatcmpl",
        )
        return await run(prep, body.stream, body.include_usage(), chat_chunk)

    def render_completion(body: CompletionRequest) -> list[int]:
        check_model(body.model)
        return completion_prompt_ids(tok, body.prompt)

    def render_chat(body: ChatCompletionRequest) -> list[int]:
        check_model(body.model)
        return chat_prompt(body.messages, body.add_generation_prompt)

    app.include_router(build_render_router(engine, render_completion, render_chat))
    app.include_router(build_memory_router(engine, tok, runtime.sessions))
    app.include_router(build_pd_router(runtime.pd_info, engine))
    return app


def completion_prompt_ids(
    tok: TextTokenizer, prompt: str | list[int] | list[str] | list[list[int]]
) -> list[int]:
    """One prompt: text, token ids, or a batch of exactly one of either."""
    if isinstance(prompt, str):
        return tok.encode(prompt)
    if prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise OpenAIError(
                "send one prompt per request (batches are not supported)", param="prompt"
            )
        return completion_prompt_ids(tok, prompt[0])
    return [int(t) for t in prompt]  # type: ignore[arg-type]
