"""The pure core of "why did this request miss?": each reason from its facts, their order of
certainty, runs folded, and the bounded records the facts come from (prompt history by chunk,
eviction ring)."""

from __future__ import annotations

from kvpool.gateway.misses import (
    ChunkFacts,
    Divergence,
    Eviction,
    PoolFacts,
    Refused,
    Sent,
    classify,
)
from kvpool.gateway.recent import EvictionLog, PromptHistory

CS = 4
T = 1000.0  # when the explained request was routed


def pool(**kw: object) -> PoolFacts:
    return PoolFacts(routed_at=T, chunk_size=CS, **kw)  # type: ignore[arg-type]


def reasons(runs: list) -> list[tuple[int, int, str]]:
    return [(r.first, r.last, r.reason) for r in runs]


def test_an_eviction_before_routing_is_the_reason_and_names_instance_tier_and_time() -> None:
    facts = [
        ChunkFacts(2, [Sent("r1", "w0", T - 30)], [Eviction("w0~fp", "LocalCPUBackend", T - 5)])
    ]
    (run,) = classify(facts, pool())
    assert run.reason == "evicted"
    assert "w0~fp (LocalCPUBackend)" in run.detail and "5.0 s before" in run.detail
    assert run.facts["at"] == T - 5


def test_an_eviction_after_routing_does_not_explain_the_miss() -> None:
    facts = [ChunkFacts(0, [], [Eviction("w0~fp", "LocalCPUBackend", T + 1)])]
    assert classify(facts, pool())[0].reason == "never-stored"


def test_a_worker_gone_after_the_chunk_was_sent_there_is_an_eviction() -> None:
    facts = [ChunkFacts(0, [Sent("r1", "w0", T - 30)])]
    events = [Eviction("w0~fp", "", T - 10, "worker_down"), Eviction("w9~fp", "", T - 1, "clear")]
    (run,) = classify(facts, pool(instance_events=events))
    assert run.reason == "evicted" and "w0~fp's worker" in run.detail


def test_sent_to_a_frozen_instance_is_dropped_during_the_freeze_with_the_worker_s_count() -> None:
    facts = [ChunkFacts(0, [Sent("r1", "w0", T - 8, frozen=True)])]
    (run,) = classify(facts, pool(skipped_frozen_tokens={"w0": 512.0}))
    assert run.reason == "dropped-frozen"
    assert "frozen for a full sync" in run.detail and "512 prompt tokens" in run.detail


def test_sent_to_a_refused_instance_is_another_fingerprint() -> None:
    facts = [ChunkFacts(0, [Sent("r1", "w2", T - 8)])]
    refused = [Refused("w2~bad", "w2", "fingerprint mismatch")]
    (run,) = classify(facts, pool(refused=refused))
    assert run.reason == "other-fingerprint" and "w2~bad" in run.detail


def test_a_refused_instance_holding_the_prompt_is_another_fingerprint_even_if_never_sent() -> None:
    facts = [ChunkFacts(k) for k in range(3)]
    refused = [Refused("w2~bad", "w2", "fingerprint mismatch")]
    runs = classify(facts, pool(refused=refused, holds={"w2": 2 * CS}))
    assert reasons(runs) == [(0, 1, "other-fingerprint"), (2, 2, "never-stored")]
    assert "w2 holds 8 tokens" in runs[0].detail


def test_an_instance_holding_what_the_index_lacks_hashes_in_another_regime() -> None:
    sent = [Sent("r1", "w3", T - 8)]
    facts = [ChunkFacts(0, sent), ChunkFacts(1, sent)]
    runs = classify(facts, pool(holds={"w3": CS}))  # its own lookup: the first chunk only
    assert reasons(runs) == [(0, 0, "other-fingerprint"), (1, 1, "not-indexed")]
    assert "another regime" in runs[0].detail and runs[0].facts["holds_tokens"] == CS


