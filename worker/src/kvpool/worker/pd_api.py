"""The worker side of prefill/decode disaggregation over HTTP: what the PD proxy sends and reads.

Why this module exists: the gateway's PD proxy drives a prefill worker and a decode worker the
way lmcache 0.5.6's disaggregated-prefill proxy drives vLLM: the prefill request carries
``kv_transfer_params`` (``ret_first_tok`` and the ``disagg_spec``: request id, receiver host,
per-rank init and alloc ports), its answer carries ``kv_transfer_params.first_tok``, LMCache's
sender notifies the proxy when the KV landed, and the decode request is the prompt plus that
token. This module parses and checks the parameters (400s naming the field), builds the
answer's ``kv_transfer_params`` and serves ``GET /pd/info`` (the instance's role and ports, so
a proxy need not read the LMCache config) and, on a decode worker, ``POST /pd/release`` (the
proxy will not decode a prompt whose KV was transferred: free it now instead of after the
unclaimed-transfer TTL). The contract is in worker/README.md, section "PD".
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Annotated, Any, Protocol, runtime_checkable

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from kvpool.protocol.pd import RELEASE_PATH
from kvpool.worker.engine_api import KVTransferParams
from kvpool.worker.openai_models import OpenAIError

_FIELD = "kv_transfer_params"


def _ports(spec: dict[str, Any], name: str) -> tuple[int, ...]:
    value = spec.get(name)
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536 for p in value)
    ):
        raise OpenAIError(
            f"{_FIELD}.disagg_spec.{name} must be a non-empty list of ports (one per TP rank "
            f"of the decode instance, its pd_peer_{name.split('_', 1)[1]}), got {value!r}",
            param=f"{_FIELD}.disagg_spec.{name}",
        )
    return tuple(value)


def parse_kv_transfer(raw: dict[str, Any] | None, pd: dict[str, Any]) -> KVTransferParams | None:
    """The request's PD hand-over, or None; OpenAIError (400) naming the bad field."""
    if raw is None:
        return None
    if pd.get("role") not in ("sender", "both"):
        raise OpenAIError(
            f"{_FIELD} was sent to a worker that is not a PD prefill (sender) instance; send "
            "it to the PDPair's prefill worker, or omit it",
            param=_FIELD,
            code="pd_not_sender",
        )
    spec = raw.get("disagg_spec")
    if not isinstance(spec, dict):
        raise OpenAIError(
            f"{_FIELD}.disagg_spec must be an object with req_id, receiver_host, "
            "receiver_init_port and receiver_alloc_port",
            param=f"{_FIELD}.disagg_spec",
        )
    for name in ("req_id", "receiver_host"):
        if not isinstance(spec.get(name), str) or not spec[name]:
            raise OpenAIError(
                f"{_FIELD}.disagg_spec.{name} must be a non-empty string",
                param=f"{_FIELD}.disagg_spec.{name}",
            )
    init, alloc = _ports(spec, "receiver_init_port"), _ports(spec, "receiver_alloc_port")
    if len(init) != len(alloc):
        raise OpenAIError(
            f"{_FIELD}.disagg_spec: receiver_init_port has {len(init)} ports but "
            f"receiver_alloc_port has {len(alloc)}; send one of each per TP rank",
            param=f"{_FIELD}.disagg_spec.receiver_alloc_port",
        )
    return KVTransferParams(spec["req_id"], spec["receiver_host"], init, alloc)


def answer_params(
    params: KVTransferParams, first_token_id: int | None, num_tokens: int
) -> dict[str, Any]:
    """``kv_transfer_params`` of the prefill's answer (LMCache's proxy reads ``first_tok``)."""
    return {"first_tok": first_token_id, "req_id": params.req_id, "num_tokens": num_tokens}


@runtime_checkable
class TransferOutcomes(Protocol):
    """A PD sender's KV offload (``LMCacheOffload``): whether a request's transfer landed."""

    async def pd_transfer_result(self, req_id: str) -> str | None: ...


async def check_transfer(engine: object, params: KVTransferParams) -> None:
    """Return once the decoder has the prefill's KV; a retryable 503 naming why it does not
    (the decoder died, restarted, froze or is cut off: the proxy retries the request, and the
    sender reconnects to the decoder's new process on the next transfer)."""
    offload = getattr(engine, "offload", None)
    if not isinstance(offload, TransferOutcomes):
        return
    why = await offload.pd_transfer_result(params.req_id)
    if why is not None:
        raise OpenAIError(
            f"the prefill's KV did not reach the decoder at {params.receiver_host}: {why}; "
            "retry the request",
            status=503,
            code="pd_transfer_failed",
            type_="service_unavailable",
        )


@runtime_checkable
class TransferReleaser(Protocol):
    """A PD receiver's KV offload (``LMCacheOffload``): frees one prompt's transfer."""

    def release_transfer(self, token_ids: Sequence[int], req_id: str | None = None) -> int: ...


class ReleaseRequest(BaseModel):
    """``POST /pd/release``: the prompt the prefill transferred (``kvpool.protocol.pd``)."""

    model_config = ConfigDict(extra="ignore")
    prompt_token_ids: list[Annotated[int, Field(ge=0)]] = Field(min_length=1)
    req_id: str | None = None


def build_pd_router(pd: dict[str, Any], engine: object = None) -> APIRouter:
    """``GET /pd/info``; ``POST /pd/release`` frees through ``engine.offload`` (internal, like
    the memory API: at worst it makes the decoder recompute a prompt, never answer wrong)."""
    router = APIRouter()

    @router.get("/pd/info")
    async def pd_info() -> dict[str, Any]:
        return pd

    @router.post(RELEASE_PATH)
    async def release(body: ReleaseRequest) -> dict[str, Any]:
        offload = getattr(engine, "offload", None)
        if pd.get("role") != "receiver" or not isinstance(offload, TransferReleaser):
            raise OpenAIError(
                f"{RELEASE_PATH} frees a transfer on a PD decode (receiver) instance; this "
                "worker is not one: send it to the decode worker the prefill transferred to",
                code="pd_not_receiver",
            )
        chunks = await asyncio.to_thread(
            offload.release_transfer, body.prompt_token_ids, body.req_id
        )
        return {"req_id": body.req_id, "released_chunks": chunks}

    return router
