"""OpenAI routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

Why this module exists: the HTTP surface clients use; the work is in ``serving``. ``/v1/models``
is an ordinary route of the ``router``. The two completion routes are every proxied request,
so they are answered by :class:`CompletionRoutes`, a plain ASGI layer in front of the app's
routing: FastAPI's routing, exception middleware and request handler (dependency solving,
response wrapping) were a quarter of the gateway's CPU per request. They run the same checks
as the dependencies of the other routers (auth, rate, bounded JSON body), in that order, read
the body as a dict (``models.completion_fields``/``chat_fields``) and answer every error in
OpenAI's shape, counted like the app's handlers count them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends
from pydantic import ValidationError
from starlette.datastructures import URL
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvpool.gateway.deps import (
    StateDep,
    authorize,
    bearer,
    check_declared_size,
    check_key,
    parse_object,
    too_large,
)
from kvpool.gateway.errors import (
    ENDPOINTS,
    GatewayError,
    bad_request,
    error_body,
    validation_error,
)
from kvpool.gateway.explain import request_id_of
from kvpool.gateway.models import Fields, chat_fields, completion_fields
from kvpool.gateway.prompts import chat_tokens, check_tokens, completion_tokens
from kvpool.gateway.serving import Incoming, serve
from kvpool.gateway.state import GatewayState
from kvpool.protocol.http_api import REQUEST_ID

router = APIRouter(prefix="/v1", tags=["openai"])


@router.get("/models", dependencies=[Depends(authorize)])
async def models(state: StateDep) -> dict[str, Any]:
    card = {"id": state.config.model, "object": "model", "created": 0, "owned_by": "kvpool"}
    return {"object": "list", "data": [card]}


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


class _ClientGoneError(Exception):
    """The client disconnected while sending its body: nobody to answer."""


async def _read_body(state: GatewayState, receive: Receive) -> bytes:
    limit = state.config.limits.max_body_bytes
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGoneError
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large(state)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _fields(endpoint: str, data: dict[str, Any]) -> Fields:
    try:
        return chat_fields(data) if endpoint == "chat" else completion_fields(data)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
    except ValueError as exc:  # chat content the gateway cannot read
        raise bad_request(f"messages: {exc}", "messages") from exc


def _headers(scope: Scope) -> dict[str, str]:
    """The request's headers by (lowercase) name, the first of a repeated one winning, as
    Starlette's ``Headers.get`` reads them."""
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in reversed(scope["headers"])}


async def completion(
    state: GatewayState, scope: Scope, receive: Receive, endpoint: str, request_id: str = ""
) -> Response:
    """One ``/v1/completions`` (``endpoint`` "completions") or ``/v1/chat/completions``
    ("chat") request, from its ASGI scope to the response to send."""
    headers = _headers(scope)
    client = scope.get("client")
    check_key(state, bearer(headers), client[0] if client else None)
    check_declared_size(state, headers.get("content-length"))
    raw = await _read_body(state, receive)
    data = parse_object(raw)
    fields = _fields(endpoint, data)
    _check_model(state, fields.model)
    if endpoint == "chat":
        assert fields.messages is not None
        tokens = await chat_tokens(state.encoder, fields.messages, fields.add_generation_prompt)
        check_tokens(tokens, "messages")
    else:
        assert fields.prompt is not None
        tokens = await completion_tokens(state.encoder, fields.prompt)
        check_tokens(tokens, "prompt")
    # the body is forwarded unchanged (its own bytes); the PD flow asks whether the client left
    incoming = Incoming(headers, raw, Request(scope, receive).is_disconnected, request_id)
    return await serve(state, incoming, endpoint, data, tokens, fields.user, fields.max_tokens)


REQUEST_ID_B = REQUEST_ID.encode()


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


class _Tagged:
    """``send`` with ``x-request-id`` added to the response's head."""

    __slots__ = ("_send", "_value")

    def __init__(self, send: Send, value: bytes) -> None:
        self._send = send
        self._value = value

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [*message.get("headers", ()), (REQUEST_ID_B, self._value)]
            message = {**message, "headers": headers}
        await self._send(message)


def _not_allowed(scope: Scope) -> Response:
    """405 in OpenAI's shape, as the app answers a wrong method on its other routes."""
    message = f"{scope['method']} {scope['path']}: Method Not Allowed"
    return JSONResponse(error_body(message), status_code=405, headers={"allow": "POST"})


class CompletionRoutes:
    """ASGI layer answering ``POST /v1/completions`` and ``/v1/chat/completions`` itself and
    passing every other request to ``app``. ``on_error(endpoint, status)`` counts refusals
    (the proxy counts what it answered)."""

    def __init__(
        self, app: ASGIApp, state: GatewayState, on_error: Callable[[str, int], None]
    ) -> None:
        self.app = app
        self.state = state
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = ENDPOINTS.get(scope["path"]) if scope["type"] == "http" else None
        if endpoint is None:
            if scope["type"] == "http" and scope["path"].rstrip("/") in ENDPOINTS:
                # as the app's router answers a trailing slash on a route it has
                url = URL(scope=scope).replace(path=scope["path"].rstrip("/"))
                await RedirectResponse(url, status_code=307)(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        if scope["method"] != "POST":
            await _not_allowed(scope)(scope, receive, send)
            return
        # every answer carries the request's id, the key of its explain record
        request_id = request_id_of(_header(scope, REQUEST_ID_B))
        send = _Tagged(send, request_id.encode("latin-1"))
        try:
            response = await completion(self.state, scope, receive, endpoint, request_id)
        except GatewayError as exc:
            self.on_error(endpoint, exc.status)
            response = exc.response()
        except _ClientGoneError:
            return
        await response(scope, receive, send)
