"""The pool-wide agent memory API: evict, prefetch, pin and unpin KV across instances.

Why this module exists: an agent knows what the cache cannot (this session is over, that
document is needed next turn). Each worker offers ``/memory/{evict,prefetch,pin,unpin}`` for
its own KV (worker/src/kvpool/worker/memory_api.py); the gateway offers the same verbs for the
whole pool. It resolves what to act on (a session's latest prompt, token ids, text or chat
messages → token ids; or chunk hashes) and where (one named instance, or every instance the
index says holds the prefix — for evict every ready instance, since the index may lag),
calls each worker with token ids, and reports per instance. Sessions are remembered here in a
bounded LRU: session id → the prompt tokens of its latest request and where it went.
"""

from __future__ import annotations

import asyncio
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvpool.gateway.instances import Instance

Action = Literal["evict", "prefetch", "pin", "unpin"]
MEMORY_TIMEOUT_S = 30.0
_SELECTORS = ("session_id", "token_ids", "text", "messages", "chunk_hashes")


@dataclass
class _Session:
    tokens: array[int]
    instances: set[str] = field(default_factory=set)


class SessionMemory:
    """session id → latest prompt tokens and the instances it was sent to; LRU, bounded by
    sessions and by tokens held (4 bytes each)."""

    def __init__(self, capacity: int, max_tokens: int = 16_000_000) -> None:
        self.capacity = capacity
        self.max_tokens = max_tokens
        self._items: OrderedDict[str, _Session] = OrderedDict()
        self._tokens = 0

    def remember(self, session: str, tokens: Sequence[int], instance: str) -> None:
        old = self._items.pop(session, None)
        if old is not None:
            self._tokens -= len(old.tokens)
        entry = _Session(array("i", tokens), (old.instances if old else set()) | {instance})
        self._items[session] = entry
        self._tokens += len(entry.tokens)
        while len(self._items) > self.capacity or (
            self._tokens > self.max_tokens and len(self._items) > 1
        ):
            _, dropped = self._items.popitem(last=False)
            self._tokens -= len(dropped.tokens)

    def get(self, session: str) -> tuple[list[int], set[str]] | None:
        entry = self._items.get(session)
        if entry is None:
            return None
        self._items.move_to_end(session)
        return list(entry.tokens), set(entry.instances)

    def forget(self, session: str) -> None:
        old = self._items.pop(session, None)
        if old is not None:
            self._tokens -= len(old.tokens)

    def __len__(self) -> int:
        return len(self._items)


class MemoryRequest(BaseModel):
    """Exactly one selector; optionally one instance (default: the pool)."""

    model_config = ConfigDict(extra="forbid")

    session_id: str | None = Field(default=None, min_length=1, max_length=256)
    token_ids: list[int] | None = Field(default=None, min_length=1)
    text: str | None = Field(default=None, min_length=1)
    messages: list[dict[str, Any]] | None = Field(default=None, min_length=1)
    chunk_hashes: list[int] | None = Field(default=None, min_length=1)
    instance: str | None = Field(default=None, description="one instance; default the pool")
    tiers: list[str] | None = Field(default=None, min_length=1, description="evict only")

    def given(self) -> list[str]:
        return [n for n in _SELECTORS if getattr(self, n) is not None]

    @model_validator(mode="after")
    def _exactly_one(self) -> MemoryRequest:
        given = self.given()
        if len(given) != 1:
            raise ValueError(
                f"name the KV with exactly one of {', '.join(_SELECTORS)} "
                f"(got {', '.join(given) or 'none'})"
            )
        return self


async def call_worker(
    http: httpx.AsyncClient, inst: Instance, action: Action, body: dict[str, Any]
) -> dict[str, Any]:
    """One worker's answer, or what went wrong, as a JSON-able report."""
    try:
        resp = await http.post(f"{inst.url}/memory/{action}", json=body, timeout=MEMORY_TIMEOUT_S)
    except httpx.HTTPError as exc:
        return {"ok": False, "status": None, "error": f"{type(exc).__name__}: {exc}"}
    try:
        payload = resp.json()
    except ValueError:
        payload = {"raw": resp.text[:200]}
    if resp.status_code != 200:
        message = payload.get("error", {}).get("message") if isinstance(payload, dict) else None
        return {"ok": False, "status": resp.status_code, "error": message or str(payload)[:200]}
    return {"ok": True, "status": 200, "result": payload}


async def fan_out(
    http: httpx.AsyncClient, targets: Sequence[Instance], action: Action, body: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """Call every target concurrently; per instance name, its report."""
    reports = await asyncio.gather(*(call_worker(http, t, action, body) for t in targets))
    return {t.name: r for t, r in zip(targets, reports, strict=True)}
