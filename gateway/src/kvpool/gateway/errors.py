"""Errors in OpenAI's shape, and the exception handlers that guarantee nothing else leaves.

Why this module exists: clients of an OpenAI-compatible gateway parse
``{"error": {"message", "type", "param", "code"}}``. A bad body is a 400 naming the field,
saturation a 429 with ``Retry-After``, an upstream failure a 502/503/504 saying which
instance and why; a stack trace never reaches a client (it goes to the log).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvpool.protocol.http_api import error_body
from kvpool.protocol.http_api import validation_error as _validation_fields

__all__ = ["GatewayError", "bad_request", "error_body", "upstream_error", "validation_error"]

logger = logging.getLogger(__name__)


class GatewayError(Exception):
    """An error answered in OpenAI's shape with ``status`` (and optional headers)."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type_=self.type, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(
    message: str, param: str | None = None, code: str = "invalid_value"
) -> GatewayError:
    return GatewayError(message, param=param, code=code)


#: Seconds a client should wait before it sends again a request the gateway could not place
#: (``Retry-After``): about one readiness probe, the time the gateway's view takes to change.
RETRY_AFTER_S = 1


def upstream_error(
    status: int, message: str, code: str, *, retry_after: bool | None = None
) -> GatewayError:
    """502 (bad answer), 503 (nobody available) or 504 (timed out). ``retry_after`` (default:
    for a 503) adds ``Retry-After``: the same request may succeed shortly (an instance
    restarting, draining or unreachable for now), which clients that retry wait for."""
    kind = {502: "bad_gateway", 503: "service_unavailable", 504: "timeout"}.get(status, "api_error")
    after = status == 503 if retry_after is None else retry_after
    headers = {"Retry-After": str(RETRY_AFTER_S)} if after else None
    return GatewayError(message, status=status, type_=kind, code=code, headers=headers)


def validation_error(errors: Sequence[Any]) -> GatewayError:
    """A 400 naming the first problem's field (pydantic's ``errors()``), worded as the
    workers word it (``kvpool.protocol.http_api.validation_error``)."""
    message, param, code = _validation_fields(errors)
    return bad_request(message, param, code)


ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


def install_handlers(app: FastAPI, on_error: Callable[[str, int], None] | None = None) -> None:
    """Every exception becomes an OpenAI-shaped JSON answer; ``on_error(endpoint, status)``
    counts the refused ones (the proxy counts the answered ones)."""

    def counted(request: Request, err: GatewayError) -> JSONResponse:
        if on_error is not None:
            on_error(ENDPOINTS.get(request.url.path, request.url.path), err.status)
        return err.response()

    @app.exception_handler(GatewayError)
    async def _gateway(request: Request, exc: GatewayError) -> JSONResponse:
        return counted(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return counted(request, validation_error(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            error_body(f"{request.method} {request.url.path}: {exc.detail}", type_=kind),
            status_code=exc.status_code,
        )

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(
            error_body(f"internal error: {type(exc).__name__}", type_="internal_error"),
            status_code=500,
        )
