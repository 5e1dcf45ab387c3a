"""One OpenAI request from body to answer: tokens, hashes, route, admission, forward.

Why this module exists: completions and chat differ only in how the prompt becomes token
ids; everything after (session, chunk hashes, PD or peer pool, admission, retries, the
session memory) is the same, and lives here once.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi.responses import Response

from kvpool.gateway.admission import once
from kvpool.gateway.errors import GatewayError
from kvpool.gateway.explain import CURRENT, request_id_of
from kvpool.gateway.instances import Instance
from kvpool.gateway.proxy import Attempt
from kvpool.gateway.selection import Prompt
from kvpool.gateway.state import GatewayState
from kvpool.protocol.http_api import INSTANCE as PIN_HEADER
from kvpool.protocol.http_api import PD as PD_HEADER
from kvpool.protocol.http_api import PD_ANY, REQUEST_ID, session_of
from kvpool.protocol.http_api import SESSION as SESSION_HEADER


@dataclass(frozen=True, slots=True)
class Incoming:
    """What the request path reads of the HTTP request besides its body: the headers
    (lowercase names; the first of a repeated one), the body's own bytes (forwarded
    unchanged) and whether the client has gone (the PD flow asks before decoding)."""

    headers: Mapping[str, str]
    raw: bytes | None
    client_gone: Callable[[], Awaitable[bool]]
    request_id: str = ""  # x-request-id (``explain.request_id_of``): the explain record's key


def pd_pair_for(state: GatewayState, incoming: Incoming) -> str | None:
    """The PD pair to use: named by ``x-kvpool-pd`` (a pair name or ``any``), or the only
    way to serve when the pool has no peer instances."""
    pairs = state.pd.pairs
    wanted = incoming.headers.get(PD_HEADER)
    if wanted:
        if wanted == PD_ANY and pairs:
            return min(pairs)
        if wanted in pairs:
            return wanted
        raise GatewayError(
            f"{PD_HEADER}: no ready PD pair named {wanted!r} (ready: "
            f"{', '.join(sorted(pairs)) or 'none'})",
            status=400,
            param=PD_HEADER,
            code="unknown_pd_pair",
        )
    if pairs and not state.instances.peers():
        return min(pairs)
    return None


def pinned_instance(state: GatewayState, incoming: Incoming) -> Instance | None:
    """The instance named by ``x-kvpool-instance`` (moves a session on purpose), if any."""
    name = incoming.headers.get(PIN_HEADER)
    if not name:
        return None
    inst = state.instances.get(name)
    if inst is None:
        raise GatewayError(
            f"{PIN_HEADER}: no instance named {name!r} (known: "
            f"{', '.join(sorted(state.instances.by_name))})",
            status=400,
            param=PIN_HEADER,
            code="unknown_instance",
        )
    return inst


async def serve(
    state: GatewayState,
    incoming: Incoming,
    endpoint: str,
    data: dict[str, Any],
    tokens: list[int],
    user: str | None,
    max_tokens: int | None,
) -> Response:
    """Route and forward one completion or chat request (its routing is recorded for
    ``GET /v1/requests/{id}/explain`` under ``incoming.request_id``)."""
    session = session_of(incoming.headers.get(SESSION_HEADER), user)
    prompt = Prompt(len(tokens), tuple(state.hasher(tokens)), session)
    request_id = incoming.request_id or request_id_of(None)
    record = state.explain.begin(request_id, endpoint, session, prompt.hashes, tokens)
    token = CURRENT.set(record)
    try:
        return await _serve(state, incoming, endpoint, data, tokens, prompt, max_tokens)
    finally:
        CURRENT.reset(token)
        state.explain.end(record)


async def _serve(
    state: GatewayState,
    incoming: Incoming,
    endpoint: str,
    data: dict[str, Any],
    tokens: list[int],
    prompt: Prompt,
    max_tokens: int | None,
) -> Response:
    session = prompt.session
    pair = pd_pair_for(state, incoming)
    headers = {SESSION_HEADER: session} if session else {}
    if incoming.request_id:  # forwarded: the instance's logs can name it
        headers[REQUEST_ID] = incoming.request_id
    pinned = pinned_instance(state, incoming)  # a bad header is refused before taking a slot
    try:
        await state.admission.acquire()
    except GatewayError as exc:
        state.metrics.rejections.labels(exc.code or "saturated").inc()
        raise
    if pair is not None:
        release = once(state.admission.release)
        try:
            return await state.pd_flow.serve(
                pair, endpoint, data, tokens, prompt, max_tokens, release, incoming.client_gone
            )
        except BaseException:
            release()
            raise
    pool = [pinned] if pinned is not None else state.instances.peers()

    async def choose(n: int, exclude: set[str]) -> Attempt:
        reason = "pinned" if pinned is not None else None
        attempt = await state.selector.attempt(pool, prompt, exclude, reason)
        if session:
            state.sessions.remember(session, tokens, attempt.instance.name)
        return attempt

    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    release = once(state.admission.release)
    return await state.proxy.forward(choose, path, data, headers, release, endpoint, incoming.raw)
