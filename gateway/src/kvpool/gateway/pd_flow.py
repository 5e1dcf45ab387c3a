"""One request through a PD pair: prefill (KV affinity), transfer wait, decode (a policy).

Why this module exists: ``pd`` owns the sockets and the contract; this is the request path
(see ``pd``'s docstring for the three steps), built from the gateway's own parts: the
selector chooses the prefill instance (KV affinity) and builds the decode candidates, a
routing policy chooses the decode instance (its KV arrives by transfer, so load is what
matters), the proxy sends both steps (the prefill with its retries and breakers), the
coordinator tracks and releases transfers. Both steps speak ``/v1/completions`` with token
ids, as LMCache's proxy does; a chat request is answered in chat shape (the text of the
prefill's first token, then the decoder's, re-wrapped as ``chat.completion`` objects). With the
pair's ``bypassMinCachedRatio`` a request whose prompt a decoder mostly holds already goes
straight to that decoder as a plain request (``pd_bypass``), answered in the same shapes.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvpool.gateway import pd_bypass
from kvpool.gateway.candidates import Candidates
from kvpool.gateway.errors import GatewayError, upstream_error
from kvpool.gateway.instances import Instance
from kvpool.gateway.pd import PDCoordinator
from kvpool.gateway.proxy import Attempt, Chooser, Proxy
from kvpool.gateway.routing import Decision, Policy, RouteRequest, make_policy
from kvpool.gateway.selection import Hits, Prompt, Selector
from kvpool.protocol.http_api import INSTANCE, ROUTE_REASON

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


#: The decode side's policy: the decoder receives the whole prompt's KV by transfer, so what it
#: holds does not matter, its load does.
DECODE_POLICY = "least-load"
PD_PREFILL = "pd-prefill"  # the prefill step's endpoint label in the proxy's metrics
CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it


def _noop() -> None:
    return None


def _object(value: Any) -> dict[str, Any]:
    """``value`` (or the JSON in its bytes) if it is an object, else an empty one."""
    if isinstance(value, bytes):
        try:
            value = json.loads(value)
        except ValueError:
            return {}
    return value if isinstance(value, dict) else {}


@dataclass
class PDFlow:
    """The PD request path over the gateway's selector, proxy and PD coordinator."""

    selector: Selector
    proxy: Proxy
    coordinator: PDCoordinator
    chat_stop_token_ids: Callable[[], tuple[int, ...]]
    decode_policy: Policy = field(default_factory=lambda: make_policy(DECODE_POLICY))

    def _decode_instance(
        self, pair: str, prompt: Prompt, note: str = ""
    ) -> tuple[Instance, Decision]:
        sel = self.selector
        cands = sel.candidates(sel.instances.of_group(pair, "decode"), prompt, None, set())
        if not cands:
            raise upstream_error(
                503, f"PD pair {pair}: no decode instance is ready", "no_instance_available"
            )
        request = RouteRequest(prompt.tokens, sel.chunk_size, prompt.session)
        chosen = self.decode_policy.choose(request, cands)
        # the decoder gets the whole prompt's KV by transfer: nothing of it is queued prefill
        decision = replace(
            chosen, reason=f"pd-decode-{chosen.reason}", predicted_hit_tokens=prompt.tokens
        )
        sel.metrics.decisions.labels(decision.reason, decision.instance).inc()
        inst = sel.instances.by_name[decision.instance]
        if sel.observer is not None:  # the request's explain record
            sel.observer("decode", prompt.hashes, None, cands, decision, inst, note)
        return inst, decision

    def _only(
        self, pair: str, inst: Instance, prompt: Prompt, decision: Decision, what: str
    ) -> Chooser:
        """The proxy's chooser for a step that only ``inst`` can take (no retry elsewhere)."""

        async def choose(n: int, exclude: set[str]) -> Attempt:
            if inst.name in exclude:
                raise upstream_error(
                    502, f"PD pair {pair}: {what} on {inst.name} failed", "decode_failed"
                )
            return self.selector.admit(inst, prompt, decision)

        return choose

    async def _bypass_verdict(
        self, pair: str, prompt: Prompt
    ) -> tuple[pd_bypass.BypassVerdict, Candidates, Hits]:
        """Whether the pair's decoders hold enough of the prompt to skip prefill and transfer
        (what the index and the pending entries say; counted in ``pd_paths``)."""
        sel = self.selector
        config = self.coordinator.pairs.get(pair)
        ratio = config.bypass_min_cached_ratio if config is not None else 0.0
        hits = await sel.hits(prompt) if ratio > 0 else None
        decoders = sel.instances.of_group(pair, "decode")
        cands = sel.candidates(decoders, prompt, hits, set()) if ratio > 0 else Candidates.of([])
        verdict = pd_bypass.decide(cands, prompt.tokens, sel.chunk_size, ratio)
        path = pd_bypass.PATH_BYPASS if verdict.bypass else pd_bypass.PATH_PREFILL
        self.coordinator.metrics.pd_paths.labels(pair, path, verdict.reason).inc()
        return verdict, cands, hits

    async def _serve_bypassed(
        self,
        pair: str,
        endpoint: str,
        body: dict[str, Any],
        prompt: Prompt,
        found: tuple[pd_bypass.BypassVerdict, Candidates, Hits],
        on_done: Callable[[], None],
    ) -> Response:
        """The whole request on the decoder that holds its prompt, as a plain request (it loads
        what it holds and prefills the rest); answered in the shape the PD path answers."""
        verdict, cands, hits = found
        sel = self.selector
        inst = sel.instances.by_name[cands.names[verdict.position]]
        decision = Decision(inst.name, pd_bypass.PD_BYPASS, verdict.cached_tokens)
        sel.metrics.decisions.labels(decision.reason, inst.name).inc()
        if sel.observer is not None:
            note = verdict.note(cands.names, prompt.tokens)
            sel.observer("bypass", prompt.hashes, hits, cands, decision, inst, note)
        self.coordinator.metrics.pd_transfers.labels(pair, "bypassed").inc()
        choose = self._only(pair, inst, prompt, decision, "the bypass")
        resp = await self.proxy.forward(choose, "/v1/completions", body, {}, on_done, endpoint)
        if resp.status_code != 200 or endpoint != "chat":
            return resp
        where = {INSTANCE: inst.name, ROUTE_REASON: pd_bypass.PD_BYPASS}
        if isinstance(resp, StreamingResponse):
            events = _chat_stream(resp.body_iterator)
            return StreamingResponse(events, media_type="text/event-stream", headers=where)
        return JSONResponse(_as_chat(json.loads(bytes(resp.body))), headers=where)

    async def _prefill(
        self, pair: str, prompt: Prompt, body: dict[str, Any]
    ) -> tuple[Instance, dict[str, Any]]:
        """The prefill's answer, through the proxy (another prefill instance after a connect
        error or a 503, breakers, timeouts); an error answer raised naming the instance."""
        sel = self.selector
        prefills = sel.instances.of_group(pair, "prefill")
        tried: list[Instance] = []

        async def choose(n: int, exclude: set[str]) -> Attempt:
            inst, decision = await sel.choose(prefills, prompt, exclude, role="prefill")
            tried.append(inst)
            return sel.admit(inst, prompt, decision)

        resp = await self.proxy.forward(choose, "/v1/completions", body, {}, _noop, PD_PREFILL)
        name = tried[-1].name if tried else "the prefill instance"
        payload = _object(bytes(resp.body))
        if resp.status_code != 200:
            err = _object(payload.get("error"))
            detail = err.get("message", bytes(resp.body)[:200].decode(errors="replace"))
            msg = f"prefill on {name}: {detail}"
            if resp.status_code < 500:
                raise GatewayError(
                    msg, status=resp.status_code, param=err.get("param"), code=err.get("code")
                )
            raise upstream_error(503 if resp.status_code == 503 else 502, msg, "prefill_failed")
        kv = payload.get("kv_transfer_params")
        if "kv_transfer_params" in body and not isinstance((kv or {}).get("first_tok"), int):
            raise upstream_error(
                502,
                f"prefill on {name} answered without kv_transfer_params.first_tok: is it a PD "
                "sender (pd_role: sender)?",
                "pd_protocol",
            )
        return tried[-1], payload

    async def serve(
        self,
        pair: str,
        endpoint: str,
        data: dict[str, Any],
        tokens: list[int],
        prompt: Prompt,
        max_tokens: int | None,
        on_done: Callable[[], None],
        client_gone: Callable[[], Awaitable[bool]],
    ) -> Response:
        """Prefill, wait for the transfer, decode; ``on_done`` runs when the answer is sent
        (the caller runs it when this raises). A transfer that will not be decoded is released
        (see ``pd``)."""
        chat = endpoint == "chat"
        metrics = self.coordinator.metrics
        wanted = (
            max_tokens
            if max_tokens is not None
            else (None if chat else DEFAULT_COMPLETION_MAX_TOKENS)
        )
        base = _base(data)
        if chat:  # a chat turn ends at the template's end-of-turn token, as on /v1/chat/completions
            stops = [*(data.get("stop_token_ids") or []), *self.chat_stop_token_ids()]
            if stops:
                base["stop_token_ids"] = list(dict.fromkeys(stops))
        verdict = await self._bypass_verdict(pair, prompt)
        if verdict[0].bypass:
            whole = _request(base, data, tokens, wanted)
            return await self._serve_bypassed(pair, endpoint, whole, prompt, verdict, on_done)
        note = verdict[0].note(verdict[1].names, prompt.tokens) if verdict[0].ratio > 0 else ""
        body = {**base, "prompt": tokens, "max_tokens": 1, "stream": False}
        if wanted == 1:  # the prefill's token is the whole answer: transfer nothing
            try:
                _, pre = await self._prefill(pair, prompt, body)
            except BaseException:
                metrics.pd_transfers.labels(pair, "prefill_failed").inc()
                raise
            metrics.pd_transfers.labels(pair, "prefill_only").inc()
            return _single(pre, chat, bool(data.get("stream")), on_done)
        d_inst, d_decision = self._decode_instance(pair, prompt, note)
        target = self.coordinator.targets[d_inst.name]
        transfer = self.coordinator.expect(pair, target, tokens)
        spec = target.disagg_spec(transfer.req_id)
        body["kv_transfer_params"] = {"ret_first_tok": True, "disagg_spec": spec}
        try:
            p_inst, pre = await self._prefill(pair, prompt, body)
        except BaseException:
            self.coordinator.forget(transfer)
            metrics.pd_transfers.labels(pair, "prefill_failed").inc()
            raise
        first_tok = int(pre["kv_transfer_params"]["first_tok"])
        choice = (pre.get("choices") or [{}])[0]

        def release() -> None:
            self.coordinator.release(transfer, self.proxy.upstream.post_json)

        if choice.get("finish_reason") == "stop":  # the first token ended the answer
            release()
            metrics.pd_transfers.labels(pair, "prefill_only").inc()
            return _single(pre, chat, bool(data.get("stream")), on_done)
        landed = await self.coordinator.wait_transfer(transfer)
        if await client_gone():  # nobody to decode for: free the transfer, not the decoder's time
            release()
            metrics.pd_transfers.labels(pair, "client_gone").inc()
            on_done()
            return Response(status_code=CLIENT_CLOSED)
        if not landed:
            release()  # the decoder recomputes; the transfer, if it lands late, is freed
        rest = None if wanted is None else wanted - 1
        decode = _request(base, data, [*tokens, first_tok], rest)
        choose = self._only(pair, d_inst, prompt, d_decision, "decode")
        metrics.pd_transfers.labels(pair, "transferred" if landed else "recomputed").inc()
        resp = await self.proxy.forward(choose, "/v1/completions", decode, {}, on_done, endpoint)
        if resp.status_code != 200:
            return resp
        where = {INSTANCE: f"{p_inst.name},{d_inst.name}", ROUTE_REASON: "pd"}
        if isinstance(resp, StreamingResponse):
            events = _stream(pre, resp.body_iterator, chat)
            return StreamingResponse(events, media_type="text/event-stream", headers=where)
        return JSONResponse(_merge(pre, json.loads(bytes(resp.body)), chat), headers=where)


