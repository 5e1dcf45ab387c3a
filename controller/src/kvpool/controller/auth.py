"""The bearer token on the controller's mutating HTTP routes.

Why: a route that clears a tier, pins or moves KV, compresses it, deregisters an instance or
replaces the allowlist changes what the whole domain serves. The operator renders one random
token per domain into a Secret, gives it to the controller (``KVPOOL_CONTROLLER_API_TOKEN``)
and uses it itself; read-only routes (lookups, stats, health, metrics) stay open to the
domain. Without a token configured (a standalone controller for development) every route is
open, as LMCache's own controller is.

The comparison is constant-time (``hmac.compare_digest``), the token is never logged (the
setting is a ``SecretStr``; refusals log the route and the client, not the header), and a
refusal is a 401 naming the header to send.
"""

from __future__ import annotations

import hmac
import logging

from fastapi import HTTPException, Request

from kvpool.protocol.http_api import AUTHORIZATION, CONTROLLER_TOKEN_ENV

logger = logging.getLogger(__name__)

UNAUTHORIZED = (
    "{path} changes the controller's state: send the domain's controller API token as "
    "'Authorization: Bearer <token>' (the operator keeps it in the Secret "
    "<pool>-controller-token, key 'token'; the controller reads it from {env})"
)


def presented(header: str | None) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header (None for anything else)."""
    if not header:
        return None
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip().encode()


def authorized(expected: str | None, header: str | None) -> bool:
    """Whether ``header`` carries ``expected`` (always, when no token is configured)."""
    if expected is None:
        return True
    given = presented(header)
    # compare_digest on bytes of any length: no early exit on the first differing byte
    return given is not None and hmac.compare_digest(given, expected.encode())


async def require_token(request: Request) -> None:
    """FastAPI dependency of every mutating route: 401 unless the request carries the token."""
    svc = request.app.state.server.service  # see kvpool.controller.api.create_app
    secret = svc.settings.api_token
    expected = None if secret is None else secret.get_secret_value()
    if authorized(expected, request.headers.get(AUTHORIZATION)):
        return
    path = request.url.path
    svc.metrics.unauthorized[path] += 1
    client = request.client.host if request.client else "?"
    if path not in svc.logged_unauthorized:
        svc.logged_unauthorized.add(path)
        logger.warning(
            "refused %s %s from %s: missing or wrong bearer token (further refusals of this "
            "route are only counted: kvpool_controller_unauthorized_total)",
            request.method,
            path,
            client,
        )
    raise HTTPException(
        status_code=401,
        detail=UNAUTHORIZED.format(path=path, env=CONTROLLER_TOKEN_ENV),
        headers={"WWW-Authenticate": 'Bearer realm="kvpool-controller"'},
    )