def test_sent_and_held_now_is_not_yet_stored_and_sent_only_is_not_indexed() -> None:
    facts = [
        ChunkFacts(0, [Sent("r1", "w0", T - 0.2)], held_now=["w0"]),
        ChunkFacts(1, [Sent("r1", "w0", T - 0.2)]),
    ]
    assert reasons(classify(facts, pool())) == [(0, 0, "not-yet-stored"), (1, 1, "not-indexed")]


def test_requests_sent_after_routing_are_not_evidence() -> None:
    facts = [ChunkFacts(0, [Sent("r9", "w0", T + 3)])]
    assert classify(facts, pool())[0].reason == "never-stored"


def test_a_divergence_explains_every_unseen_chunk_from_its_token_on() -> None:
    d = Divergence("r1", "w0", T - 60, token=9, window_start=8, ours=(5, 6), theirs=(5, 7))
    facts = [ChunkFacts(k) for k in (2, 3, 4)]
    runs = classify(facts, pool(divergence=d))
    assert reasons(runs) == [(2, 4, "prompt-differs")]
    assert "differs at token 9" in runs[0].detail
    assert runs[0].facts["ours"] == [5, 6] and runs[0].facts["theirs"] == [5, 7]


def test_runs_fold_only_equal_neighbours() -> None:
    sent = [Sent("r1", "w0", T - 1, frozen=True)]
    facts = [ChunkFacts(0, sent), ChunkFacts(1, sent), ChunkFacts(2), ChunkFacts(3)]
    assert reasons(classify(facts, pool())) == [
        (0, 1, "dropped-frozen"),
        (2, 3, "never-stored"),
    ]


def test_prompt_history_shares_prefixes_and_finds_the_first_differing_token() -> None:
    h = PromptHistory(CS, max_bytes=8 * CS * 100)
    a = list(range(100, 112))  # 3 chunks
    b = [*a[:6], 999, *a[7:]]  # differs at token 6 (chunk 1)
    h.record(a, [1, 2, 3], Sent("ra", "w0", T - 10))
    h.record(a, [1, 2, 3], Sent("rb", "w1", T - 5))
    assert len(h) == 3  # the same prompt twice: one entry per chunk
    assert [s.request_id for s in h.sent(2)] == ["ra", "rb"]
    d = h.closest(b[4:8], parent=1, own=22, k=1, before=T)
    assert d is not None and d.token == 6 and d.request_id == "rb"
    assert d.ours[d.token - d.window_start] == 999
    assert d.theirs[d.token - d.window_start] == 106
    # a first chunk compares with the other first chunks
    c = [100, 101, 7, 7]
    d0 = h.closest(c, parent=None, own=11, k=0, before=T)
    assert d0 is not None and d0.token == 2
    # nothing sent before the request: no divergence
    assert h.closest(b[4:8], parent=1, own=22, k=1, before=T - 20) is None


def test_prompt_history_is_bounded_and_forgets_least_recently_used_chunks() -> None:
    h = PromptHistory(CS, max_bytes=8 * CS * 4)  # 4 chunks
    for i in range(10):
        h.record([i] * CS, [i], Sent(f"r{i}", "w0", T))
    assert len(h) == 4
    assert h.sent(0) == () and h.sent(9) != ()
    assert h.tokens(9) is not None and list(h.tokens(9) or []) == [9] * CS


def test_eviction_log_wraps_and_finds_by_hash() -> None:
    log = EvictionLog(capacity=5)
    log.evicted("w0~fp", "LocalCPUBackend", [1, 2, 3], T - 3)
    log.evicted("w1~fp", "LocalDiskBackend", [4, 5, 6, -7], T - 2)  # wraps; a negative hash
    assert len(log) == 5
    assert log.of(1) == [] and log.of(2) == []  # overwritten
    assert log.of(-7) == [Eviction("w1~fp", "LocalDiskBackend", T - 2)]
    assert [e.instance for e in log.of(3)] == ["w0~fp"]
    log.evicted("w0~fp", "LocalCPUBackend", list(range(100, 120)), T)  # more than it holds
    assert len(log) == 5 and log.of(119) and not log.of(114)
