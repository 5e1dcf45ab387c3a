"""The HTTP strings and shapes shared by the gateway, the workers, the controller and the
operator's local runner: sessions and their bound, the validation-error wording, and the
prefix-lookup request and reply read back as the gateway reads them."""

from __future__ import annotations

from kvpool.protocol import http_api as h


def test_session_header_wins_empty_is_none_and_long_ids_are_cut() -> None:
    assert h.session_of("s", "u") == "s"
    assert h.session_of("", "u") == "u"
    assert h.session_of(None, None) is None
    assert h.session_of("x" * (h.MAX_SESSION_ID + 5), None) == "x" * h.MAX_SESSION_ID


def test_error_body_is_openai_s_shape() -> None:
    assert h.error_body("m", param="p", code="c") == {
        "error": {"message": "m", "type": "invalid_request_error", "param": "p", "code": "c"}
    }


def test_validation_errors_name_the_field_without_union_members() -> None:
    errors = [
        {"type": "string_type", "loc": ("body", "prompt", "str"), "msg": "Input should be a str"},
        {"type": "int_type", "loc": ("body", "max_tokens"), "msg": "x"},
    ]
    message, param, code = h.validation_error(errors)
    assert (param, code) == ("prompt", "invalid_value")
    assert message == "prompt: Input should be a str (and 1 more problem(s))"
    assert h.validation_error([{"type": "dict_type", "loc": ("body",), "msg": "m"}]) == (
        "the request body must be a JSON object",
        None,
        "invalid_value",
    )
    bad_json = [{"type": "json_invalid", "loc": ("body", 3), "ctx": {"error": "Expecting value"}}]
    assert h.validation_error(bad_json) == (
        "the request body is not valid JSON: Expecting value",
        None,
        "invalid_json",
    )
    indexed = [{"type": "int_type", "loc": ("body", "prompt_token_ids", 1), "msg": "m"}]
    assert h.validation_error(indexed)[1] == "prompt_token_ids.1"


def test_prefix_lookup_reply_reads_back_as_the_gateway_reads_it() -> None:
    worker = {"worker_id": 0, "url": "u", "peer_init_url": None, "holds_first_chunk": True}
    entry = h.prefix_lookup_entry(3, {"LocalCPUBackend": 3}, [worker])
    reply = h.prefix_lookup_reply(4, {"a~fp": entry, "b~fp": h.prefix_lookup_entry(0, {}, [])})
    assert h.prefix_lookup_request((1, 2)) == {"hashes": [1, 2]}
    assert reply["chunks"] == 4 and reply["instances"]["a~fp"]["workers"] == [worker]
    assert list(h.prefix_lookup_hits(reply)) == [
        ("a~fp", 3, {"LocalCPUBackend": 3}),
        ("b~fp", 0, {}),
    ]
    assert list(h.prefix_lookup_hits({})) == []


def test_stats_reply_keeps_the_latest_refused_ids_and_sorts_the_rest() -> None:
    refused = {f"x-{i}~bad": "fingerprint mismatch" for i in range(h.STATS_REFUSED_MAX + 3)}
    reply = h.stats_reply(
        {"b~f": 1, "a~f": 2}, 7, {"LocalCPUBackend": 9}, {"fingerprint": 30}, refused
    )
    assert list(reply["instances"]) == ["a~f", "b~f"]
    assert (reply["chunks"], reply["chunk_locations"]) == (7, {"LocalCPUBackend": 9})
    assert reply["refusals"] == {"fingerprint": 30}
    assert len(reply["refused"]) == h.STATS_REFUSED_MAX
    assert list(reply["refused"])[-1] == f"x-{h.STATS_REFUSED_MAX + 2}~bad"
