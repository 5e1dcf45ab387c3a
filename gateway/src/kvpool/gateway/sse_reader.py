"""Reading an OpenAI-compatible SSE stream as it arrives, cheaply: the replay client's reader.

Why this module exists: the load generator (:mod:`kvpool.gateway.loadgen`) must measure TTFT
and tokens per request without becoming the bottleneck itself, so a stream is fed as raw
chunks, split into SSE ``data:`` lines, and each event decoded by a msgspec struct that reads
only ``choices[].text`` / ``delta.content`` (and ``reasoning_content``), ``finish_reason``,
``usage`` and ``error``: :class:`SseReader` says when the first content arrived and what the
stream carried. Pure: no I/O.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = ["SseReader"]


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_tokens_details: _Details | None = None


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None


class _Choice(msgspec.Struct):
    text: str | None = None
    delta: _Delta | None = None
    message: _Delta | None = None  # a non-streamed chat answer
    finish_reason: str | None = None


class _Event(msgspec.Struct):
    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    error: Any = None  # OpenAI's {"message", "type", "code"}, or a bare string


_EVENT = msgspec.json.Decoder(_Event)


def _has_content(ev: _Event) -> bool:
    for c in ev.choices or ():
        if c.text:
            return True
        d = c.delta or c.message
        if d is not None and (d.content or d.reasoning_content):
            return True
    return False


class SseReader:
    """Incremental reader of an OpenAI SSE stream: feed raw chunks as they arrive."""

    __slots__ = (
        "_buf", "_text", "content_events", "done", "error", "events", "finish_reason", "usage"
    )  # fmt: skip

    def __init__(self, keep_text: bool = False) -> None:
        self._buf = b""
        self.events = 0
        self.content_events = 0
        self.usage: _Usage | None = None
        self.error: str | None = None
        self.done = False
        self.finish_reason: str | None = None
        self._text: list[str] | None = [] if keep_text else None

    @property
    def text(self) -> str | None:
        """The content so far (None unless built with ``keep_text``)."""
        return None if self._text is None else "".join(self._text)

    def feed(self, chunk: bytes) -> bool:
        """Take ``chunk``; True when it held the stream's first content."""
        lines = (self._buf + chunk).split(b"\n") if self._buf else chunk.split(b"\n")
        self._buf = lines.pop()
        first = False
        for line in lines:
            if line[:5] != b"data:":
                continue  # blank separator, comment, event:/id: field
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
                continue
            self.events += 1
            if self._event(payload):
                first = True
        return first

    def _event(self, payload: bytes) -> bool:
        """Take one event's JSON; True when it is the first with content."""
        try:
            ev = _EVENT.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.error = self.error or "bad_event"
            return False
        if ev.error is not None:
            self.error = self.error or f"stream_{_error_code(ev.error)}"
        if ev.usage is not None:
            self.usage = ev.usage
        for c in ev.choices or ():
            self.finish_reason = c.finish_reason or self.finish_reason
            if self._text is not None:
                d = c.delta or c.message
                self._text.append(c.text or (d.content or "" if d is not None else ""))
        if not _has_content(ev):
            return False
        self.content_events += 1
        return self.content_events == 1

    def finish(self) -> None:
        """The stream ended: a last line without its newline is still an event."""
        if self._buf:
            rest, self._buf = self._buf, b""
            self.feed(rest + b"\n")


def _error_code(err: Any) -> str:
    if isinstance(err, dict):
        code = err.get("code") or err.get("type")
        if isinstance(code, str) and code.isidentifier():
            return code
    return "error"
