"""``GET /v1/requests/{id}/explain`` and ``POST /v1/requests/explain``: why a request was
routed where it was and why its chunks missed.

Why this module exists: an operator holding a slow answer has its request id (every completion
answer carries ``x-request-id``); this is where the gateway says what it knew when it routed
that request and what the pool knows now about each chunk that was cached nowhere
(:mod:`kvpool.gateway.explain_report`). ``POST`` takes a completion or chat body and answers
the same report for what the gateway would do with it now, sending nothing (a dry run).
Behind the API key like the OpenAI routes: a report shows prompt tokens.
"""

from __future__ import annotations

import copy
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import ValidationError

from kvpool.gateway.deps import BodyDep, StateDep, authorize
from kvpool.gateway.errors import GatewayError, bad_request, upstream_error, validation_error
from kvpool.gateway.explain_report import build_report
from kvpool.gateway.models import chat_fields, completion_fields
from kvpool.gateway.prompts import chat_tokens, check_tokens, completion_tokens
from kvpool.gateway.routing import RouteRequest
from kvpool.gateway.selection import Prompt
from kvpool.gateway.state import GatewayState
from kvpool.protocol.http_api import SESSION, session_of

router = APIRouter(prefix="/v1/requests", tags=["explain"], dependencies=[Depends(authorize)])


@router.get("/{request_id}/explain")
async def explain(request_id: str, state: StateDep) -> dict[str, Any]:
    book = state.explain
    rec = book.get(request_id)
    if rec is None:
        raise GatewayError(
            f"no recent request with id {request_id!r}: the gateway keeps the last "
            f"{book.max_requests} (limits.explainRequests), in the process that routed it",
            status=404,
            param="request_id",
            code="request_not_found",
            type_="not_found_error",
        )
    hashes = rec.hashes
    return await build_report(state, rec, lambda k: book.history.tokens(hashes[k]))


async def _tokens(state: GatewayState, data: dict[str, Any]) -> tuple[str, list[int], Any]:
    chat = "messages" in data
    try:
        fields = chat_fields(data) if chat else completion_fields(data)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
    except ValueError as exc:
        raise bad_request(f"messages: {exc}", "messages") from exc
    if chat:
        assert fields.messages is not None
        tokens = await chat_tokens(state.encoder, fields.messages, fields.add_generation_prompt)
        check_tokens(tokens, "messages")
        return "chat", tokens, fields
    if fields.prompt is None:
        raise bad_request(
            "send a completion body (prompt) or a chat body (messages) to explain", "prompt"
        )
    tokens = await completion_tokens(state.encoder, fields.prompt)
    check_tokens(tokens, "prompt")
    return "completions", tokens, fields


@router.post("/explain")
async def explain_body(request: Request, state: StateDep, data: BodyDep) -> dict[str, Any]:
    """What the gateway would do with this request now (nothing is sent or recorded)."""
    endpoint, tokens, fields = await _tokens(state, data)
    session = session_of(request.headers.get(SESSION), fields.user)
    prompt = Prompt(len(tokens), tuple(state.hasher(tokens)), session)
    sel = state.selector
    pool = state.instances.peers()
    if not pool and state.pd.pairs:
        pool = state.instances.of_group(min(state.pd.pairs), "prefill")
    hits = await sel.hits(prompt)
    cands = sel.candidates(pool, prompt, hits, set())
    if not cands:
        raise upstream_error(503, "no instance is ready to route this request", "no_instance")
    request_ = RouteRequest(prompt.tokens, sel.chunk_size, session)
    # a copy: a dry run must not advance a round-robin turn
    decision = copy.deepcopy(sel.router).route(request_, cands, index_ok=hits is not None)
    book = state.explain
    rec = book.preview(endpoint, session, prompt.hashes, len(tokens), hits)
    inst = state.instances.by_name[decision.instance]
    rec.steps.append(book.step("serve" if pool is state.instances.peers() else "prefill",
                               cands, decision, inst))  # fmt: skip
    cs = book.chunk_size

    def chunk_tokens(k: int) -> list[int] | None:
        return tokens[k * cs : (k + 1) * cs] if (k + 1) * cs <= len(tokens) else None

    return await build_report(state, rec, chunk_tokens, dry_run=True)
