"""The agent memory API routes: ``POST /memory/{evict,prefetch,pin,unpin}`` for the pool.

Why this module exists: see ``memory`` for what the verbs mean pool-wide; this module
resolves a request's selector to token ids (or chunk hashes) and its targets through the
index, the session memory and the router, then fans the call out and reports per instance.
"""

from __future__ import annotations

from typing import Any, get_args

from fastapi import APIRouter, Depends

from kvpool.gateway.deps import BodyDep, StateDep, authorize, parse
from kvpool.gateway.errors import GatewayError, bad_request
from kvpool.gateway.instances import Instance
from kvpool.gateway.memory import Action, MemoryRequest, fan_out
from kvpool.gateway.selection import Prompt
from kvpool.gateway.state import GatewayState

router = APIRouter(prefix="/memory", tags=["agent memory"], dependencies=[Depends(authorize)])


async def _tokens(state: GatewayState, req: MemoryRequest) -> tuple[list[int], set[str]]:
    """Token ids the selector names, and instances a session was sent to."""
    if req.session_id is not None:
        known = state.sessions.get(req.session_id)
        if known is None:
            raise GatewayError(
                f"session {req.session_id!r} is unknown to the gateway (never seen, or "
                f"forgotten after {state.sessions.capacity} newer sessions)",
                status=404,
                param="session_id",
                code="session_not_found",
                type_="not_found_error",
            )
        return known
    if req.token_ids is not None:
        return list(req.token_ids), set()
    if req.text is not None:
        return await state.encoder.completion(req.text), set()
    assert req.messages is not None
    return await state.encoder.chat(req.messages, True), set()


def _ready(state: GatewayState) -> list[Instance]:
    return list(state.instances.available(state.instances))


async def _targets(
    state: GatewayState,
    action: Action,
    req: MemoryRequest,
    hashes: list[int],
    seen: set[str],
    tokens: int,
) -> list[Instance]:
    if req.instance is not None:
        inst = state.instances.get(req.instance)
        if inst is None:
            raise bad_request(
                f"instance: no instance named {req.instance!r} (known: "
                f"{', '.join(sorted(state.instances.by_name))})",
                "instance",
            )
        return [inst]
    if action == "evict":
        return _ready(state)
    if action == "prefetch":
        pool = state.instances.peers() or list(state.instances)
        inst, _ = await state.selector.choose(
            pool, Prompt(tokens, tuple(hashes), req.session_id), set()
        )
        return [inst]
    hits = await state.index.prefix_hits(hashes) or {}
    holders = {name for name, hit in hits.items() if hit.hit_chunks > 0} | seen
    chosen = [i for i in _ready(state) if i.name in holders]
    return chosen or _ready(state)


async def _act(state: GatewayState, action: Action, data: dict[str, Any]) -> dict[str, Any]:
    req = parse(MemoryRequest, data)
    if req.tiers is not None and action != "evict":
        raise bad_request("tiers: only /memory/evict takes tiers", "tiers")
    body: dict[str, Any]
    tokens: list[int] = []
    seen: set[str] = set()
    if req.chunk_hashes is not None:
        if action != "evict":
            raise bad_request(
                f"chunk_hashes: /memory/{action} needs the prefix itself (token_ids, text, "
                "messages or session_id); chunk hashes name KV only for evict",
                "chunk_hashes",
            )
        hashes = list(req.chunk_hashes)
        body = {"chunk_hashes": hashes}
    else:
        tokens, seen = await _tokens(state, req)
        if not tokens:
            raise bad_request("the selected prefix has no tokens", req.given()[0])
        hashes = state.hasher(tokens)
        body = {"token_ids": tokens}
    if req.tiers is not None:
        body["tiers"] = req.tiers
    targets = await _targets(state, action, req, hashes, seen, len(tokens))
    if not targets:
        raise GatewayError("no instance is ready", status=503, code="no_instance_available")
    reports = await fan_out(state.http, targets, action, body)
    if action == "evict":  # the routing credit of what was sent there goes with the KV
        state.selector.pending.forget(hashes, [t.name for t in targets])
    if action == "evict" and req.session_id is not None and req.instance is None:
        state.sessions.forget(req.session_id)
    return {
        "action": action,
        "selector": req.given()[0],
        "prefix_tokens": len(tokens) if tokens else None,
        "chunks": len(hashes),
        "instances": reports,
        "ok": all(r["ok"] for r in reports.values()),
    }


def _route(action: Action) -> Any:
    async def handle(data: BodyDep, state: StateDep) -> dict[str, Any]:
        return await _act(state, action, data)

    handle.__name__ = f"memory_{action}"
    return handle


for _action in get_args(Action):
    router.add_api_route(f"/{_action}", _route(_action), methods=["POST"], name=f"memory_{_action}")
