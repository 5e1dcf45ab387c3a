"""The simulated engine's core: profiles, bounded tiers, scheduling and timing.

Each expectation follows from the model written in the simcore docstrings: a profile's numbers
give exact step times, tiers never exceed their capacity and evict least recently used first,
the scheduler is first come first served under the token budget, and a fast-forwarded stretch of
decode-only steps ends exactly when stepping one by one would.
"""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.protocol.simcore.instance import (
    CPU_BACKEND,
    InstanceConfig,
    SimInstance,
    SimRequest,
    SubmitError,
)
from kvpool.protocol.simcore.kvcache import DEVICE, DeviceCache, KvEvent, LRUTier
from kvpool.protocol.simcore.profile import (
    ProfileError,
    bundled_profile,
    bundled_profiles,
    parse_profile,
)

RAW = {
    "name": "t",
    "description": "unit-test profile",
    "chip": "none",
    "engine": "vllm",
    "sources": [{"what": "made up", "where": "this test"}],
    "model": {"name": "m", "num_layers": 2, "num_kv_heads": 2, "head_dim": 4},
    "step": {
        "overhead_s": 0.01,
        "prefill_token_s": 0.001,
        "attn_s": 0.0,
        "decode_seq_s": 0.001,
        "decode_ctx_s": 0.0001,
    },
    "request_s": 0.0,
    "load": {k: {"gbps": 1.0} for k in ("ddr", "disk", "p2p", "remote")},
    "store": {"gbps": 1.0},
    "device_kv_gib": 1.0,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 64,
}
PROFILE = parse_profile(json.dumps(RAW))


def config(**over: object) -> InstanceConfig:
    base: dict[str, object] = {
        "profile": PROFILE,
        "chunk_size": 16,
        "block_size": 4,
        "kv_bytes_per_token": 0,  # loads and stores cost only latency (0 here)
        "device_blocks": 64,
        "ddr_chunks": 8,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 64,
        "max_model_len": 1024,
    }
    base.update(over)
    return InstanceConfig(**base)  # type: ignore[arg-type]


def req(rid: str, keys: range | list[int], prompt: int, out: int, at: float = 0.0) -> SimRequest:
    return SimRequest(rid, tuple(keys), prompt, out, at)


def drive(inst: SimInstance, reqs: list[SimRequest], fast: bool = False) -> None:
    """Submit each request at its arrival and end steps in time order until idle."""
    pending = sorted(reqs, key=lambda r: r.arrival)
    while pending or inst.next_time is not None:
        nt = inst.next_time
        if pending and (nt is None or pending[0].arrival <= nt):
            r = pending.pop(0)
            inst.submit(r, r.arrival)
        else:
            inst.complete_step(fast=fast)


# ---------------------------------------------------------------------- profiles
def test_every_bundled_profile_parses_and_cites_a_source() -> None:
    names = bundled_profiles()
    assert {"h100-llama-3.1-8b-vllm", "910b-qwen3-8b-vllm-ascend"} <= set(names)
    for name in names:
        p = bundled_profile(name)
        assert p.sources and all(s.where for s in p.sources)
        assert parse_profile(p.to_json()) == p  # round trip


def test_a_bad_profile_names_the_field() -> None:
    bad = {**RAW, "load": {"ddr": {"gbps": 0.0}}, "sources": []}
    with pytest.raises(ProfileError) as info:
        parse_profile(json.dumps(bad))
    text = str(info.value)
    assert "load: needs a link for disk, p2p, remote" in text
    assert "load.ddr: gbps must be > 0" in text
    assert "sources:" in text
    with pytest.raises(ProfileError, match="unknown field"):
        parse_profile(json.dumps({**RAW, "colour": "red"}))
    with pytest.raises(ProfileError, match="no bundled profile named 'nope'"):
        bundled_profile("nope")


def test_h100_profile_reproduces_its_published_decode_point() -> None:
    """TPOT 7.38 ms at concurrency 4 with ~1.4k tokens of context (the profile's first source)."""
    p = bundled_profile("h100-llama-3.1-8b-vllm")
    step = p.step.step_s(0, 0.0, 4, 1372)
    assert step == pytest.approx(0.00738, rel=0.02)


# ---------------------------------------------------------------------- tiers
def test_lru_tier_admits_once_and_evicts_least_recently_used() -> None:
    tier = LRUTier(CPU_BACKEND, 2)
    events: list[KvEvent] = []
    assert tier.put([1, 2], events) == 2
    tier.touch(1)
    assert tier.put([2, 3], events) == 1  # 2 is held already: no admit, no recency change
    assert [(e.op, e.key) for e in events] == [
        ("admit", 1),
        ("admit", 2),
        ("evict", 2),
        ("admit", 3),
    ]
    assert sorted(tier.keys()) == [1, 3]
    tier.pin([1, 3])
    assert tier.put([4], events) == 0  # nothing evictable: the store is dropped
    assert len(tier) == 2


