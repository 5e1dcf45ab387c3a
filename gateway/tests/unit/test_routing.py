"""The pure routing core: each policy, the kv-aware score and its guards, the fallback.

No I/O and no clock: candidates are built by hand, so every expectation follows from the
formula in gateway/README.md.
"""

from __future__ import annotations

import pytest

from kvpool.gateway.load import LoadTracker
from kvpool.gateway.pending import PendingPrefixes, merge_pending
from kvpool.gateway.routing import (
    P2P_LOCATION,
    POLICIES,
    Candidate,
    Candidates,
    Guards,
    InstanceLoad,
    KvAwarePolicy,
    LeastLoadPolicy,
    NoCandidateError,
    PolicySettings,
    PrefixHit,
    RoundRobinPolicy,
    Router,
    RouteRequest,
    SessionPolicy,
    make_policy,
    rendezvous_rank,
    tier_of,
    weighted_hit_tokens,
)
from kvpool.protocol.policies import ROUTING_POLICIES

CHUNK = 256
REQ = RouteRequest(prompt_tokens=1000, chunk_size=CHUNK)


def cand(
    name: str,
    hit: int = 0,
    inflight: int = 0,
    queued: int = 0,
    where: str = "LocalCPUBackend",
    ttft: float | None = None,
) -> Candidate:
    return Candidate(
        name,
        InstanceLoad(inflight, queued, ttft),
        PrefixHit(hit, {where: hit}) if hit else None,
    )


def test_tiers_are_classified_fastest_first() -> None:
    assert tier_of("LocalCPUBackend") == "ddr"
    assert tier_of("LocalDiskBackend") == "disk"
    assert tier_of("MooncakeStoreBackend") == "remote"
    assert tier_of("RedisBackend") == "remote"
    assert tier_of("PDBackend") == "ddr"  # a PD receive buffer in host memory
    assert tier_of("P2PBackend") == "p2p"
    assert tier_of("pending") == "pending"
    assert tier_of(P2P_LOCATION) == "p2p"  # a P2P group member's credit for its peer's chunks


def test_a_peer_that_can_pull_the_prefix_wins_once_the_holder_is_queued() -> None:
    """Default weights: at equal load the holder (DDR) wins; a peer that would pull the same
    prefix (p2p, 0.6) wins once the holder's queue outweighs what the pull costs (0.2 x 1024
    tokens)."""
    req = RouteRequest(prompt_tokens=4 * CHUNK, chunk_size=CHUNK)
    holder, peer = cand("a", hit=4), cand("b", hit=4, where=P2P_LOCATION)
    assert KvAwarePolicy().choose(req, Candidates.of([holder, peer])).instance == "a"
    busy = cand("a", hit=4, queued=250)
    assert KvAwarePolicy().choose(req, Candidates.of([busy, peer])).instance == "b"
    assert (
        KvAwarePolicy().choose(req, Candidates.of([cand("a", hit=4, queued=150), peer])).instance
        == "a"
    )


def test_weighted_hits_credit_each_chunk_once_at_its_fastest_tier() -> None:
    # 3 leading chunks; the index counts 2 in DDR and 3 on disk (a chunk in both tiers).
    hit = PrefixHit(3, {"LocalCPUBackend": 2, "LocalDiskBackend": 3})
    assert weighted_hit_tokens(hit, CHUNK, 10_000) == pytest.approx((2 * 0.8 + 1 * 0.5) * CHUNK)
    # the last chunk may be partial: tokens are capped at the prompt
    assert weighted_hit_tokens(PrefixHit(1, {"LocalCPUBackend": 1}), CHUNK, 100) == pytest.approx(
        80
    )
    assert weighted_hit_tokens(None, CHUNK, 100) == 0.0


def test_kv_affinity_prefers_the_longest_cached_prefix() -> None:
    d = KvAwarePolicy().choose(REQ, Candidates.of([cand("a", hit=1), cand("b", hit=3), cand("c")]))
    assert (d.instance, d.reason, d.predicted_hit_tokens) == ("b", "kv-hit", 768)


def test_kv_affinity_faster_tier_wins_at_equal_length() -> None:
    d = KvAwarePolicy().choose(
        REQ,
        Candidates.of(
            [cand("a", hit=2, where="LocalDiskBackend"), cand("b", hit=2, where="LocalCPUBackend")]
        ),
    )
    assert d.instance == "b"


