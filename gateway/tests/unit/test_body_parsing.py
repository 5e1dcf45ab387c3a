"""What a client's body or key can hold that must be a 4xx, never a 500 (deps.parse_object,
deps.same_secret): found by the fuzz test (tests/app/test_fuzz.py), pinned here one by one."""

from __future__ import annotations

import pytest

from kvpool.gateway.deps import parse_object, same_secret
from kvpool.gateway.errors import GatewayError


def _deep(n: int) -> bytes:
    return b'{"prompt": ' + b"[" * n + b"1" + b"]" * n + b"}"


@pytest.mark.parametrize(
    ("raw", "said"),
    [
        (_deep(5000), "nested too deeply"),
        (b'{"prompt": [1e999999, ' + b"[" * 5000 + b"]" * 5000 + b"]}", "nested too deeply"),
        (b'{"prompt": "\\ud800"}', "lone UTF-16 surrogate"),
        (b'{"messages": [{"role": "user", "content": "a\\udfffb"}]}', "lone UTF-16 surrogate"),
        (b'{"prompt": "abc"', "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
    ],
)
def test_bodies_no_decoder_or_tokenizer_can_take_are_a_400_naming_why(
    raw: bytes, said: str
) -> None:
    with pytest.raises(GatewayError) as err:
        parse_object(raw)
    assert err.value.status == 400 and err.value.code == "invalid_json"
    assert said in err.value.message


def test_what_json_allows_still_parses() -> None:
    assert parse_object(_deep(50))["prompt"][0][0]
    assert parse_object(b'{"prompt": "\\ud83d\\ude00"}') == {"prompt": "\U0001f600"}
    big = parse_object(b'{"prompt": [99999999999999999999], "x": NaN}')  # msgspec refuses both
    assert big["prompt"] == [99999999999999999999]


def test_keys_compare_whatever_characters_a_header_holds() -> None:
    assert same_secret("k", "k") and not same_secret("k", "K")
    assert not same_secret("d\u00e9j\u00e0", "key")  # hmac.compare_digest on str: TypeError
    assert same_secret("d\u00e9j\u00e0", "d\u00e9j\u00e0")