def _request(
    base: dict[str, Any], data: dict[str, Any], prompt: list[int], max_tokens: int | None
) -> dict[str, Any]:
    """A decoder's ``/v1/completions`` body: the client's settings, these tokens, streamed as
    the client asked."""
    body = {**base, "prompt": prompt, "stream": bool(data.get("stream"))}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if data.get("stream_options") is not None:
        body["stream_options"] = data["stream_options"]
    return body


def _single(pre: dict[str, Any], chat: bool, stream: bool, on_done: Callable[[], None]) -> Response:
    on_done()
    pre = {k: v for k, v in pre.items() if k != "kv_transfer_params"}
    if not stream:
        return JSONResponse(_as_chat(pre) if chat else pre)

    async def events() -> AsyncIterator[bytes]:
        yield _sse(_as_chat_chunk(pre, opening=True) if chat else pre)
        yield _sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream")


async def _payloads(rest: Any) -> AsyncIterator[str]:
    """The ``data:`` payloads of an upstream's server-sent events (closed at the end)."""
    buffer = b""
    try:
        async for chunk in rest:
            buffer += chunk if isinstance(chunk, bytes) else str(chunk).encode()
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                line = event.decode(errors="replace").strip()
                if line.startswith("data: "):
                    yield line[len("data: ") :]
    finally:
        await rest.aclose()


