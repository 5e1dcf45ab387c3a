"""Token hashing matches LMCache's default ``ChunkedTokenDatabase``; registry decisions are pure."""

from __future__ import annotations

import pytest

from kvpool.controller.registry import Registry, SeqVerdict, check_fingerprint
from kvpool.controller.service import ControllerService
from kvpool.controller.settings import ControllerSettings
from kvpool.protocol.domain import split_instance_id


@pytest.mark.parametrize("n_tokens", [0, 1, 255, 256, 257, 1000])
def test_chunk_hashes_match_lmcache_default_token_database(n_tokens: int) -> None:
    from lmcache.v1.token_database import ChunkedTokenDatabase

    tokens = [(i * 7919) % 32000 for i in range(n_tokens)]
    theirs = [h for _, _, h in ChunkedTokenDatabase().process_tokens(tokens, make_key=False)]
    assert ControllerService(ControllerSettings()).token_hashes(tokens) == theirs


def test_fingerprint_parsing_and_verdicts() -> None:
    assert split_instance_id("pod~abc") == ("pod", "abc")
    assert split_instance_id("pod") == ("pod", None)
    assert check_fingerprint("pod~0123456789ab", "0123456789ab").accepted
    bad = check_fingerprint("pod~ffffffffffff", "0123456789ab")
    assert not bad.accepted and "expected '0123456789ab', got 'ffffffffffff'" in bad.reason
    assert check_fingerprint("pod", "0123456789ab").accepted
    assert not check_fingerprint("pod", "0123456789ab", require=True).accepted


def test_sequence_verdicts() -> None:
    reg = Registry()
    rec, known = reg.register("a", 0, "h", 1, None, 0.0)
    assert not known
    assert reg.check_seq(rec, "L", 5) is SeqVerdict.OK
    assert reg.check_seq(rec, "L", 6) is SeqVerdict.OK
    assert reg.check_seq(rec, "L", 6) is SeqVerdict.STALE
    assert reg.check_seq(rec, "L", 9) is SeqVerdict.GAP


def test_expired_and_instance_queries() -> None:
    reg = Registry()
    reg.register("a", 1, "h1", 1, None, 0.0)
    reg.register("a", 0, "h1", 2, None, 0.0)
    reg.register("b", 0, "h2", 3, None, 0.0)
    reg.heartbeat("b", 0, 50.0)
    assert {r.key for r in reg.expired(60.0, 30.0)} == {("a", 0), ("a", 1)}
    assert reg.worker_ids("a") == [0, 1]
    assert reg.instance_by_ip("h2") == "b"
    reg.deregister("a", 0)
    reg.deregister("a", 1)
    assert reg.instances() == ["b"]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"monitor_ports": {"reply": 1}}, "pull"),
        ({"monitor_ports": {"pull": 1, "bogus": 2}}, "bogus"),
        ({"fingerprint": "XYZ"}, "12 lowercase hex"),
        ({"require_fingerprint": True}, "no fingerprint"),
    ],
)
def test_settings_reject_bad_values_with_a_fix(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ControllerSettings(**kwargs)  # type: ignore[arg-type]


def test_fingerprint_env_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_DOMAIN_FINGERPRINT", "0123456789ab")
    assert ControllerSettings().fingerprint == "0123456789ab"
