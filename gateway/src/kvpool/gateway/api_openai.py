"""OpenAI routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

Why this module exists: the HTTP surface clients use, as an APIRouter; the work is in
``serving``. The two completion routes run the same checks as the dependencies of the other
routers (auth, bounded JSON body) but call them directly, in that order: FastAPI's
dependency solving was a fifth of the gateway's CPU per request.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from kvpool.gateway.deps import StateDep, authorize, parse, read_json, state_of
from kvpool.gateway.errors import GatewayError
from kvpool.gateway.models import ChatBody, CompletionBody
from kvpool.gateway.prompts import chat_tokens, check_tokens, completion_tokens
from kvpool.gateway.serving import serve
from kvpool.gateway.state import GatewayState

router = APIRouter(prefix="/v1", tags=["openai"])


async def _checked(request: Request) -> tuple[GatewayState, dict[str, Any]]:
    """The state and the body, after the caller's key and rate were checked."""
    state = state_of(request)
    await authorize(request, state)
    return state, await read_json(request, state)


def _check_model(state: GatewayState, model: str | None) -> None:
    served = state.config.model
    if model is not None and model != served:
        raise GatewayError(
            f"the model {model!r} does not exist; this pool serves {served!r}",
            status=404,
            param="model",
            code="model_not_found",
            type_="not_found_error",
        )


@router.post("/completions")
async def completions(request: Request) -> Response:
    state, data = await _checked(request)
    body = parse(CompletionBody, data)
    _check_model(state, body.model)
    tokens = await completion_tokens(state.encoder, body)
    check_tokens(tokens, "prompt")
    return await serve(state, request, "completions", data, tokens, body.user, body.max_tokens)


@router.post("/chat/completions")
async def chat_completions(request: Request) -> Response:
    state, data = await _checked(request)
    body = parse(ChatBody, data)
    _check_model(state, body.model)
    tokens = await chat_tokens(state.encoder, body)
    check_tokens(tokens, "messages")
    return await serve(state, request, "chat", data, tokens, body.user, body.requested_max_tokens())


@router.get("/models", dependencies=[Depends(authorize)])
async def models(state: StateDep) -> dict[str, Any]:
    card = {"id": state.config.model, "object": "model", "created": 0, "owned_by": "kvpool"}
    return {"object": "list", "data": [card]}
