"""HTTP API: LMCache's controller endpoints with the same shapes, plus kvpool's own.

Why: scripts and dashboards written for ``python -m lmcache.v1.api_server`` keep working
(``/lookup``, ``/query_instance``, ``/query_worker_info``, ``/clear``, ``/pin``, ``/compress``,
``/decompress``, ``/move``, ``/health``, ``/check_finish``: same request bodies, same response
fields, HTTP 500 with a ``detail`` on failure). kvpool adds ``POST /v1/prefix_lookup`` (the
gateway's query), ``POST /v1/deregister`` (the operator's finalizer), ``/metrics``
(Prometheus), ``/healthz`` and ``/readyz``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field, model_validator

from kvpool.controller.orchestration import handle_orchestration
from kvpool.controller.server import ControllerServer
from kvpool.protocol import lmcache_wire as p


class QueryInstRequest(BaseModel):
    event_id: str = ""
    ip: str


class LookupRequest(BaseModel):
    tokens: list[int]


class ClearRequest(BaseModel):
    instance_id: str
    location: str


class PinRequest(BaseModel):
    instance_id: str
    location: str
    tokens: list[int]


class CompressRequest(BaseModel):
    instance_id: str
    method: str
    location: str
    tokens: list[int] | None = []


class MoveRequest(BaseModel):
    old_position: tuple[str, str]
    new_position: tuple[str, str]
    tokens: list[int] | None = []
    should_copy: bool | None = False


class HealthRequest(BaseModel):
    instance_id: str


class CheckFinishRequest(BaseModel):
    event_id: str


class QueryWorkerInfoRequest(BaseModel):
    instance_id: str
    worker_ids: list[int] | None = None


class DeregisterRequest(BaseModel):
    instance_id: str = Field(min_length=1, description="lmcache_instance_id (<instance>~<fp>)")


class PrefixLookupRequest(BaseModel):
    hashes: list[int] | None = Field(None, description="Chained LMCache chunk hashes, in order")
    tokens: list[int] | None = Field(None, description="Token ids, hashed like LMCache's /lookup")
    chunk_size: int | None = Field(None, gt=0, description="Tokens per chunk (default: server's)")

    @model_validator(mode="after")
    def _one_of(self) -> PrefixLookupRequest:
        if (self.hashes is None) == (self.tokens is None):
            raise ValueError("give exactly one of 'hashes' (chunk hashes) or 'tokens' (token ids)")
        return self


def create_app(server: ControllerServer) -> FastAPI:
    """The HTTP app for one controller; lifecycle (sockets, loops) is owned by the caller."""
    app = FastAPI(title="kvpool controller")
    app.state.server = server
    svc = server.service

    async def orch(msg: Any, expect: type) -> Any:
        reply = await handle_orchestration(svc, msg)
        if isinstance(reply, p.ErrorMsg):
            raise HTTPException(status_code=500, detail=reply.error)
        if not isinstance(reply, expect):
            raise HTTPException(status_code=500, detail=f"unexpected reply {type(reply).__name__}")
        return reply

    def new_id(prefix: str) -> str:
        return prefix + str(uuid.uuid4())

    @app.get("/")
    async def root() -> dict[str, Any]:
        return {"service": "kvpool-controller", "epoch": svc.epoch, "ports": server.ports}

    @app.post("/query_instance")
    async def query_instance(req: QueryInstRequest) -> dict[str, Any]:
        r = await orch(p.QueryInstMsg(new_id("QueryInst"), req.ip), p.QueryInstRetMsg)
        return {"event_id": r.event_id, "res": r.instance_id}

    def refuse_tokens() -> None:
        error = svc.settings.tokens_lookup_error
        if error is not None:
            raise HTTPException(status_code=400, detail=error)

    @app.post("/lookup")
    async def lookup(req: LookupRequest) -> dict[str, Any]:
        refuse_tokens()
        r = await orch(p.LookupMsg(new_id("Lookup"), req.tokens), p.LookupRetMsg)
        return {"event_id": r.event_id, "layout_info": r.layout_info}

    @app.post("/clear")
    async def clear(req: ClearRequest) -> dict[str, Any]:
        r = await orch(p.ClearMsg(new_id("Clear"), req.instance_id, req.location), p.ClearRetMsg)
        return {"event_id": r.event_id, "num_tokens": r.num_tokens}

    @app.post("/pin")
    async def pin(req: PinRequest) -> dict[str, Any]:
        msg = p.PinMsg(new_id("Pin"), req.instance_id, req.location, req.tokens)
        r = await orch(msg, p.PinRetMsg)
        return {"event_id": r.event_id, "num_tokens": r.num_tokens}

    @app.post("/compress")
    async def compress(req: CompressRequest) -> dict[str, Any]:
        msg = p.CompressMsg(
            new_id("Compress"), req.instance_id, req.method, req.location, req.tokens
        )
        r = await orch(msg, p.CompressRetMsg)
        return {"event_id": r.event_id, "num_tokens": r.num_tokens}

    @app.post("/decompress")
    async def decompress(req: CompressRequest) -> dict[str, Any]:
        msg = p.DecompressMsg(
            new_id("Decompress"), req.instance_id, req.method, req.location, req.tokens
        )
        r = await orch(msg, p.DecompressRetMsg)
        return {"event_id": r.event_id, "num_tokens": r.num_tokens}

    @app.post("/move")
    async def move(req: MoveRequest) -> dict[str, Any]:
        msg = p.MoveMsg(
            new_id("Move"), req.old_position, req.new_position, req.tokens, req.should_copy
        )
        r = await orch(msg, p.MoveRetMsg)
        return {"event_id": r.event_id, "num_tokens": r.num_tokens}

    @app.post("/health")
    async def health(req: HealthRequest) -> dict[str, Any]:
        r = await orch(p.HealthMsg(new_id("health"), req.instance_id), p.HealthRetMsg)
        return {"event_id": r.event_id, "error_codes": r.error_codes}

    @app.post("/check_finish")
    async def check_finish(req: CheckFinishRequest) -> dict[str, Any]:
        r = await orch(p.CheckFinishMsg(req.event_id), p.CheckFinishRetMsg)
        return {"status": r.status}

    @app.post("/query_worker_info")
    async def query_worker_info(req: QueryWorkerInfoRequest) -> dict[str, Any]:
        msg = p.QueryWorkerInfoMsg(new_id("QueryWorkerInfo"), req.instance_id, req.worker_ids)
        r = await orch(msg, p.QueryWorkerInfoRetMsg)
        infos = [{f: getattr(w, f) for f in w.__struct_fields__} for w in r.worker_infos]
        return {"event_id": r.event_id, "worker_infos": infos}

    @app.post("/v1/prefix_lookup")
    async def prefix_lookup(req: PrefixLookupRequest) -> dict[str, Any]:
        if req.hashes is not None:
            hashes = req.hashes
        else:
            refuse_tokens()
            hashes = svc.token_hashes(req.tokens or [], req.chunk_size)
        return {"chunks": len(hashes), "instances": svc.prefix_lookup(hashes)}

    @app.post("/v1/deregister")
    async def deregister(req: DeregisterRequest) -> dict[str, Any]:
        """The operator's finalizer of a deleted P2PGroup/PDPair: forget every worker of the
        instance now, instead of serving its keys until the heartbeat TTL purges it."""
        workers = svc.registry.worker_ids(req.instance_id)
        done = [w for w in workers if svc.deregister(req.instance_id, w, "deleted (operator)")]
        return {"instance_id": req.instance_id, "deregistered": len(done)}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(svc.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz(request: Request) -> Response:
        srv: ControllerServer = request.app.state.server
        body = {
            "ready": srv.ready,
            "workers": len(svc.registry),
            "chunk_locations": len(svc.index),
            "full_sync_progress": svc.registry.sync_progress(),
            "redis": None if srv.store is None else ("ok" if srv.store.healthy else "unavailable"),
        }
        return Response(
            json.dumps(body), status_code=200 if srv.ready else 503, media_type="application/json"
        )

    return app
