"""The gateway's session memory and memory-request validation (pure)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvpool.gateway.memory import MemoryRequest, SessionMemory


def test_sessions_are_bounded_by_count_and_tokens() -> None:
    mem = SessionMemory(capacity=3, max_tokens=100)
    for i in range(10):
        mem.remember(f"s{i}", [1] * 10, "a")
    assert len(mem) == 3 and mem.get("s0") is None
    mem.remember("big", [2] * 95, "b")  # over the token budget: older sessions go first
    assert mem.get("big") == ([2] * 95, {"b"})
    assert len(mem) == 1


def test_a_session_remembers_every_instance_it_went_to() -> None:
    mem = SessionMemory(capacity=10)
    mem.remember("s", [1, 2], "a")
    mem.remember("s", [1, 2, 3], "b")
    assert mem.get("s") == ([1, 2, 3], {"a", "b"})
    mem.forget("s")
    assert mem.get("s") is None


def test_exactly_one_selector() -> None:
    assert MemoryRequest(token_ids=[1]).given() == ["token_ids"]
    with pytest.raises(ValidationError, match="exactly one of"):
        MemoryRequest(token_ids=[1], text="x")
    with pytest.raises(ValidationError, match="exactly one of"):
        MemoryRequest()
    with pytest.raises(ValidationError, match="Extra inputs"):
        MemoryRequest(token_ids=[1], tier=["x"])  # type: ignore[call-arg]