def test_load_outweighs_a_small_hit() -> None:
    # b holds one chunk (256 x 0.8 = 204.8) but has 2 requests in flight (0.5 x 512 = 256).
    d = KvAwarePolicy().choose(REQ, Candidates.of([cand("a"), cand("b", hit=1, inflight=2)]))
    assert (d.instance, d.reason) == ("a", "kv-miss-least-load")


def test_queued_prefill_tokens_count_as_load() -> None:
    d = KvAwarePolicy().choose(REQ, Candidates.of([cand("a", queued=4000), cand("b", queued=100)]))
    assert d.instance == "b"


def test_slow_instance_looks_more_loaded() -> None:
    # same queue; a's recent TTFT is 4x the pool median -> its load counts double
    a, b, c = (
        cand("a", queued=1000, ttft=4.0),
        cand("b", queued=1000, ttft=1.0),
        cand("c", queued=1000, ttft=1.0),
    )
    assert KvAwarePolicy().choose(REQ, Candidates.of([a, b, c])).instance in ("b", "c")


def test_weights_come_from_the_pool() -> None:
    cands = [cand("a", hit=3, inflight=2), cand("b")]
    assert (
        KvAwarePolicy(prefix_weight=1.0, load_weight=0.5).choose(REQ, Candidates.of(cands)).instance
        == "a"
    )
    assert (
        KvAwarePolicy(prefix_weight=0.1, load_weight=1.0).choose(REQ, Candidates.of(cands)).instance
        == "b"
    )


def test_bounded_imbalance_stops_a_hot_prefix_collapsing_the_pool() -> None:
    # a holds the whole prompt but already carries 9 requests; the others are idle.
    pol = KvAwarePolicy(prefix_weight=10.0, load_weight=0.01, guards=Guards(imbalance_abs=8))
    d = pol.choose(REQ, Candidates.of([cand("a", hit=4, inflight=9), cand("b"), cand("c")]))
    assert d.instance in ("b", "c") and d.reason == "imbalance-guard"
    # within the bound the hit wins
    d = pol.choose(REQ, Candidates.of([cand("a", hit=4, inflight=8), cand("b"), cand("c")]))
    assert d.instance == "a"


def test_ties_follow_the_session_hash() -> None:
    names = ["a", "b", "c", "d"]
    for session in ("s1", "s2", "s3"):
        req = RouteRequest(100, CHUNK, session)
        d = KvAwarePolicy().choose(req, Candidates.of([cand(n) for n in names]))
        assert d.instance == rendezvous_rank(session, names)[0]


