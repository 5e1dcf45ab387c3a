"""The worker's OpenAI API: models, tokenize, completions and chat (streamed or not), and the
prompts vLLM's render endpoints need.

Why this module exists: the gateway, benchmarks, e2e tests and people with ``curl`` talk to a
worker the way they talk to vLLM. This is the glue between HTTP and an ``engine_api.Engine``:
it validates at the boundary (OpenAI-shaped 400s, never a traceback), tokenizes, renders text,
and answers a PD prefill only once its transfer landed (``pd_api.check_transfer``).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvpool.protocol.chat import ChatMessage, TextTokenizer
from kvpool.protocol.http_api import SESSION as SESSION_HEADER
from kvpool.protocol.http_api import error_body, session_of
from kvpool.worker.engine_api import GenerationRequest, SamplingParams
from kvpool.worker.generation import Delta, Outcome, generate_text
from kvpool.worker.openai_models import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    TokenizeRequest,
    new_id,
    now,
    usage,
)
from kvpool.worker.openai_render import Prepared, chat_chunk, completion_chunk, sse
from kvpool.worker.pd_api import answer_params, check_transfer, parse_kv_transfer
from kvpool.worker.render_api import build_render_router

if TYPE_CHECKING:
    from kvpool.worker.server import WorkerRuntime

logger = logging.getLogger(__name__)


class OpenAIServing:
    """What the OpenAI routes share: the runtime, its engine and tokenizer, the model served."""

    def __init__(self, runtime: WorkerRuntime) -> None:
        self.runtime = runtime
        self.engine = runtime.engine
        self.tok = runtime.tokenizer
        self.served = runtime.engine.model_name

    def check_model(self, model: str | None) -> str:
        if model is not None and model != self.served:
            raise OpenAIError(
                f"the model {model!r} does not exist on this worker; it serves {self.served!r}",
                param="model",
                code="model_not_found",
            )
        return self.served

    def chat_prompt(self, messages: list[Any], add_generation_prompt: bool) -> list[int]:
        try:
            msgs = [ChatMessage(m.role, m.text()) for m in messages]
            return self.tok.chat_token_ids(msgs, add_generation_prompt=add_generation_prompt)
        except ValueError as exc:
            raise OpenAIError(str(exc), param="messages") from exc

    def prepare(
        self,
        endpoint: str,
        body: CompletionRequest | ChatCompletionRequest,
        prompt_ids: list[int],
        max_tokens: int | None,
        stop_ids: tuple[int, ...],
        session: str | None,
        prefix: str,
    ) -> Prepared:
        model = self.check_model(body.model)
        limit = self.engine.max_model_len
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
            self.runtime.sessions.remember(session, prompt_ids)
        return Prepared(new_id(prefix), endpoint, prompt_ids, sampling, body.stop_strings(), model)

    async def run(
        self,
        prep: Prepared,
        stream: bool,
        include_usage: bool,
        chunk: Callable[..., dict[str, Any]],
    ) -> Response:
        outcome = Outcome(prompt_tokens=len(prep.prompt_ids))
        deltas = generate_text(
            self.engine,
            self.tok,
            GenerationRequest(prep.request_id, prep.prompt_ids, prep.sampling, prep.kv_transfer),
            prep.stop,
            outcome,
            on_first_token=self.runtime.metrics.ttft.labels(prep.endpoint).observe,
            on_token=self.runtime.metrics.token,
        )
        created = now()
        try:
            first = await anext(deltas)  # an EngineError surfaces here, before any byte
        except BaseException:
            await deltas.aclose()
            raise

        def done() -> None:
            self.runtime.metrics.observe(
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
                await check_transfer(self.engine, prep.kv_transfer)
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

    def render_completion(self, body: CompletionRequest) -> list[int]:
        self.check_model(body.model)
        return completion_prompt_ids(self.tok, body.prompt)

    def render_chat(self, body: ChatCompletionRequest) -> list[int]:
        self.check_model(body.model)
        return self.chat_prompt(body.messages, body.add_generation_prompt)


def build_openai_router(runtime: WorkerRuntime) -> APIRouter:
    """The OpenAI routes and vLLM's render routes over ``runtime``'s engine and tokenizer."""
    router = APIRouter()
    serving = OpenAIServing(runtime)
    engine, tok = serving.engine, serving.tok

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": serving.served,
            "object": "model",
            "created": now(),
            "owned_by": "kvpool",
            "max_model_len": engine.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        serving.check_model(body.model)
        if body.messages is not None:
            ids = serving.chat_prompt(body.messages, body.add_generation_prompt)
        else:
            ids = tok.encode(body.prompt or "")
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        ids = completion_prompt_ids(tok, body.prompt)
        kv_transfer = parse_kv_transfer(body.kv_transfer_params, runtime.pd_info)
        session = session_of(request.headers.get(SESSION_HEADER), body.user)
        prep = serving.prepare("completions", body, ids, body.max_tokens, (), session, "cmpl")
        prep.kv_transfer = kv_transfer
        prep.return_token_ids = body.return_token_ids
        return await serving.run(prep, body.stream, body.include_usage(), completion_chunk)

    @router.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        ids = serving.chat_prompt(body.messages, body.add_generation_prompt)
        session = session_of(request.headers.get(SESSION_HEADER), body.user)
        prep = serving.prepare(
            "chat",
            body,
            ids,
            body.requested_max_tokens(),
            tok.chat_stop_token_ids(),
            session,
            "chatcmpl",
        )
        return await serving.run(prep, body.stream, body.include_usage(), chat_chunk)

    router.include_router(
        build_render_router(engine, serving.render_completion, serving.render_chat)
    )
    return router


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
