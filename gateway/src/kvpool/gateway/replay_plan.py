"""What a replay sends: a trace's selected requests, their prompts, and one job each.

Why this module exists: ``kvpool-gateway replay`` and the benchmarks that drive an endpoint with
a trace need the same steps between a trace and the wire — read or generate the trace and pick
its window, build Mooncake prompts from hash ids (checked against the block size before anything
is sent), and turn each request into a :class:`~kvpool.gateway.loadgen.Job` due at its scaled
arrival time, with the body an OpenAI endpoint expects (``/v1/completions`` with ``max_tokens``
= ``output_length`` and ``ignore_eos`` for a Mooncake row; ``/v1/chat/completions`` with the
conversation for an agent-trace turn). Pure apart from reading (and, asked to, writing) the trace.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from kvpool.gateway.loadgen import Job
from kvpool.gateway.traces import (
    MOONCAKE_BLOCK_TOKENS,
    AgentRequest,
    BlockPromptBuilder,
    PromptError,
    TokenizerLike,
    TraceError,
    TraceRequest,
    Vocabulary,
    Window,
    config_from_spec,
    detect_format,
    generate,
    mooncake,
    read_agent,
    read_mooncake,
    trace_stats,
)
from kvpool.gateway.traces import agent as agent_trace

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@dataclass(frozen=True)
class Loaded:
    """The selected requests of a trace and where they came from."""

    source: str
    format: str  # "mooncake" | "agent"
    requests: Sequence[TraceRequest | AgentRequest]


def load_trace(spec: str, fmt: str = "auto", window: Window | None = None) -> Loaded:
    """A trace file (``fmt`` auto: from its first row) or ``agent[:key=value,...]`` (generated),
    ``window`` applied. TraceError or ValueError (a bad agent spec) otherwise."""
    win = window or Window()
    if spec == "agent" or spec.startswith("agent:"):
        reqs = agent_trace.windowed(generate(config_from_spec(spec.partition(":")[2])), win)
        if not reqs:
            raise TraceError(spec, None, "no request in the window")
        return Loaded(spec, "agent", reqs)
    fmt = detect_format(spec) if fmt == "auto" else fmt
    if fmt == "mooncake":
        return Loaded(spec, fmt, read_mooncake(spec, win))
    return Loaded(spec, fmt, read_agent(spec, win))


def prompt_builder(
    loaded: Loaded, tokenizer: TokenizerLike, block_size: int = MOONCAKE_BLOCK_TOKENS, seed: int = 0
) -> BlockPromptBuilder | None:
    """The prompt builder of a Mooncake trace (None for an agent trace), every request checked
    against its block size first: TokenizerError for an unsuitable tokenizer, TraceError naming
    the line of a request whose hash ids do not fit its length."""
    if loaded.format != "mooncake":
        return None
    builder = BlockPromptBuilder(Vocabulary.from_tokenizer(tokenizer), block_size, seed)
    for req in loaded.requests:
        assert isinstance(req, TraceRequest)
        try:
            builder.check(req.hash_ids, req.input_length)
        except PromptError as exc:
            raise TraceError(loaded.source, req.line, str(exc)) from None
    return builder


def save_trace(loaded: Loaded, path: Path) -> None:
    """The selected requests as a file of the trace's format (OSError when it cannot)."""
    with path.open("w", encoding="utf-8") as fp:
        for req in loaded.requests:
            if isinstance(req, TraceRequest):
                fp.write(mooncake.dump_row(req) + "\n")
            else:
                fp.write(agent_trace.dump_row(req) + "\n")


def trace_figures(loaded: Loaded, block_size: int = MOONCAKE_BLOCK_TOKENS) -> dict[str, Any]:
    """Size and span of the selection; for a Mooncake trace its :func:`trace_stats` too."""
    reqs = loaded.requests
    out: dict[str, Any] = {
        "source": loaded.source,
        "format": loaded.format,
        "requests": len(reqs),
        "span_s": max(r.arrival_s for r in reqs) - min(r.arrival_s for r in reqs),
    }
    moon = [r for r in reqs if isinstance(r, TraceRequest)]
    if moon:
        out.update(dataclasses.asdict(trace_stats(moon, block_size)))
    else:
        out["sessions"] = len({r.session for r in reqs})
    return out


def make_jobs(
    loaded: Loaded,
    builder: BlockPromptBuilder | None,
    model: str,
    time_scale: float = 1.0,
    token_ids: bool = False,
) -> list[Job]:
    """One job per request, due at (arrival − first arrival) / ``time_scale``, in due order;
    prompts are built when a job is sent (text, or token ids with ``token_ids``)."""
    reqs = sorted(loaded.requests, key=lambda r: (r.arrival_s, r.index))
    origin = reqs[0].arrival_s
    jobs = []
    for r in reqs:
        at = (r.arrival_s - origin) / time_scale
        if isinstance(r, TraceRequest):
            assert builder is not None
            body = _completion_body(builder, r, model, token_ids)
            jobs.append(Job(r.index, at, COMPLETIONS, body, trace_prompt_tokens=r.input_length))
        else:
            jobs.append(Job(r.index, at, CHAT, _chat_body(r, model), session=r.session))
    return jobs


def _chat_body(r: AgentRequest, model: str) -> Callable[[], bytes]:
    def body() -> bytes:
        return msgspec.json.encode(r.body(model))

    return body


def _completion_body(
    builder: BlockPromptBuilder, r: TraceRequest, model: str, token_ids: bool
) -> Callable[[], bytes]:
    def body() -> bytes:
        prompt: str | list[int] = (
            builder.token_ids(r.hash_ids, r.input_length)
            if token_ids
            else builder.text(r.hash_ids, r.input_length)
        )
        return msgspec.json.encode(
            {
                "model": model,
                "prompt": prompt,
                "max_tokens": max(1, r.output_length),  # the API has no zero-token answer
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        )

    return body
