"""Traces kvpool replays and simulates: Mooncake-format hash-id traces and kvpool's agent trace.

Why this package exists: the load generator (``kvpool-gateway replay``), the gateway benchmark
and the fleet simulator must read the same traces the same way and build the same prompts from
them. Pure apart from reading the trace file.

- :mod:`.jsonl`: what every format shares: streaming rows, :class:`Window`, :class:`TraceError`.
- :mod:`.mooncake`: :class:`TraceRequest` (frozen: arrival seconds, input/output lengths, hash
  ids, session), :func:`iter_mooncake` / :func:`read_mooncake` with a :class:`Window`,
  :func:`trace_stats`.
- :mod:`.agent`: the agent trace (tenants, sessions, turns), generated from a
  :class:`TraceConfig` or read from JSONL (:func:`read_agent`).
- :mod:`.blocks`: :class:`BlockPromptBuilder`, hash ids to text and token ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from kvpool.gateway.traces.agent import (
    AgentRequest,
    TraceConfig,
    config_from_spec,
    generate,
    iter_agent,
    read_agent,
)
from kvpool.gateway.traces.blocks import (
    BlockPromptBuilder,
    PromptError,
    TokenizerError,
    TokenizerLike,
    Vocabulary,
)
from kvpool.gateway.traces.jsonl import TraceError, Window, iter_rows
from kvpool.gateway.traces.mooncake import (
    MOONCAKE_BLOCK_TOKENS,
    TraceRequest,
    TraceStats,
    iter_mooncake,
    read_mooncake,
    trace_stats,
)

TraceFormat = Literal["mooncake", "agent"]

__all__ = [
    "MOONCAKE_BLOCK_TOKENS",
    "AgentRequest",
    "BlockPromptBuilder",
    "PromptError",
    "TokenizerError",
    "TokenizerLike",
    "TraceConfig",
    "TraceError",
    "TraceFormat",
    "TraceRequest",
    "TraceStats",
    "Vocabulary",
    "Window",
    "config_from_spec",
    "detect_format",
    "generate",
    "iter_agent",
    "iter_mooncake",
    "read_agent",
    "read_mooncake",
    "trace_stats",
]


def detect_format(path: str | Path) -> TraceFormat:
    """The format of a trace file, from its first row: ``hash_ids`` → Mooncake, ``messages`` →
    agent; a TraceError otherwise."""
    for _, line, raw in iter_rows(path):
        try:
            row = json.loads(raw)
        except ValueError as exc:
            raise TraceError(str(path), line, f"not JSON ({exc})") from None
        if isinstance(row, dict) and "hash_ids" in row:
            return "mooncake"
        if isinstance(row, dict) and "messages" in row:
            return "agent"
        raise TraceError(
            str(path),
            line,
            "neither a Mooncake row (timestamp, input_length, output_length, hash_ids) nor an "
            "agent-trace row (session, turn, messages, max_tokens)",
        )
    raise TraceError(str(path), None, "empty: no row to read")
