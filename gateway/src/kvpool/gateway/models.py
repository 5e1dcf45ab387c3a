"""What the gateway reads of an OpenAI request body, validated at the boundary.

Why this module exists: the gateway forwards the client's body as it came (the worker is the
authority on sampling options), but it must read a few fields to route — the prompt or the
messages, ``stream``, ``user``, ``max_tokens`` — and a body whose fields are of the wrong
type is a 400 naming the field here, before any instance is bothered.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvpool.protocol.chat import content_text

MAX_SESSION_ID = 256


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    stream: bool = False
    user: str | None = Field(default=None, max_length=MAX_SESSION_ID)
    max_tokens: int | None = Field(default=None, ge=1)


class CompletionBody(_Body):
    prompt: str | list[int] | list[str] | list[list[int]]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, p: str | list[Any]) -> str | list[Any]:
        if isinstance(p, list) and p and isinstance(p[0], (str, list)) and len(p) != 1:
            raise ValueError("send one prompt per request (batches are not supported)")
        return p


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """Plain text of the message (text content parts joined), as the worker reads it."""
        return content_text(self.content)


class ChatBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    add_generation_prompt: bool = True

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def session_of(header: str | None, user: str | None) -> str | None:
    """``x-session-id`` wins over the OpenAI ``user`` field; empty means none."""
    for value in (header, user):
        if value:
            return value[:MAX_SESSION_ID]
    return None
