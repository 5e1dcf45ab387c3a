"""vLLM's renderer endpoints and the KV-event discovery a precise router asks a worker for.

Why this module exists: vllm-router (``kv_aware`` and ``cache_aware``) tokenizes every request
through each candidate worker (``POST /v1/completions/render``, ``/v1/chat/completions/render``:
vLLM >= 0.15's renderer API, token ids out) and matches those ids against the token ids the
worker's KV events carry; it finds the events through ``GET /get_server_info`` (model and block
size) and ``GET /kv_event_sources`` (the publisher per data-parallel rank). The ids rendered
here are exactly the ones the OpenAI endpoints prefill (the same rendering functions), so a
router credits what the engine really holds. /work/notes/vllm-kv-events.md has the contract
vllm-router 0.1.17 was probed with.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter

from kvpool.worker.engine_api import Engine
from kvpool.worker.openai_models import ChatCompletionRequest, CompletionRequest, new_id


def build_render_router(
    engine: Engine,
    completion_ids: Callable[[CompletionRequest], list[int]],
    chat_ids: Callable[[ChatCompletionRequest], list[int]],
) -> APIRouter:
    """The routes; ``completion_ids``/``chat_ids`` are the OpenAI endpoints' own rendering
    (they check the model and raise the same 400s)."""
    router = APIRouter(tags=["vLLM renderer and KV-event discovery"])

    @router.post("/v1/completions/render")
    async def render_completion(body: CompletionRequest) -> list[dict[str, Any]]:
        ids = completion_ids(body)
        return [{"request_id": new_id("cmpl"), "token_ids": ids, "model": engine.model_name}]

    @router.post("/v1/chat/completions/render")
    async def render_chat(body: ChatCompletionRequest) -> dict[str, Any]:
        ids = chat_ids(body)
        return {"request_id": new_id("chatcmpl"), "token_ids": ids, "model": engine.model_name}

    @router.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        """SGLang's endpoint, which vllm-router's discovery reads: exactly one of
        ``kv_block_size``/``block_size`` (both is a parse error there)."""
        info: dict[str, Any] = {"model_id": engine.model_name}
        block_size = getattr(engine, "block_size", None)
        if isinstance(block_size, int):
            info["kv_block_size"] = block_size
        name = getattr(engine, "name", None)
        if isinstance(name, str):
            info["instance_id"] = name
        return info

    @router.get("/kv_event_sources")
    async def kv_event_sources() -> dict[str, Any]:
        """vLLM >= 0.31's publisher per DP rank; ``{}`` when the engine publishes none."""
        sources = getattr(engine, "kv_event_sources", None)
        return dict(sources()) if callable(sources) else {}

    return router
