"""What the gateway reads of an OpenAI request body, validated at the boundary.

Why this module exists: the gateway forwards the client's body as it came (the worker is the
authority on sampling options), but it must read a few fields to route — the prompt or the
messages, ``stream``, ``user``, ``max_tokens`` — and a body whose fields are of the wrong
type is a 400 naming the field here, before any instance is bothered.

The pydantic models say what is valid. Building one per request was a tenth of the gateway's
CPU for a short prompt, so :func:`completion_fields` and :func:`chat_fields` read the parsed
dict directly when every field the gateway reads already has exactly the type the model
requires (a text prompt, string roles, ...), which is what clients send; anything else — a
value pydantic would coerce or refuse, token-id prompts — goes through the model, so the
outcome and every 400's wording are the model's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvpool.protocol.chat import content_text
from kvpool.protocol.http_api import MAX_SESSION_ID, session_of

__all__ = [
    "MAX_SESSION_ID",
    "ChatBody",
    "ChatMessage",
    "CompletionBody",
    "Fields",
    "chat_fields",
    "completion_fields",
    "session_of",
]

Role = Literal["system", "user", "assistant", "tool", "developer"]
ROLES = frozenset(get_args(Role))


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
    role: Role
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


@dataclass(frozen=True, slots=True)
class Fields:
    """What the gateway reads of a valid body: ``prompt`` (completions: text, or token ids)
    or ``messages`` (chat: role and plain-text content), and the routing fields."""

    model: str | None
    user: str | None
    max_tokens: int | None
    prompt: str | list[Any] | None = None
    messages: list[dict[str, str]] | None = None
    add_generation_prompt: bool = True


def _plain_base(data: dict[str, Any]) -> bool:
    """Whether the fields of ``_Body`` are absent or of exactly their valid types."""
    model, user, max_tokens = data.get("model"), data.get("user"), data.get("max_tokens")
    return (
        (model is None or type(model) is str)
        and type(data.get("stream", False)) is bool
        and (user is None or (type(user) is str and len(user) <= MAX_SESSION_ID))
        and (max_tokens is None or (type(max_tokens) is int and max_tokens >= 1))
    )


def completion_fields(data: dict[str, Any]) -> Fields:
    """The fields of a completion body; a ``ValidationError`` for an invalid one."""
    prompt = data.get("prompt")
    if type(prompt) is str and _plain_base(data):
        return Fields(data.get("model"), data.get("user"), data.get("max_tokens"), prompt)
    body = CompletionBody.model_validate(data)
    return Fields(body.model, body.user, body.max_tokens, body.prompt)


def _plain_messages(messages: Any) -> list[dict[str, str]] | None:
    """Role and content of every message when each is a dict with a known role and text or
    null content; None otherwise (the model decides)."""
    if type(messages) is not list or not messages:
        return None
    out = []
    for m in messages:
        if type(m) is not dict:
            return None
        role, content = m.get("role"), m.get("content")
        if type(role) is not str or role not in ROLES:
            return None
        if content is None:
            content = ""
        elif type(content) is not str:
            return None
        out.append({"role": role, "content": content})
    return out


def chat_fields(data: dict[str, Any]) -> Fields:
    """The fields of a chat body; a ``ValidationError`` for an invalid one, a ``ValueError``
    for message content the gateway cannot read (non-text parts)."""
    max_completion = data.get("max_completion_tokens")
    generation = data.get("add_generation_prompt", True)
    messages = _plain_messages(data.get("messages"))
    if (
        messages is not None
        and _plain_base(data)
        and (max_completion is None or (type(max_completion) is int and max_completion >= 1))
        and type(generation) is bool
    ):
        wanted = max_completion or data.get("max_tokens")
        return Fields(data.get("model"), data.get("user"), wanted, None, messages, generation)
    body = ChatBody.model_validate(data)
    plain = [{"role": m.role, "content": m.text()} for m in body.messages]
    return Fields(
        body.model, body.user, body.requested_max_tokens(), None, plain, body.add_generation_prompt
    )
