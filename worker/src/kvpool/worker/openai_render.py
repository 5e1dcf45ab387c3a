"""OpenAI response bodies of the worker: completion and chat chunks, SSE framing, the 400 body
of a validation error, and the prepared request they are built from.

Why this module exists: ``server`` is the HTTP glue (routes, gate, streaming); the exact shape
of every OpenAI object it sends lives here, in pure functions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from fastapi.exceptions import RequestValidationError

from kvpool.protocol.http_api import error_body, validation_error
from kvpool.worker.engine_api import KVTransferParams, SamplingParams


@dataclass
class Prepared:
    request_id: str
    endpoint: str
    prompt_ids: list[int]
    sampling: SamplingParams
    stop: list[str]
    model: str
    kv_transfer: KVTransferParams | None = None
    return_token_ids: bool = False


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


def completion_chunk(
    prep: Prepared,
    created: int,
    text: str | None,
    finish_reason: str | None,
    *,
    final: bool = False,
    opening: bool = False,
) -> dict[str, Any]:
    choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    return {
        "id": prep.request_id,
        "object": "text_completion",
        "created": created,
        "model": prep.model,
        "choices": [choice],
    }


def chat_chunk(
    prep: Prepared,
    created: int,
    text: str | None,
    finish_reason: str | None,
    *,
    final: bool = False,
    opening: bool = False,
) -> dict[str, Any]:
    if final:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text or ""},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        obj = "chat.completion"
    else:
        delta = {"role": "assistant", "content": ""} if opening else {"content": text or ""}
        if finish_reason and not text:
            delta = {}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    return {
        "id": prep.request_id,
        "object": obj,
        "created": created,
        "model": prep.model,
        "choices": [choice],
    }


def validation_body(exc: RequestValidationError) -> dict[str, Any]:
    """The 400 body of a request that failed validation, worded as the gateway words it
    (``kvpool.protocol.http_api.validation_error``)."""
    message, param, code = validation_error(exc.errors())
    return error_body(message, param=param, code=code)
