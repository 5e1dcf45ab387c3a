"""The replay client's SSE reader (kvpool.gateway.sse_reader.SseReader) and Outcome arithmetic.

Streams arrive in arbitrary chunks: events split across chunks, several in one, CRLF line ends,
comments and other fields, usage in its own last event, an error event, a broken event.
"""

from __future__ import annotations

import json

from kvpool.gateway.loadgen import Outcome
from kvpool.gateway.sse_reader import SseReader


def ev(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


TEXT = {"choices": [{"index": 0, "text": "hi", "finish_reason": None}]}
CHAT = {"choices": [{"index": 0, "delta": {"content": "hi"}}]}
ROLE = {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}
USAGE = {"choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": 3,
                                  "prompt_tokens_details": {"cached_tokens": 64}}}  # fmt: skip


def feed_in_pieces(reader: SseReader, raw: bytes, size: int) -> list[bool]:
    return [reader.feed(raw[i : i + size]) for i in range(0, len(raw), size)]


def test_first_content_flagged_once_whatever_the_chunking() -> None:
    raw = ev(ROLE) + ev(CHAT) + ev(CHAT) + ev(CHAT) + ev(USAGE) + b"data: [DONE]\n\n"
    for size in (1, 7, 64, len(raw)):
        r = SseReader()
        flags = feed_in_pieces(r, raw, size)
        r.finish()
        assert flags.count(True) == 1
        assert (r.events, r.content_events, r.done, r.error) == (5, 3, True, None)
        assert r.usage is not None and r.usage.completion_tokens == 3
        assert r.usage.prompt_tokens_details is not None
        assert r.usage.prompt_tokens_details.cached_tokens == 64


def test_completion_text_crlf_comments_and_a_last_line_without_newline() -> None:
    r = SseReader()
    raw = b": keep-alive\r\n\r\nevent: message\r\n" + ev(TEXT).replace(b"\n", b"\r\n")
    assert r.feed(raw) is True
    r.feed(b"data: " + json.dumps(USAGE).encode())  # no newline yet
    assert r.usage is None
    r.finish()
    assert r.usage is not None and r.content_events == 1 and r.events == 2


def test_null_usage_and_empty_text_are_not_content() -> None:
    r = SseReader()
    r.feed(ev({"choices": [{"text": ""}], "usage": None}) + ev({"choices": None}))
    assert (r.events, r.content_events, r.usage) == (2, 0, None)
    assert r.feed(ev({"choices": [{"delta": {"reasoning_content": "hm"}}]})) is True


def test_error_and_broken_events() -> None:
    r = SseReader()
    r.feed(
        ev(CHAT) + ev({"error": {"message": "cut", "type": "bad_gateway", "code": "upstream_cut"}})
    )
    assert r.error == "stream_upstream_cut"
    r = SseReader()
    r.feed(b"data: {not json\n\n")
    assert r.error == "bad_event"
    r = SseReader()
    r.feed(ev({"error": "overloaded"}))
    assert r.error == "stream_error"


def test_outcome_lateness_and_tpot() -> None:
    o = Outcome(0, None, due_s=1.0, sent_s=1.25, ttft_s=0.5, e2e_s=2.5, output_tokens=5)
    assert o.lateness_s == 0.25
    assert o.tpot_s == (2.5 - 0.5) / 4
    assert Outcome(0, None, 0.0, 0.0, ttft_s=0.5, e2e_s=0.5, output_tokens=1).tpot_s is None
    assert Outcome(0, None, 0.0, 0.0, error="timeout").ok is False