@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 2)), max_size=200))
@settings(max_examples=100, deadline=None)
def test_lru_tier_never_exceeds_capacity_and_events_replay_to_its_content(
    ops: list[tuple[int, int]],
) -> None:
    tier = LRUTier(CPU_BACKEND, 5)
    events: list[KvEvent] = []
    for key, op in ops:
        if op == 0:
            tier.put([key], events)
        elif op == 1:
            tier.touch(key)
        else:
            tier.remove([key], events)
        assert len(tier) <= 5
    held: set[int] = set()
    for e in events:
        (held.add if e.op == "admit" else held.discard)(e.key)
    assert held == set(tier.keys())


def test_device_cache_keeps_finished_prefixes_until_room_is_needed() -> None:
    dev = DeviceCache(capacity_blocks=8, blocks_per_chunk=2)
    events: list[KvEvent] = []
    assert dev.fits([1, 2], 2)
    dev.acquire([1, 2], 2, events)
    assert dev.match([1, 2]) == 0  # held but not computed yet: nobody can reuse it
    dev.mark_ready([1, 2], events)
    assert dev.match([1, 2, 3]) == 2
    dev.release([1, 2], 2)
    assert dev.used_blocks == 4 and dev.match([1, 2]) == 2  # idle, still cached
    assert dev.fits([3, 4, 5], 0)  # by reclaiming the idle chunks
    dev.acquire([3, 4, 5], 0, events)
    # the tail (chunk 2) was freed first, so it is reclaimed first; the prefix chunk 1 stays
    assert [(e.op, e.location, e.key) for e in events][-1] == ("evict", DEVICE, 2)
    assert dev.match([1, 2]) == 1


def test_a_reused_idle_chunk_stays_cached_and_is_not_admitted_again() -> None:
    """A request reusing idle cached chunks holds them ready: no second device admit (vLLM
    publishes BlockStored once), and a concurrent request still hits them."""
    dev = DeviceCache(capacity_blocks=16, blocks_per_chunk=2)
    events: list[KvEvent] = []
    dev.acquire([1, 2], 0, events)
    dev.mark_ready([1, 2], events)
    dev.release([1, 2], 0)
    dev.acquire([1, 2, 3], 0, events)
    assert dev.match([1, 2, 3]) == 2
    dev.mark_ready([1, 2, 3], events)
    assert [(e.op, e.key) for e in events] == [("admit", 1), ("admit", 2), ("admit", 3)]


# ---------------------------------------------------------------------- scheduling
def test_one_request_costs_exactly_the_profile() -> None:
    """48 prompt tokens in one 64-token step, then 2 decode steps."""
    inst = SimInstance("a", config())
    r = req("r", range(3), 48, 3)
    drive(inst, [r])
    prefill = 0.01 + 48 * 0.001
    assert r.first_token_at == pytest.approx(prefill)
    decode1 = 0.01 + 0.001 + 0.0001 * 49
    decode2 = 0.01 + 0.001 + 0.0001 * 50
    assert r.finished_at == pytest.approx(prefill + decode1 + decode2)
    assert r.cached_tokens == 0 and r.generated == 3


def test_a_repeated_prompt_hits_the_device_then_ddr_after_device_reclaim() -> None:
    inst = SimInstance("a", config(device_blocks=16))  # 16 blocks = 4 chunks of 16 tokens
    first = req("a", range(3), 48, 1)
    drive(inst, [first])
    again = req("b", range(3), 48, 1, at=1.0)
    drive(inst, [again])
    assert again.hit_chunks["device"] == 3 and again.cached_tokens == 47  # prompt - 1
    other = req("c", range(100, 103), 48, 1, at=2.0)  # needs the device room: reclaims a..
    drive(inst, [other])
    third = req("d", range(3), 48, 1, at=3.0)
    drive(inst, [third])
    assert third.hit_chunks["device"] < 3 and third.hit_chunks["ddr"] > 0
    assert third.cached_tokens == 47
    assert inst.stats()["stored_chunks"] == 6  # a's and c's chunks once each


def test_the_token_budget_chunks_a_long_prefill_and_decodes_go_first() -> None:
    inst = SimInstance("a", config(max_num_batched_tokens=32))
    long = req("long", range(6), 96, 2)
    drive(inst, [long])
    assert inst.counters["steps"] == 3 + 1  # 96 tokens in 3 steps of 32, then one decode
    assert long.first_token_at == pytest.approx(3 * 0.01 + 96 * 0.001)


