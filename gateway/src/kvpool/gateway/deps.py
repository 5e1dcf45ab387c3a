"""FastAPI dependencies: the shared state, API-key auth and rate limit, the bounded body.

Why this module exists: every API route needs the same three checks before any work — who
is calling (a key from the operator-rendered Secret, when one is configured), whether that
key is over its rate, and a body that is JSON, an object and not larger than the limit.
Written once here and declared on the routers, instead of repeated in each handler.
"""

from __future__ import annotations

import hmac
import json
import math
import time
from collections.abc import Mapping
from typing import Annotated, Any, TypeVar

import msgspec
from fastapi import Depends, Request
from pydantic import BaseModel, ValidationError

from kvpool.gateway.errors import GatewayError, bad_request, validation_error
from kvpool.gateway.state import GatewayState

M = TypeVar("M", bound=BaseModel)

_DECODE = msgspec.json.Decoder().decode


def state_of(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    return state


async def get_state(request: Request) -> GatewayState:
    """The gateway's state. ``async``: FastAPI runs a plain ``def`` dependency on its
    thread pool, a thread hop (two wake-ups) per request."""
    return state_of(request)


def _bearer(request: Request) -> str | None:
    return bearer(request.headers)


def bearer(headers: Mapping[str, str]) -> str | None:
    """The API key a request carries: ``Authorization: Bearer <key>``, else ``x-api-key``."""
    header = headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return headers.get("x-api-key")


def same_secret(given: str, expected: str) -> bool:
    """``given == expected`` in constant time. On bytes: ``hmac.compare_digest`` raises
    TypeError for a str with a non-ASCII character, which a client can put in a header."""
    return hmac.compare_digest(
        given.encode("utf-8", "surrogateescape"), expected.encode("utf-8", "surrogateescape")
    )


StateDep = Annotated[GatewayState, Depends(get_state)]


async def authorize(request: Request, state: StateDep) -> str:
    """The caller's API key ("" when auth is off); 401 without a valid one, 429 over rate."""
    return check_key(state, _bearer(request), request.client.host if request.client else None)


def check_key(state: GatewayState, given: str | None, client_host: str | None) -> str:
    """:func:`authorize` on the caller's key (``Authorization: Bearer`` or ``x-api-key``)
    and address, for the routes that read them without a ``Request``."""
    key = ""
    if state.api_keys:
        if given is None or not any(same_secret(given, k) for k in state.api_keys):
            state.metrics.rejections.labels("unauthorized").inc()
            raise GatewayError(
                "missing or invalid API key: send 'Authorization: Bearer <key>'",
                status=401,
                type_="authentication_error",
                code="invalid_api_key",
            )
        key = given
    if state.buckets is not None:
        who = key or client_host or "anonymous"
        wait = state.buckets.take(who, time.monotonic())
        if wait > 0:
            state.metrics.rejections.labels("rate_limited").inc()
            raise GatewayError(
                "rate limit exceeded for this API key; retry later",
                status=429,
                type_="rate_limit_error",
                code="rate_limited",
                headers={"Retry-After": str(max(1, math.ceil(wait)))},
            )
    return key


async def read_json(request: Request, state: StateDep) -> dict[str, Any]:
    """The body as a JSON object, at most ``limits.maxBodyBytes`` (413 beyond)."""
    check_declared_size(state, request.headers.get("content-length"))
    chunks: list[bytes] = []
    size = 0
    limit = state.config.limits.max_body_bytes
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            state.metrics.rejections.labels("too_large").inc()
            raise _too_large(limit)
        chunks.append(chunk)
    raw = b"".join(chunks)
    return parse_object(raw)


def check_declared_size(state: GatewayState, declared: str | None) -> None:
    """413 when the request's ``Content-Length`` is over ``limits.maxBodyBytes``."""
    limit = state.config.limits.max_body_bytes
    if declared is not None and declared.isdigit() and int(declared) > limit:
        state.metrics.rejections.labels("too_large").inc()
        raise _too_large(limit)


def too_large(state: GatewayState) -> GatewayError:
    state.metrics.rejections.labels("too_large").inc()
    return _too_large(state.config.limits.max_body_bytes)


def parse_object(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object; 400 for an empty, invalid or non-object body.
    msgspec decodes what clients send; anything it refuses is decoded again by the standard
    library, which decides (it also reads integers beyond 64 bits and NaN)."""
    if not raw.strip():
        raise bad_request("the request body is empty; send a JSON object", code="invalid_json")
    try:
        data = _DECODE(raw)
    except msgspec.DecodeError:
        data = _decode_leniently(raw)
    except RecursionError:
        raise _too_deep() from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    return data


def _decode_leniently(raw: bytes) -> Any:
    """What msgspec refused, as the standard library reads it; 400 unless it is JSON whose
    strings are text (a lone UTF-16 surrogate escape, ``"\\ud800"``, which msgspec refuses and
    the standard library lets through, is no character: no tokenizer can encode it)."""
    try:
        data = json.loads(raw)
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:  # a ValueError: first
        raise bad_request(
            "the request body holds a lone UTF-16 surrogate escape (\\ud800-\\udfff without its "
            "pair), which is no character; send UTF-8 text",
            code="invalid_json",
        ) from None
    except ValueError:  # UnicodeDecodeError too
        raise bad_request("the request body is not valid JSON", code="invalid_json") from None
    except RecursionError:
        raise _too_deep() from None
    return data


def _too_deep() -> GatewayError:
    return bad_request(
        "the request body is nested too deeply; send a flatter JSON object", code="invalid_json"
    )


BodyDep = Annotated[dict[str, Any], Depends(read_json)]


def _too_large(limit: int) -> GatewayError:
    return GatewayError(
        f"the request body is larger than {limit} bytes", status=413, code="body_too_large"
    )


def parse(model: type[M], data: dict[str, Any]) -> M:
    """Validate ``data``; a 400 naming the first bad field otherwise."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
