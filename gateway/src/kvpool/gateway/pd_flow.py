"""One request through a PD pair: prefill (KV affinity), transfer wait, decode (load).

Why this module exists: ``pd`` owns the sockets and the contract; this is the request path
(see ``pd``'s docstring for the three steps). Both steps speak ``/v1/completions`` with token
ids, as LMCache's proxy does; a chat request is answered in chat shape (the text of the
prefill's first token, then the decoder's, re-wrapped as ``chat.completion`` objects).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvpool.gateway.errors import GatewayError, upstream_error
from kvpool.gateway.proxy import Attempt
from kvpool.gateway.routing import Decision, LeastLoadPolicy, RouteRequest
from kvpool.gateway.selection import Prompt
from kvpool.gateway.state import GatewayState
from kvpool.gateway.upstream import TIMEOUT_ERRORS

_DROP = ("messages", "prompt", "stream", "stream_options", "max_tokens", "max_completion_tokens",
         "add_generation_prompt", "kv_transfer_params")  # fmt: skip
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's (and the worker's) default for completions


def _base(data: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in data.items() if k not in _DROP}


def _sse(obj: dict[str, Any] | str) -> bytes:
    text = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


def _as_chat_chunk(obj: dict[str, Any], opening: bool = False) -> dict[str, Any]:
    choices = []
    for c in obj.get("choices", []):
        delta: dict[str, Any] = {"role": "assistant", "content": c.get("text", "")}
        if not opening:
            delta = {"content": c.get("text", "")} if c.get("text") else {}
        choices.append({"index": c.get("index", 0), "delta": delta, "logprobs": None,
                        "finish_reason": c.get("finish_reason")})  # fmt: skip
    return {**obj, "object": "chat.completion.chunk", "choices": choices}


def _as_chat(obj: dict[str, Any]) -> dict[str, Any]:
    choices = [
        {"index": c.get("index", 0), "message": {"role": "assistant", "content": c.get("text", "")},
         "logprobs": None, "finish_reason": c.get("finish_reason")}
        for c in obj.get("choices", [])
    ]  # fmt: skip
    return {**obj, "object": "chat.completion", "choices": choices}


async def _prefill(state: GatewayState, attempt: Attempt, body: dict[str, Any]) -> dict[str, Any]:
    inst = attempt.instance
    t0 = time.monotonic()
    try:
        status, payload, text = await state.upstream.post_json(f"{inst.url}/v1/completions", body)
    except TIMEOUT_ERRORS as exc:
        inst.breaker.failure(time.monotonic())
        raise upstream_error(504, f"prefill on {inst.name} timed out", "timeout") from exc
    except aiohttp.ClientError as exc:
        inst.breaker.failure(time.monotonic())
        raise upstream_error(
            502, f"prefill on {inst.name} failed: {type(exc).__name__}", "upstream_unreachable"
        ) from exc
    finally:
        state.load.finish(attempt.ticket)
    state.metrics.ttft.labels(inst.name).observe(time.monotonic() - t0)
    if not isinstance(payload, dict):
        payload = {}
    if status != 200:
        err = payload.get("error", {}) if isinstance(payload.get("error"), dict) else {}
        msg = f"prefill on {inst.name}: {err.get('message', text[:200])}"
        if status < 500:
            raise GatewayError(msg, status=status, param=err.get("param"), code=err.get("code"))
        raise upstream_error(503 if status == 503 else 502, msg, "prefill_failed")
    inst.breaker.success()
    kv = payload.get("kv_transfer_params") or {}
    if not isinstance(kv.get("first_tok"), int):
        raise upstream_error(
            502,
            f"prefill on {inst.name} answered without kv_transfer_params.first_tok: is it a PD "
            "sender (pd_role: sender)?",
            "pd_protocol",
        )
    return payload


async def serve_pd(
    state: GatewayState,
    pair_name: str,
    endpoint: str,
    data: dict[str, Any],
    tokens: list[int],
    prompt: Prompt,
    max_tokens: int | None,
    on_done: Callable[[], None],
) -> Response:
    """Prefill, wait for the transfer, decode; ``on_done`` runs when the answer is sent
    (the caller runs it when this raises)."""
    sel = state.selector
    chat = endpoint == "chat"
    prefills = state.instances.of_group(pair_name, "prefill")
    decodes = state.instances.of_group(pair_name, "decode")
    p_inst, p_decision = await sel.choose(prefills, prompt, set(), role="prefill")
    cands = sel.candidates(decodes, prompt, None, set())
    if not cands:
        raise upstream_error(
            503, f"PD pair {pair_name}: no decode instance is ready", "no_instance_available"
        )
    d_name = LeastLoadPolicy().choose(RouteRequest(prompt.tokens, sel.chunk_size), cands).instance
    # the decoder gets the whole prompt's KV by transfer: nothing of it is queued prefill there
    d_decision = Decision(d_name, "pd-decode-least-load", prompt.tokens)
    state.metrics.decisions.labels(d_decision.reason, d_name).inc()
    d_inst = state.instances.by_name[d_name]
    target = state.pd.targets[d_name]
    req_id = uuid.uuid4().hex
    event = state.pd.waits.expect(req_id, len(target.init_ports))
    wanted = (
        max_tokens if max_tokens is not None else (None if chat else DEFAULT_COMPLETION_MAX_TOKENS)
    )
    kv_params = {"ret_first_tok": True, "disagg_spec": target.disagg_spec(req_id)}
    base = _base(data)
    if chat:  # a chat turn ends at the template's end-of-turn token, as on /v1/chat/completions
        stops = [*(data.get("stop_token_ids") or []), *state.encoder.chat_stop_token_ids()]
        if stops:
            base["stop_token_ids"] = list(dict.fromkeys(stops))
    body = {**base, "prompt": tokens, "max_tokens": 1, "stream": False,
            "kv_transfer_params": kv_params}  # fmt: skip
    try:
        pre = await _prefill(state, sel.admit(p_inst, prompt, p_decision), body)
    except BaseException:
        state.pd.waits.done(req_id)
        state.metrics.pd_transfers.labels(pair_name, "prefill_failed").inc()
        raise
    first_tok = int(pre["kv_transfer_params"]["first_tok"])
    choice = (pre.get("choices") or [{}])[0]
    if wanted == 1 or choice.get("finish_reason") == "stop":
        state.pd.waits.done(req_id)
        state.metrics.pd_transfers.labels(pair_name, "prefill_only").inc()
        return _single(pre, chat, bool(data.get("stream")), on_done)
    landed = await state.pd.wait_transfer(req_id, event, pair_name)
    decode = {**base, "prompt": [*tokens, first_tok], "stream": bool(data.get("stream"))}
    if wanted is not None:
        decode["max_tokens"] = wanted - 1
    if data.get("stream_options") is not None:
        decode["stream_options"] = data["stream_options"]

    async def choose(n: int, exclude: set[str]) -> Attempt:
        if d_name in exclude:
            raise upstream_error(
                502, f"PD pair {pair_name}: decode on {d_name} failed", "decode_failed"
            )
        return sel.admit(d_inst, prompt, d_decision)

    state.metrics.pd_transfers.labels(pair_name, "transferred" if landed else "recomputed").inc()
    resp = await state.proxy.forward(choose, "/v1/completions", decode, {}, on_done, endpoint)
    if resp.status_code != 200:
        return resp
    where = {"x-kvpool-instance": f"{p_inst.name},{d_name}", "x-kvpool-route-reason": "pd"}
    if isinstance(resp, StreamingResponse):
        events = _stream(pre, resp.body_iterator, chat)
        return StreamingResponse(events, media_type="text/event-stream", headers=where)
    return JSONResponse(_merge(pre, json.loads(bytes(resp.body)), chat), headers=where)


def _single(pre: dict[str, Any], chat: bool, stream: bool, on_done: Callable[[], None]) -> Response:
    on_done()
    pre = {k: v for k, v in pre.items() if k != "kv_transfer_params"}
    if not stream:
        return JSONResponse(_as_chat(pre) if chat else pre)

    async def events() -> AsyncIterator[bytes]:
        yield _sse(_as_chat_chunk(pre, opening=True) if chat else pre)
        yield _sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream")


async def _stream(pre: dict[str, Any], rest: Any, chat: bool) -> AsyncIterator[bytes]:
    head = {k: v for k, v in pre.items() if k not in ("kv_transfer_params", "usage")}
    head["choices"] = [{**c, "finish_reason": None} for c in pre.get("choices", [])]
    yield _sse(_as_chat_chunk(head, opening=True) if chat else head)
    buffer = b""
    try:
        async for chunk in rest:
            buffer += chunk if isinstance(chunk, bytes) else str(chunk).encode()
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                line = event.decode(errors="replace").strip()
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: ") :]
                if payload == "[DONE]" or not chat:
                    yield _sse(payload)
                    continue
                obj = json.loads(payload)
                if "choices" in obj and "error" not in obj:
                    obj = _as_chat_chunk(obj)
                yield _sse(obj)
    finally:
        await rest.aclose()


def _merge(pre: dict[str, Any], dec: dict[str, Any], chat: bool) -> dict[str, Any]:
    first = (pre.get("choices") or [{}])[0].get("text", "")
    choices = [{**c, "text": first + c.get("text", "")} for c in dec.get("choices", [])]
    usage = dict(dec.get("usage") or {})
    pre_usage = pre.get("usage") or {}
    if usage:
        usage["prompt_tokens"] = pre_usage.get("prompt_tokens", usage.get("prompt_tokens", 0))
        usage["completion_tokens"] = usage.get("completion_tokens", 0) + 1
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    out = {**dec, "choices": choices, "usage": usage}
    return _as_chat(out) if chat else out
