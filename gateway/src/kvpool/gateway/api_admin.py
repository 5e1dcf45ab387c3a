"""Admin routes: ``GET /admin/config`` (the configuration in force and the last refusal) and
``POST /admin/config`` (apply a new ``gateway.yaml``; ``?dryRun=true`` only checks it).

Why this module exists: the mounted file is the operator's way to reconfigure a running
gateway (``live``); a person or a tool without the cluster's write access to the ConfigMap,
or a gateway run by hand, needs the same with an answer: applied (what changed), or refused
with the key at fault. These routes change how every request is routed, so they take their own
token, never a client API key: ``KVPOOL_GATEWAY_ADMIN_TOKEN`` (``Authorization: Bearer``); when
it is not set they are off (403 saying how to turn them on). A document POSTed here stays in
force until the mounted file changes (then the file's applies) or the gateway restarts.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from kvpool.gateway.deps import StateDep, bearer, same_secret
from kvpool.gateway.errors import GatewayError, error_body
from kvpool.gateway.state import GatewayState

router = APIRouter(prefix="/admin", tags=["admin"])

#: The variable holding the admin token (the operator does not render it: set it by hand, from
#: a Secret of your own, to turn the admin routes on).
ADMIN_TOKEN_ENV = "KVPOOL_GATEWAY_ADMIN_TOKEN"
#: HTTP status of each outcome of a POST.
STATUS = {"applied": 200, "unchanged": 200, "checked": 200, "invalid": 400, "restart_required": 409}


def _authorize(state: GatewayState, request: Request) -> None:
    token = state.env.admin_token
    if token is None:
        raise GatewayError(
            f"the admin API is off: set {ADMIN_TOKEN_ENV} in the gateway's environment (from a "
            "Secret) to turn it on",
            status=403,
            type_="permission_error",
            code="admin_disabled",
        )
    given = bearer(request.headers)
    if given is None or not same_secret(given, token.get_secret_value()):
        state.metrics.rejections.labels("unauthorized").inc()
        raise GatewayError(
            f"missing or invalid admin token: send 'Authorization: Bearer <{ADMIN_TOKEN_ENV}>'",
            status=401,
            type_="authentication_error",
            code="invalid_admin_token",
        )


@router.get("/config")
async def current(request: Request, state: StateDep) -> dict[str, Any]:
    _authorize(state, request)
    return {
        "config": state.config.model_dump(mode="json", by_alias=True),
        "reload": state.reconfig.describe(),
    }


@router.post("/config")
async def apply(request: Request, state: StateDep) -> JSONResponse:
    _authorize(state, request)
    reconfig = state.reconfig
    if reconfig.processes > 1:
        raise GatewayError(
            f"this gateway runs {reconfig.processes} processes (--workers) and a POST reaches "
            "one of them: change the mounted gateway.yaml instead (each process follows it)",
            status=409,
            code="several_processes",
        )
    limit = state.config.limits.max_body_bytes
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise GatewayError(
                f"the request body is larger than {limit} bytes", status=413, code="body_too_large"
            )
    dry_run = request.query_params.get("dryRun", "").lower() in ("1", "true", "yes")
    outcome = await reconfig.load(body, "admin", dry_run=dry_run)
    answer = outcome.body()
    if outcome.refused:  # also in OpenAI's shape, as every other 4xx of the gateway
        answer |= error_body(outcome.message, code=outcome.status)
    return JSONResponse(answer, status_code=STATUS[outcome.status])
