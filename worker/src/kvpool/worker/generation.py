"""One request's generation: engine token events in, text deltas and usage out.

Why this module exists: both OpenAI endpoints, streaming or not, turn the engine's token
stream into text the same way: incremental detokenization, stop strings cut by the runtime
(the engine knows token ids only), the stop token itself never rendered, and the engine
request aborted as soon as the runtime has what it needs (a stop string, a client gone).
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field

from kvpool.protocol.chat import TextTokenizer
from kvpool.worker.engine_api import Engine, GenerationRequest, TokenEvent
from kvpool.worker.tokenizer import TextStream


@dataclass
class Outcome:
    """What the engine reported about one request, filled in while streaming."""

    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    ttft_s: float | None = None
    first_token: int | None = None  # id of the first generated token (PD: first_tok)
    token_ids: list[int] = field(default_factory=list)  # every generated id, stop id included


@dataclass(frozen=True)
class Delta:
    text: str
    finish_reason: str | None = None


async def generate_text(
    engine: Engine,
    tokenizer: TextTokenizer,
    request: GenerationRequest,
    stop: list[str],
    outcome: Outcome,
    on_first_token: Callable[[float], None] | None = None,
    on_token: Callable[[], None] | None = None,
) -> AsyncGenerator[Delta, None]:
    """Yield text deltas; the last one carries ``finish_reason``.

    Raises ``EngineError`` before the first delta if the engine refuses the request.
    """
    started = time.monotonic()
    stream = TextStream(tokenizer, stop)
    events = engine.generate(request)
    finished = False
    try:
        async for event in events:
            if outcome.ttft_s is None:
                outcome.ttft_s = time.monotonic() - started
                if on_first_token is not None:
                    on_first_token(outcome.ttft_s)
            _account(outcome, event)
            if on_token is not None and event.token_id >= 0:
                on_token()
            text = "" if _silent(event) else stream.push(event.token_id)
            if stream.stopped:
                finished = True
                outcome.finish_reason = "stop"
                yield Delta(text, "stop")
                return
            if event.finished:
                finished = True
                outcome.finish_reason = event.finish_reason or "stop"
                yield Delta(text + stream.finish(), outcome.finish_reason)
                return
            if text:
                yield Delta(text)
        finished = True  # the engine ended the stream without a final event
        outcome.finish_reason = outcome.finish_reason or "abort"
        yield Delta(stream.finish(), outcome.finish_reason)
    finally:
        if not finished:
            outcome.finish_reason = outcome.finish_reason or "abort"
        # Closing the engine's stream aborts the request there (a stop string, a client
        # that went away, or the end of a finished stream: then it is a no-op).
        close = getattr(events, "aclose", None)
        if close is not None:
            await close()


def _silent(event: TokenEvent) -> bool:
    """The token that ended a request on a stop id/EOS, or an abort marker: not text."""
    return event.token_id < 0 or (event.finished and event.finish_reason in ("stop", "abort"))


def _account(outcome: Outcome, event: TokenEvent) -> None:
    if event.token_id >= 0:
        outcome.completion_tokens += 1
        outcome.token_ids.append(event.token_id)
        if outcome.first_token is None:
            outcome.first_token = event.token_id
    if event.num_prompt_tokens:
        outcome.prompt_tokens = event.num_prompt_tokens
    outcome.cached_tokens = max(outcome.cached_tokens, event.num_cached_tokens)
