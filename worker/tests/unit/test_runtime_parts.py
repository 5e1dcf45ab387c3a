"""Pure parts of the worker runtime: request validation, sessions, metrics families, rates."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.registry import Collector
from pydantic import ValidationError

from kvpool.protocol.http_api import session_of
from kvpool.worker.memory_api import EvictRequest, PrefixSelector, SessionStore
from kvpool.worker.metrics import RateWindow, engine_families
from kvpool.worker.openai_models import ChatCompletionRequest, CompletionRequest, usage


def test_completion_defaults_and_unknown_fields_ignored() -> None:
    req = CompletionRequest.model_validate({"prompt": "hi", "logit_bias": {"1": 2}, "suffix": "x"})
    assert req.max_tokens == 16 and req.temperature == 1.0 and req.stop_strings() == []


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 2.01),
        ("temperature", -1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("max_tokens", 0),
        ("n", 3),
        ("presence_penalty", 3.0),
        ("presence_penalty", 0.5),  # in range but not supported: refused, not ignored
        ("logprobs", 5),
        ("echo", True),
        ("stop", ["a", "b", "c", "d", "e"]),
        ("stop", ""),
        ("stop_token_ids", [-1]),
    ],
)
def test_out_of_range_sampling_is_refused(field: str, value: Any) -> None:
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": "hi", field: value})


def test_chat_max_tokens_aliases() -> None:
    base = {"messages": [{"role": "user", "content": "hi"}]}
    assert ChatCompletionRequest.model_validate(base).requested_max_tokens() is None
    assert (
        ChatCompletionRequest.model_validate({**base, "max_tokens": 5}).requested_max_tokens() == 5
    )
    both = {**base, "max_tokens": 5, "max_completion_tokens": 7}
    assert ChatCompletionRequest.model_validate(both).requested_max_tokens() == 7


def test_chat_text_parts_are_joined_and_images_refused() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": parts}]})
    assert req.messages[0].text() == "ab"
    image = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
    )
    with pytest.raises(ValueError, match="text content"):
        image.messages[0].text()


def test_usage_shape() -> None:
    assert usage(10, 3, 8) == {
        "prompt_tokens": 10,
        "completion_tokens": 3,
        "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 8},
    }


def test_session_store_is_a_bounded_lru() -> None:
    store = SessionStore(capacity=2)
    store.remember("a", [1, 2])
    store.remember("b", [3])
    assert store.get("a") == (1, 2)  # touches a: b is now the oldest
    store.remember("c", [4])
    assert store.get("b") is None and store.get("a") == (1, 2) and store.get("c") == (4,)
    store.remember("a", [9])  # the latest prompt replaces the earlier one
    assert store.get("a") == (9,) and len(store) == 2
    store.forget("a")
    assert store.get("a") is None


def test_session_store_is_bounded_by_tokens_too() -> None:
    store = SessionStore(capacity=100, max_tokens=10)
    store.remember("a", [1] * 4)
    store.remember("b", [2] * 4)
    assert store.tokens == 8
    store.remember("c", [3] * 4)  # 12 > 10: the oldest session goes
    assert store.get("a") is None and store.tokens == 8 and len(store) == 2
    store.remember("huge", list(range(50)))  # alone over the budget: kept, others dropped
    assert len(store) == 1 and store.get("huge") == tuple(range(50))
    store.forget("huge")
    assert store.tokens == 0


def test_session_header_wins_over_user() -> None:
    assert session_of("hdr", "usr") == "hdr"
    assert session_of(None, "usr") == "usr"
    assert session_of("", None) is None
    assert session_of("x" * 1000, None) == "x" * 256


@pytest.mark.parametrize("body", [{}, {"text": "a", "session_id": "s"}, {"chunk_hashes": [1]}])
def test_prefix_selector_needs_exactly_one(body: dict[str, Any]) -> None:
    with pytest.raises(ValidationError, match="exactly one of"):
        PrefixSelector.model_validate(body)


def test_prefix_selector_refuses_empty_prefixes() -> None:
    for body in ({"token_ids": []}, {"text": ""}, {"session_id": ""}):
        with pytest.raises(ValidationError, match="at least 1"):
            PrefixSelector.model_validate(body)


def test_evict_accepts_chunk_hashes_and_tiers() -> None:
    req = EvictRequest.model_validate({"chunk_hashes": [1, 2], "tiers": ["local_disk"]})
    assert req.chunk_hashes == [1, 2] and req.tiers == ["local_disk"]
    with pytest.raises(ValidationError, match="chunk_hashes"):
        EvictRequest.model_validate({"chunk_hashes": [1], "text": "x"})


def test_rate_window_slides() -> None:
    now = [100.0]
    rate = RateWindow(window_s=10.0, clock=lambda: now[0])
    rate.add(30)
    now[0] = 105.0
    rate.add(20)
    assert rate.rate() == 5.0
    now[0] = 112.0  # the first batch left the window
    assert rate.rate() == 2.0
    now[0] = 200.0
    assert rate.rate() == 0.0


class _Fixed(Collector):
    def __init__(self, values: dict[str, float]) -> None:
        self.values = values

    def collect(self) -> Any:
        return engine_families(self.values)


def test_engine_metrics_become_families_with_tier_labels() -> None:
    registry = CollectorRegistry()
    registry.register(
        _Fixed(
            {
                "stored_bytes.local_cpu": 1024.0,
                "stored_bytes.redis": 512.0,
                "generated_tokens_total": 7.0,
                "kv-cache usage": 0.5,
            }
        )
    )
    text = generate_latest(registry).decode()
    assert 'kvpool_engine_stored_bytes{tier="local_cpu"} 1024.0' in text
    assert 'kvpool_engine_stored_bytes{tier="redis"} 512.0' in text
    assert "# TYPE kvpool_engine_generated_tokens_total counter" in text
    assert "kvpool_engine_generated_tokens_total 7.0" in text
    assert "kvpool_engine_kv_cache_usage 0.5" in text
