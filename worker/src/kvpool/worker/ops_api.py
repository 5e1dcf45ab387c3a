"""The worker's operational routes: liveness, readiness and Prometheus metrics.

Why this module exists: the kubelet's probes, the gateway's health loop and Prometheus read these
three, and what they say (failed, starting, refused, stalled, draining, frozen) is the
runtime's state, not the engine's API; ``server.build_app`` mounts them beside the OpenAI API.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

if TYPE_CHECKING:
    from kvpool.worker.server import WorkerRuntime


def build_ops_router(runtime: WorkerRuntime) -> APIRouter:
    """``/health`` and ``/healthz`` (the process answers), ``/readyz`` (requests may come),
    ``/metrics``."""
    router = APIRouter()
    served = runtime.engine.model_name

    @router.get("/health")  # vLLM and SGLang servers serve /health; sglang-router requires it
    @router.get("/healthz")
    async def healthz() -> JSONResponse:
        if runtime.start_error:
            return JSONResponse({"status": "failed", "error": runtime.start_error}, 500)
        return JSONResponse({"status": "ok"})

    @router.get("/readyz")
    async def readyz() -> JSONResponse:
        runtime.metrics.ready.set(1 if runtime.ready else 0)
        if runtime.ready:
            # frozen: ready, but what is prefilled now is not stored (the gateway prefers others)
            return JSONResponse({"status": "ready", "model": served, "frozen": runtime.frozen})
        body = {"status": runtime.state}
        if runtime.refusal is not None:
            body["reason"] = runtime.refusal
        elif runtime.waiting_for_controller is not None:
            body["reason"] = f"waiting for the KV controller at {runtime.waiting_for_controller}"
        return JSONResponse(body, status_code=503)

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(runtime.metrics.render(), media_type="text/plain; version=0.0.4")

    return router
