"""The completion routes read a body's fields from the parsed dict when every field already
has its valid type, and through the pydantic models otherwise: for any body the outcome
(the fields, or a refusal) is the models' (hypothesis)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from kvpool.gateway.models import (
    MAX_SESSION_ID,
    ChatBody,
    CompletionBody,
    Fields,
    chat_fields,
    completion_fields,
)

ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-2, 5),
    st.text(max_size=3),
    st.lists(st.integers(0, 9), max_size=2),
    st.just("true"),
    st.just(2.0),
)
USER = st.one_of(st.none(), st.text(max_size=3), st.just("u" * (MAX_SESSION_ID + 1)), st.just(7))
MESSAGE = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["user", "system", "assistant", "robot", 1]),
        "content": st.one_of(
            st.none(),
            st.text(max_size=5),
            st.just([{"type": "text", "text": "hi"}]),
            st.just([{"type": "image_url"}]),
            st.just(3),
        ),
    },
)


def _body(fields: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not ...}


def _expected(parse: Any, data: dict[str, Any]) -> Fields | type[Exception]:
    try:
        return parse(data)
    except ValidationError:
        return ValidationError
    except ValueError:
        return ValueError


def _model_completion(data: dict[str, Any]) -> Fields:
    b = CompletionBody.model_validate(data)
    return Fields(b.model, b.user, b.max_tokens, b.prompt)


def _model_chat(data: dict[str, Any]) -> Fields:
    b = ChatBody.model_validate(data)
    messages = [{"role": m.role, "content": m.text()} for m in b.messages]
    return Fields(
        b.model, b.user, b.requested_max_tokens(), None, messages, b.add_generation_prompt
    )


OPTIONAL = {"model": ANY, "stream": ANY, "user": USER, "max_tokens": ANY}


@settings(max_examples=400, deadline=None)
@given(
    st.fixed_dictionaries(
        {"prompt": st.one_of(st.text(max_size=4), ANY, st.just(["a", "b"]))}, optional=OPTIONAL
    )
)
def test_completion_fields_are_the_model_s(data: dict[str, Any]) -> None:
    assert _expected(completion_fields, data) == _expected(_model_completion, data)


@settings(max_examples=400, deadline=None)
@given(
    st.fixed_dictionaries(
        {"messages": st.one_of(st.lists(MESSAGE, max_size=3), ANY)},
        optional={**OPTIONAL, "max_completion_tokens": ANY, "add_generation_prompt": ANY},
    )
)
def test_chat_fields_are_the_model_s(data: dict[str, Any]) -> None:
    assert _expected(chat_fields, data) == _expected(_model_chat, data)


def test_a_plain_chat_body_is_read_without_the_model() -> None:
    data = {"messages": [{"role": "user", "content": "hi", "name": "x"}], "max_tokens": 3}
    assert chat_fields(data) == Fields(None, None, 3, None, [{"role": "user", "content": "hi"}])
    with pytest.raises(ValidationError):
        chat_fields({"messages": []})
