"""kvpool's own HTTP routes: the gateway's prefix lookup, the operator's deregistration, the
instance allowlist it keeps, and the figures it shows in the pool's status.

Why a router of its own: these are kvpool's API (LMCache has no such endpoints), used by the
gateway on routing and by the operator (its finalizer, the allowlist, its live status
figures); mounted alone on a bare app they are tested without the rest of the API. The two
that change state (deregister, replacing the allowlist) need the API token (auth.py).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Request
from pydantic import BaseModel, Field, model_validator

from kvpool.controller.auth import require_token
from kvpool.controller.routes_lmcache import server_of
from kvpool.protocol.http_api import (
    INSTANCES_PATH,
    PREFIX_LOOKUP_ONE_OF,
    PREFIX_LOOKUP_PATH,
    STATS_PATH,
    prefix_lookup_reply,
    stats_reply,
)


class DeregisterRequest(BaseModel):
    instance_id: str = Field(min_length=1, description="lmcache_instance_id (<instance>~<fp>)")


class InstancesRequest(BaseModel):
    """The body of ``PUT /v1/instances`` (kvpool.protocol.http_api.instances_body)."""

    instance_ids: list[str] = Field(description="Every lmcache_instance_id that may register")


class PrefixLookupRequest(BaseModel):
    hashes: list[int] | None = Field(None, description="Chained LMCache chunk hashes, in order")
    tokens: list[int] | None = Field(None, description="Token ids, hashed like LMCache's /lookup")
    chunk_size: int | None = Field(None, gt=0, description="Tokens per chunk (default: server's)")

    @model_validator(mode="after")
    def _one_of(self) -> PrefixLookupRequest:
        if (self.hashes is None) == (self.tokens is None):
            raise ValueError(PREFIX_LOOKUP_ONE_OF)
        return self


router = APIRouter()


@router.post(PREFIX_LOOKUP_PATH)
async def prefix_lookup(request: Request, req: PrefixLookupRequest) -> dict[str, Any]:
    svc = server_of(request).service
    if req.hashes is not None:
        hashes = req.hashes
    else:
        error = svc.settings.tokens_lookup_error
        if error is not None:
            raise HTTPException(status_code=400, detail=error)
        hashes = svc.token_hashes(req.tokens or [], req.chunk_size)
    return prefix_lookup_reply(len(hashes), svc.prefix_lookup(hashes))


@router.post("/v1/deregister", dependencies=[Depends(require_token)])
async def deregister(request: Request, req: DeregisterRequest) -> dict[str, Any]:
    """The operator's finalizer of a deleted P2PGroup/PDPair: forget every worker of the
    instance now, instead of serving its keys until the heartbeat TTL purges it."""
    svc = server_of(request).service
    workers = svc.registry.worker_ids(req.instance_id)
    done = [w for w in workers if svc.deregister(req.instance_id, w, "deleted (operator)")]
    return {"instance_id": req.instance_id, "deregistered": len(done)}


@router.get(STATS_PATH)
async def stats(request: Request) -> dict[str, Any]:
    """Read-only: registered workers per instance, index sizes per location and refused
    registrations (the operator's live figures; the same numbers as /metrics, by instance)."""
    svc = server_of(request).service
    m = svc.metrics
    workers = {iid: len(svc.registry.worker_ids(iid)) for iid in svc.registry.instances()}
    chunks = svc.index.stats(sweep=False)["chunks"]
    return stats_reply(workers, chunks, m.location_counts(), dict(m.refusals), svc.refused)


@router.put(INSTANCES_PATH, dependencies=[Depends(require_token)])
async def put_instances(request: Request, req: InstancesRequest) -> dict[str, Any]:
    """The operator's allowlist of the domain (every id it renders): from now on only these may
    register. Workers registered already stay (a scale-down's pod deregisters itself)."""
    if any(not iid for iid in req.instance_ids):
        raise HTTPException(status_code=422, detail="instance_ids: an id is empty")
    allowlist = server_of(request).service.allowlist
    allowlist.replace(req.instance_ids, "operator")
    return allowlist.describe()


@router.get(INSTANCES_PATH)
async def get_instances(request: Request) -> dict[str, Any]:
    """Read-only: the allowlist (``instance_ids`` null: none was given, every id may register)
    and where it came from (``file``, ``operator``, ``none``)."""
    return server_of(request).service.allowlist.describe()