async def _stream(pre: dict[str, Any], rest: Any, chat: bool) -> AsyncIterator[bytes]:
    head = {k: v for k, v in pre.items() if k not in ("kv_transfer_params", "usage")}
    head["choices"] = [{**c, "finish_reason": None} for c in pre.get("choices", [])]
    yield _sse(_as_chat_chunk(head, opening=True) if chat else head)
    async for payload in _payloads(rest):
        if payload == "[DONE]" or (not chat and '"usage"' not in payload):
            yield _sse(payload)
            continue
        obj = json.loads(payload)
        if obj.get("usage"):  # the decoder's count: the client's is one token more
            obj["usage"] = _usage(pre, obj["usage"])
        if chat and "choices" in obj and "error" not in obj:
            obj = _as_chat_chunk(obj)
        yield _sse(obj)


async def _chat_stream(rest: Any) -> AsyncIterator[bytes]:
    """A bypassed chat request's completion events as chat chunks (the first opens the
    assistant's message, as the PD path's first chunk does)."""
    opening = True
    async for payload in _payloads(rest):
        if payload == "[DONE]":
            yield _sse(payload)
            continue
        obj = json.loads(payload)
        if "choices" in obj and "error" not in obj:
            obj = _as_chat_chunk(obj, opening=opening and bool(obj["choices"]))
            opening = opening and not obj["choices"]
        yield _sse(obj)


def _merge(pre: dict[str, Any], dec: dict[str, Any], chat: bool) -> dict[str, Any]:
    first = (pre.get("choices") or [{}])[0].get("text", "")
    choices = [{**c, "text": first + c.get("text", "")} for c in dec.get("choices", [])]
    out = {**dec, "choices": choices, "usage": _usage(pre, dec.get("usage"))}
    return _as_chat(out) if chat else out


def _usage(pre: dict[str, Any], decoded: dict[str, Any] | None) -> dict[str, Any]:
    """The decoder's usage as the client's request sees it: the prompt without the first token
    (the prefill's), which counts among the completion tokens."""
    usage = dict(decoded or {})
    if usage:
        pre_usage = pre.get("usage") or {}
        usage["prompt_tokens"] = pre_usage.get("prompt_tokens", usage.get("prompt_tokens", 0))
        usage["completion_tokens"] = usage.get("completion_tokens", 0) + 1
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return usage