def test_rendezvous_is_consistent_when_an_instance_leaves() -> None:
    names = [f"w{i}" for i in range(5)]
    keys = [f"session-{i}" for i in range(300)]
    before = {k: rendezvous_rank(k, names)[0] for k in keys}
    after = {k: rendezvous_rank(k, names[:-1])[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(before[k] == "w4" for k in moved)  # only the departed instance's keys move
    assert 0 < len(moved) < len(keys)


def test_session_policy_sticks_and_falls_back() -> None:
    cands = [cand("a"), cand("b"), cand("c")]
    first = SessionPolicy().choose(RouteRequest(10, CHUNK, "alice"), Candidates.of(cands))
    again = SessionPolicy().choose(
        RouteRequest(10, CHUNK, "alice"), Candidates.of(list(reversed(cands)))
    )
    assert first.instance == again.instance and first.reason == "session"
    no_session = SessionPolicy().choose(
        RouteRequest(10, CHUNK), Candidates.of([cand("a", inflight=3), cand("b")])
    )
    assert (no_session.instance, no_session.reason) == ("b", "no-session-least-load")
    # the session's favourite is overloaded: the next in its ranking takes it
    fav = first.instance
    loaded = [cand(n, inflight=20 if n == fav else 0) for n in ("a", "b", "c")]
    moved = SessionPolicy().choose(RouteRequest(10, CHUNK, "alice"), Candidates.of(loaded))
    assert moved.instance != fav and moved.reason == "session-imbalance-guard"


def test_least_load_and_round_robin() -> None:
    assert (
        LeastLoadPolicy()
        .choose(REQ, Candidates.of([cand("a", inflight=2), cand("b", inflight=1)]))
        .instance
        == "b"
    )
    rr = RoundRobinPolicy()
    picks = [
        rr.choose(REQ, Candidates.of([cand("b"), cand("a"), cand("c")])).instance for _ in range(6)
    ]
    assert picks == ["a", "b", "c", "a", "b", "c"]


def test_the_registry_has_one_class_per_config_name() -> None:
    """The names the operator's API and gateway.yaml accept are exactly the registered ones."""
    assert sorted(POLICIES) == sorted(ROUTING_POLICIES)
    for name in ROUTING_POLICIES:
        assert make_policy(name).name == name


def test_every_policy_refuses_an_empty_pool() -> None:
    for name in ROUTING_POLICIES:
        with pytest.raises(NoCandidateError):
            make_policy(name, PolicySettings(1.0, 0.5)).choose(REQ, Candidates.of([]))
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random", PolicySettings(1.0, 0.5))


def test_router_falls_back_when_the_index_is_down() -> None:
    router = Router(KvAwarePolicy())
    cands = [cand("a", hit=4), cand("b")]
    assert router.route(REQ, Candidates.of(cands), index_ok=True).reason == "kv-hit"
    down = router.route(REQ, Candidates.of([cand("a", inflight=1), cand("b")]), index_ok=False)
    assert (down.instance, down.reason) == ("b", "fallback-least-load")
    with_session = router.route(
        RouteRequest(10, CHUNK, "bob"), Candidates.of(cands), index_ok=False
    )
    assert with_session.reason == "fallback-session"
    # a non-affinity policy is not affected by the index
    assert (
        Router(RoundRobinPolicy()).route(REQ, Candidates.of(cands), index_ok=False).reason
        == "round-robin"
    )


def test_pending_prefixes_send_a_burst_to_one_instance() -> None:
    """Requests with one new prefix, routed before any admit event: the first goes anywhere,
    the rest follow it while the pending entries live."""
    pending = PendingPrefixes(ttl_s=2.0)
    load = LoadTracker()
    hashes = list(range(8))  # a 2048-token prompt nobody holds yet
    policy = KvAwarePolicy()
    picks = []
    for i in range(6):
        now = 0.1 * i
        cands = [
            Candidate(n, load.load(n), merge_pending(None, pending.hit(n, hashes, now)))
            for n in ("a", "b", "c")
        ]
        d = policy.choose(RouteRequest(2048, CHUNK), Candidates.of(cands))
        pending.record(d.instance, hashes, now)
        load.start(d.instance, 0, now)
        picks.append(d.instance)
    assert len(set(picks)) == 1
    # after the TTL the entries are gone
    assert pending.hit(picks[0], hashes, 10.0) == 0


def test_pending_prefixes_live_while_the_routed_request_prefills() -> None:
    """A prefill longer than the TTL: until its first byte nothing is stored, so the entry must
    not lapse (else the next same-prefix request goes to a cold instance that can neither hit
    nor pull); after the first byte it lives the TTL; a request that failed drops it."""
    pending = PendingPrefixes(ttl_s=2.0)
    load = LoadTracker()
    hashes = list(range(4))
    slow = load.start("a", 1024, now=0.0)
    pending.record("a", hashes, 0.0, slow)
    assert pending.hit("a", hashes, 9.0) == 4  # still prefilling at 9 s, past the 2 s TTL
    load.first_byte(slow, now=10.0)
    assert pending.hit("a", hashes, 11.5) == 4
    assert pending.hit("a", hashes, 12.5) == 0  # TTL after the first byte
    failed = load.start("b", 1024, now=0.0)
    pending.record("b", hashes, 0.0, failed)
    load.finish(failed)
    assert pending.hit("b", hashes, 0.5) == 0
    pending.record("c", hashes, 0.0)  # no ticket (a prefetch target): plain TTL
    assert pending.hit("c", hashes, 1.0) == 4
    assert pending.hit("c", hashes, 2.5) == 0


def test_pending_prefixes_are_bounded() -> None:
    pending = PendingPrefixes(ttl_s=100, max_entries=10)
    pending.record("a", list(range(50)), 0.0)
    assert len(pending) == 10


def test_load_tracker_counts_queued_prefill_until_first_byte() -> None:
    t = LoadTracker()
    ticket = t.start("a", 500, now=0.0)
    assert t.load("a") == InstanceLoad(1, 500, None)
    assert t.first_byte(ticket, now=0.25) == 0.25
    assert t.load("a") == InstanceLoad(1, 0, 0.25)
    t.finish(ticket)
    t.finish(ticket)  # idempotent
    assert t.load("a").inflight == 0
    cancelled = t.start("a", 300, now=1.0)
    t.finish(cancelled)  # never answered: its queued tokens leave too
    assert t.load("a").queued_prefill_tokens == 0
