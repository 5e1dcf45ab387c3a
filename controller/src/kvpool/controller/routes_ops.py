"""Operational HTTP routes: service identity, Prometheus metrics, liveness and readiness.

Why a router of its own: probes and scrapes are what Kubernetes and Prometheus call, and they
must answer whatever the state of the index; kept apart they are tested alone.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kvpool.controller.routes_lmcache import server_of

router = APIRouter()


def _role(server: Any) -> dict[str, Any]:
    """Leader election's view (``ha.py``): role, identity, term and, while standby, its copy."""
    return {} if server.ha is None else {"election": server.ha.describe()}


@router.get("/")
async def root(request: Request) -> dict[str, Any]:
    server = server_of(request)
    return {
        "service": "kvpool-controller",
        "epoch": server.service.epoch,
        "term": server.service.term,
        "ports": server.ports,
        **_role(server),
    }


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    text = server_of(request).service.metrics.render()
    return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(request: Request) -> Response:
    srv = server_of(request)
    svc = srv.service
    body = {
        "ready": srv.ready,
        "workers": len(svc.registry),
        "chunk_locations": len(svc.index),
        "full_sync_progress": svc.registry.sync_progress(),
        "redis": None if srv.store is None else ("ok" if srv.store.healthy else "unavailable"),
        **_role(srv),
    }
    return Response(
        json.dumps(body), status_code=200 if srv.ready else 503, media_type="application/json"
    )
