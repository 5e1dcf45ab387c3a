"""Operations routes: ``/healthz`` (alive), ``/readyz`` (can serve; degraded without the
controller; 503 ``draining`` after SIGTERM), ``/metrics`` (Prometheus). Never behind auth:
probes and scrapers have no key.

Why this module exists: the kubelet's probes and Prometheus need answers that say exactly
what is wrong: no ready instance (503: route nothing here) versus controller down (200,
``degraded``: requests are still served by session/least-load routing).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from kvpool.gateway.deps import StateDep

router = APIRouter(tags=["operations"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(state: StateDep) -> JSONResponse:
    index = state.index.describe()
    instances: dict[str, Any] = {
        i.name: {
            "ready": i.ready,
            "frozen": i.frozen,
            "breaker": i.breaker.state.value,
            "error": i.last_error,
        }
        for i in state.instances
    }
    ready = state.instances.any_ready() and not state.drain.draining
    if state.drain.draining:  # SIGTERM: load balancers stop sending here first (see drain)
        status = "draining"
    elif not ready:
        status = "unavailable"
    elif not state.index.usable:
        status = "degraded"
    else:
        status = "ready"
    body = {
        "status": status,
        "routing": state.config.routing.policy,
        "index": index,
        "instances": instances,
        "pd_pairs": sorted(state.pd.pairs),
        "config": state.reconfig.describe(),
        "queued": state.admission.waiting,
        "inflight": state.admission.inflight,
    }
    return JSONResponse(body, status_code=200 if ready else 503)


@router.get("/metrics")
async def metrics(state: StateDep) -> Response:
    state.metrics.queued.set(state.admission.waiting)
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
