"""OpenAI request models and response shapes for the worker's API.

Why this module exists: what crosses the HTTP boundary is validated once, here, with the
ranges OpenAI documents (temperature 0–2, top_p in (0, 1], at most 4 stop strings...), so a
bad request becomes a 400 naming the field instead of an engine error deep in a step. Unknown
fields are ignored like OpenAI does; known-but-unsupported options (n > 1, logprobs,
penalties) are refused rather than silently ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvpool.protocol.chat import content_text
from kvpool.protocol.http_api import error_body

MAX_STOP_STRINGS = 4
MAX_STOP_TOKEN_IDS = 64


class OpenAIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type_

    def body(self) -> dict[str, Any]:
        return error_body(self.message, param=self.param, code=self.code, type_=self.type)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """The fields completions and chat share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=1, description="only one choice per request")
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logprobs: Any = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list):
            if len(value) > MAX_STOP_STRINGS:
                raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
            if any(not s for s in value):
                raise ValueError("stop strings must not be empty")
        elif value == "":
            raise ValueError("stop strings must not be empty")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(t < 0 for t in value):
            raise ValueError("stop_token_ids must be non-negative token ids")
        return value

    @model_validator(mode="after")
    def _unsupported(self) -> _SamplingRequest:
        if self.presence_penalty or self.frequency_penalty:
            raise ValueError("presence_penalty and frequency_penalty are not supported; send 0")
        if self.logprobs not in (None, False, 0):
            raise ValueError("logprobs are not supported by this worker; omit the field")
        return self

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int = Field(default=16, ge=1)
    echo: bool = False
    # PD prefill (lmcache's disaggregated-prefill proxy): ret_first_tok and disagg_spec.
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's extension: the choice also carries prompt_token_ids and token_ids (not streamed).
    return_token_ids: bool = False

    @model_validator(mode="after")
    def _no_echo(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported by this worker; omit the field")
        return self


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """Plain text of the message; content parts must be text parts."""
        return content_text(self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    add_generation_prompt: bool = True

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt or messages")
        return self


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
