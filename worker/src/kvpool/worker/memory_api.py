"""The agent memory API: evict, prefetch, pin and unpin KV by session, prefix or chunk hash.

Why this module exists: an agent framework knows things the cache does not (this session is
over, that document will be needed in a minute, this system prompt must stay hot). LMCache-
Ascend exposes ``/memory/evict`` and ``/memory/prefetch`` on its internal API server; the
worker offers the same verbs (plus pin/unpin and stats) on its own port and maps them to the
Engine's methods. It is internal: the gateway forwards to it over the pod network, and the
chart exposes only the gateway.

Sessions: a request names its session with the ``X-Session-Id`` header or, failing that,
the OpenAI ``user`` field. The worker remembers the prompt tokens of each session's latest
request (a bounded LRU), so ``{"session_id": ...}`` selects exactly that prefix.
"""

from __future__ import annotations

import logging
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvpool.protocol.chat import ChatMessage, TextTokenizer
from kvpool.protocol.http_api import MAX_SESSION_ID
from kvpool.worker.engine_api import Engine
from kvpool.worker.openai_models import ChatMessageIn, OpenAIError

logger = logging.getLogger(__name__)

DEFAULT_SESSION_TOKENS = 16_000_000  # 64 MB of token ids at most
_SELECTORS = ("session_id", "token_ids", "text", "messages", "chunk_hashes")


class SessionStore:
    """session id → prompt tokens of its latest request, least recently used evicted first.

    Bounded twice: by the number of sessions and by the tokens held (4 bytes each), so a
    worker with many long agent sessions keeps at most ``max_tokens * 4`` bytes here.
    """

    def __init__(self, capacity: int, max_tokens: int = DEFAULT_SESSION_TOKENS) -> None:
        self.capacity = capacity
        self.max_tokens = max_tokens
        self._items: OrderedDict[str, array[int]] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    def remember(self, session_id: str, token_ids: Sequence[int]) -> None:
        tokens = array("i", token_ids)
        with self._lock:
            old = self._items.pop(session_id, None)
            self._tokens -= len(old) if old is not None else 0
            self._items[session_id] = tokens
            self._tokens += len(tokens)
            while len(self._items) > self.capacity or (
                self._tokens > self.max_tokens and len(self._items) > 1
            ):
                dropped, held = self._items.popitem(last=False)
                self._tokens -= len(held)
                logger.debug("session %s forgotten (LRU)", dropped)

    def get(self, session_id: str) -> tuple[int, ...] | None:
        with self._lock:
            tokens = self._items.get(session_id)
            if tokens is None:
                return None
            self._items.move_to_end(session_id)
            return tuple(tokens)

    def forget(self, session_id: str) -> None:
        with self._lock:
            old = self._items.pop(session_id, None)
            self._tokens -= len(old) if old is not None else 0

    @property
    def tokens(self) -> int:
        return self._tokens

    def __len__(self) -> int:
        return len(self._items)


class PrefixSelector(BaseModel):
    """Exactly one way to name a prefix: a session, token ids, text, or chat messages."""

    model_config = ConfigDict(extra="ignore")

    session_id: str | None = Field(default=None, min_length=1, max_length=MAX_SESSION_ID)
    token_ids: list[int] | None = Field(default=None, min_length=1)
    text: str | None = Field(default=None, min_length=1)
    messages: list[ChatMessageIn] | None = Field(default=None, min_length=1)

    def _options(self) -> list[str]:
        return [n for n in _SELECTORS if n in type(self).model_fields]

    def _given(self) -> list[str]:
        return [n for n in self._options() if getattr(self, n) is not None]

    @model_validator(mode="after")
    def _exactly_one(self) -> PrefixSelector:
        given = self._given()
        if len(given) != 1:
            raise ValueError(
                f"name the KV with exactly one of {', '.join(self._options())} "
                f"(got {', '.join(given) or 'none'})"
            )
        return self


class EvictRequest(PrefixSelector):
    chunk_hashes: list[int] | None = Field(default=None, min_length=1)
    tiers: list[str] | None = Field(default=None, min_length=1)


def build_memory_router(
    engine: Engine, tokenizer: TextTokenizer, sessions: SessionStore
) -> APIRouter:
    router = APIRouter(prefix="/memory", tags=["memory (internal, pod network only)"])

    def tokens_of(sel: PrefixSelector) -> list[int]:
        if sel.session_id is not None:
            tokens = sessions.get(sel.session_id)
            if tokens is None:
                raise OpenAIError(
                    f"session {sel.session_id!r} is unknown to this worker (never seen, or "
                    f"forgotten after {sessions.capacity} newer sessions)",
                    status=404,
                    param="session_id",
                    code="session_not_found",
                    type_="not_found_error",
                )
            return list(tokens)
        if sel.token_ids is not None:
            return list(sel.token_ids)
        if sel.text is not None:
            return tokenizer.encode(sel.text)
        assert sel.messages is not None
        try:
            msgs = [ChatMessage(m.role, m.text()) for m in sel.messages]
            return tokenizer.chat_token_ids(msgs)
        except ValueError as exc:
            raise OpenAIError(str(exc), param="messages") from exc

    @router.post("/evict")
    async def evict(body: EvictRequest) -> dict[str, Any]:
        tokens = None if body.chunk_hashes is not None else tokens_of(body)
        try:
            n = await engine.evict(
                token_ids=tokens, chunk_hashes=body.chunk_hashes, locations=body.tiers
            )
        except ValueError as exc:  # e.g. a tier this worker does not have
            raise OpenAIError(str(exc), param="tiers" if body.tiers else None) from exc
        if body.session_id is not None:
            sessions.forget(body.session_id)
        logger.info("memory evict %s from %s: %d chunks", body._given(), body.tiers or "all", n)
        return {"evicted_chunks": n, "tiers": body.tiers}

    @router.post("/lookup")
    async def lookup(body: PrefixSelector) -> dict[str, Any]:
        """What this worker holds of a prefix now, whatever the controller indexes (the
        gateway asks a refused instance this when it explains a miss)."""
        tokens = tokens_of(body)
        return {"prefix_tokens": len(tokens), "cached_tokens": await engine.lookup(tokens)}

    @router.post("/prefetch")
    async def prefetch(body: PrefixSelector) -> dict[str, Any]:
        tokens = tokens_of(body)
        n = await engine.prefetch(tokens)
        return {"prefix_tokens": len(tokens), "resident_tokens": n}

    @router.post("/pin")
    async def pin(body: PrefixSelector) -> dict[str, Any]:
        tokens = tokens_of(body)
        return {"prefix_tokens": len(tokens), "pinned_tokens": await engine.pin(tokens)}

    @router.post("/unpin")
    async def unpin(body: PrefixSelector) -> dict[str, Any]:
        tokens = tokens_of(body)
        return {"prefix_tokens": len(tokens), "unpinned_tokens": await engine.unpin(tokens)}

    @router.get("/stats")
    async def stats() -> dict[str, Any]:
        return {"engine": engine.memory_stats(), "sessions": len(sessions)}

    return router
