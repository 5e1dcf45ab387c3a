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

from kvpool.worker.engine_api import KVTransferParams, SamplingParams
from kvpool.worker.openai_models import error_body


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
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return error_body(
            f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip(),
            code="invalid_json",
        )
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = str(first.get("msg", "invalid request"))
    if not loc and first.get("type") in ("model_attributes_type", "dict_type"):
        msg = "the request body must be a JSON object"
    where = f"{param}: " if param else ""
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return error_body(f"{where}{msg}{more}", param=param, code="invalid_value")
