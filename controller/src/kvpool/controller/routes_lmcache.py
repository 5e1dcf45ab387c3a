"""HTTP routes with LMCache's controller API (``python -m lmcache.v1.api_server``).

Why a router of its own: scripts and dashboards written for LMCache's API keep working
(``/lookup``, ``/query_instance``, ``/query_worker_info``, ``/clear``, ``/pin``, ``/compress``,
``/decompress``, ``/move``, ``/health``, ``/check_finish``: same request bodies, same response
fields, HTTP 500 with a ``detail`` on failure); the routes that change what workers hold need
the domain's API token (:mod:`kvpool.controller.auth`) where LMCache's need none. Each route is
generated from a row of :data:`kvpool.controller.orchestration.OPERATIONS` — body → message →
orchestration → reply → JSON — so no route repeats those steps by hand. Mount it on any app
whose ``state.server`` is a :class:`~kvpool.controller.server.ControllerServer`.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Request

from kvpool.controller.auth import require_token
from kvpool.controller.orchestration import OPERATIONS, Operation, handle_orchestration
from kvpool.controller.server import ControllerServer


def server_of(request: Request) -> ControllerServer:
    """The controller an app serves (set by :func:`kvpool.controller.api.create_app`)."""
    server: ControllerServer = request.app.state.server
    return server


async def run_operation(server: ControllerServer, op: Operation, body: Any) -> dict[str, Any]:
    """One HTTP call of an operation: refuse token bodies the domain cannot hash (400), run
    it, and turn an error or unexpected reply into a 500 naming it."""
    svc = server.service
    if op.tokens and svc.settings.tokens_lookup_error is not None:
        raise HTTPException(status_code=400, detail=svc.settings.tokens_lookup_error)
    reply = await handle_orchestration(svc, op.build(body))
    if not isinstance(reply, op.reply):
        detail = getattr(reply, "error", None) or f"unexpected reply {type(reply).__name__}"
        raise HTTPException(status_code=500, detail=detail)
    return op.answer(reply)


def _endpoint(op: Operation) -> Callable[..., Awaitable[dict[str, Any]]]:
    async def endpoint(request: Request, body: Any) -> dict[str, Any]:
        return await run_operation(server_of(request), op, body)

    # FastAPI reads the body model from the signature: give each route its own
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    endpoint.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [
            inspect.Parameter("request", kind, annotation=Request),
            inspect.Parameter("body", kind, annotation=op.body),
        ],
        return_annotation=dict[str, Any],
    )
    endpoint.__name__ = op.path.strip("/")
    return endpoint


def router() -> APIRouter:
    """A router with one ``POST`` route per orchestration operation (the token on those that
    change what workers hold)."""
    r = APIRouter()
    for op in OPERATIONS:
        guard = [Depends(require_token)] if op.mutates else []
        r.add_api_route(op.path, _endpoint(op), methods=["POST"], dependencies=guard)
    return r