def test_requests_wait_first_come_first_served_for_device_room() -> None:
    inst = SimInstance("a", config(device_blocks=24))  # 96 tokens: one 80-token lifetime
    a = req("a", range(4), 64, 16)
    b = req("b", range(10, 14), 64, 16)
    drive(inst, [a, b])
    assert b.scheduled_at == a.finished_at


def test_a_request_that_can_never_fit_is_refused() -> None:
    inst = SimInstance("a", config())
    with pytest.raises(SubmitError, match="max_model_len"):
        inst.submit(req("r", range(3), 1000, 100), 0.0)
    with pytest.raises(SubmitError, match="KV blocks"):
        inst.submit(req("r", range(3), 300, 1), 0.0)


def test_frozen_stores_are_skipped_and_counted() -> None:
    inst = SimInstance("a", config())
    inst.frozen = True
    drive(inst, [req("r", range(3), 48, 1)])
    assert inst.counters["stored_chunks"] == 0
    assert inst.counters["store_skipped_frozen_chunks"] == 3
    assert inst.counters["store_skipped_frozen_tokens"] == 48
    assert len(inst.ddr) == 0


def test_frozen_tokens_count_a_partial_chunk_by_its_tokens() -> None:
    """A saved unfull chunk (the prompt's last 5 tokens) skipped during a freeze counts 5."""
    inst = SimInstance("a", config())
    inst.frozen = True
    drive(inst, [req("r", range(4), 53, 1)])
    assert inst.counters["store_skipped_frozen_chunks"] == 4
    assert inst.counters["store_skipped_frozen_tokens"] == 53


def test_a_late_step_end_starts_the_next_step_then() -> None:
    """Real time: a step ended late (``now``) delays every later step by the lag; without
    ``now`` the next step starts when the previous one ended (virtual time)."""
    times = []
    for lag in (0.0, 0.5):
        inst = SimInstance("a", config())
        r = req("r", range(3), 48, 3)
        inst.submit(r, 0.0)
        first_end = inst.next_time
        assert first_end is not None
        inst.complete_step(now=first_end + lag if lag else None)
        second_end = inst.next_time
        assert second_end is not None
        times.append(second_end - first_end)
    decode1 = 0.01 + 0.001 + 0.0001 * 49
    assert times[0] == pytest.approx(decode1)
    assert times[1] == pytest.approx(0.5 + decode1)
    inst = SimInstance("a", config())
    inst.submit(req("r", range(3), 48, 3), 0.0)
    end = inst.next_time
    inst.complete_step(now=0.0)  # never before the step ended
    assert inst._plan is not None and inst._plan.start == end


def test_request_time_delays_scheduling() -> None:
    profile = parse_profile(json.dumps({**RAW, "request_s": 0.5}))
    inst = SimInstance("a", config(profile=profile))
    r = req("r", range(3), 48, 1)
    drive(inst, [r])
    assert r.scheduled_at == pytest.approx(0.5)
    assert r.first_token_at == pytest.approx(0.5 + 0.01 + 0.048)


@given(st.integers(0, 2**31), st.integers(1, 12))
@settings(max_examples=60, deadline=None)
def test_fast_forward_equals_stepping_one_by_one(seed: int, n: int) -> None:
    """Random arrivals, prompts and output lengths: first-token and finish times, hits and
    stores are identical whether decode-only stretches run step by step or in one call."""
    rnd = random.Random(seed)
    specs = []
    for i in range(n):
        prefix = rnd.randrange(3) * 100
        chunks = rnd.randint(1, 6)
        specs.append(
            (f"r{i}", list(range(prefix, prefix + chunks)), chunks * 16 + rnd.randrange(16),
             rnd.randint(1, 40), rnd.uniform(0, 2.0))
        )  # fmt: skip
    runs = []
    for fast in (False, True):
        inst = SimInstance("a", config(device_blocks=200, max_num_batched_tokens=48))
        reqs = [req(rid, keys, p, o, at) for rid, keys, p, o, at in specs]
        drive(inst, reqs, fast=fast)
        runs.append([(r.first_token_at, r.finished_at, r.cached_tokens, r.generated) for r in reqs])
    for slow, quick in zip(runs[0], runs[1], strict=True):
        assert slow[2:] == quick[2:]
        assert slow[0] == pytest.approx(quick[0], abs=1e-9)
        assert slow[1] == pytest.approx(quick[1], abs=1e-9)
