"""The columnar routing core decides exactly as the formula, one instance at a time, would.

The policies score a thousand candidates as arrays; this test keeps the one-at-a-time version
of the same formula (what routing.py computed before it went columnar, written out plainly
here) and checks with hypothesis that every policy picks the same instance for the same reason
and expected hit, on random pools (loads, TTFTs, hits in several tiers, shared P2P credit, ties,
sessions). A second test builds candidates through the gateway's Selector (index hits, pending
entries, P2P groups) and checks each row against the per-instance construction.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.gateway.config import parse_config
from kvpool.gateway.pending import extend_hit, merge_pending
from kvpool.gateway.routing import (
    DEFAULT_TIER_WEIGHTS,
    P2P_LOCATION,
    Candidate,
    Candidates,
    Guards,
    InstanceLoad,
    KvAwarePolicy,
    LeastLoadPolicy,
    PrefixHit,
    RoundRobinPolicy,
    RouteRequest,
    SessionPolicy,
    hit_tokens,
    rendezvous_rank,
    weighted_hit_tokens,
)
from kvpool.gateway.selection import Prompt
from kvpool.gateway.state import GatewayState, build_state

CHUNK = 256


def reference_kv_aware(
    request: RouteRequest, cands: Sequence[Candidate], guards: Guards, wp: float, wl: float
) -> tuple[str, str, int]:
    ttfts = [c.load.ttft_s for c in cands if c.load.ttft_s is not None]
    median = statistics.median(ttfts) if ttfts else None
    scores: dict[str, float] = {}
    for c in cands:
        cached = weighted_hit_tokens(
            c.hit, request.chunk_size, request.prompt_tokens, DEFAULT_TIER_WEIGHTS
        )
        slow = 1.0
        if median and c.load.ttft_s is not None:
            slow = min(2.0, max(0.5, c.load.ttft_s / median))
        cost = (c.load.queued_prefill_tokens + request.chunk_size * c.load.inflight) * slow
        scores[c.name] = wp * cached - wl * cost
    low = min(c.load.inflight for c in cands)
    cap = max(low + guards.imbalance_abs, guards.imbalance_ratio * low)
    eligible = [c for c in cands if c.load.inflight <= cap]
    names = sorted(c.name for c in cands)
    tie = rendezvous_rank(request.session, names) if request.session else names
    order = {n: i for i, n in enumerate(tie)}
    best = max(eligible, key=lambda c: (scores[c.name], -order[c.name]))
    unguarded = max(cands, key=lambda c: (scores[c.name], -order[c.name]))
    cached = hit_tokens(best.hit, request.chunk_size, request.prompt_tokens)
    if unguarded.name != best.name and scores[unguarded.name] > scores[best.name]:
        reason = "imbalance-guard"
    elif cached > 0:
        reason = "kv-hit"
    else:
        reason = "kv-miss-least-load"
    return best.name, reason, cached


def reference_least_load(cands: Sequence[Candidate]) -> str:
    return min(
        cands,
        key=lambda c: (
            c.load.inflight,
            c.load.queued_prefill_tokens,
            c.load.ttft_s if c.load.ttft_s is not None else 0.0,
            c.name,
        ),
    ).name


LOCATIONS = ("LocalCPUBackend", "LocalDiskBackend", "P2PBackend", "pending", "RemoteBackend")


@st.composite
def pools(draw: st.DrawFn) -> list[Candidate]:
    n = draw(st.integers(1, 24))
    names = draw(st.lists(st.text("abcdefgh", min_size=1, max_size=4), min_size=n, max_size=n,
                          unique=True))  # fmt: skip
    out = []
    for name in names:
        load = InstanceLoad(
            draw(st.integers(0, 12)),
            draw(st.sampled_from([0, 100, 256, 1000, 4096])),
            draw(st.one_of(st.none(), st.sampled_from([0.05, 0.1, 0.2, 0.4, 1.0]))),
        )
        hit = None
        if draw(st.booleans()):
            chunks = draw(st.integers(1, 8))
            where = draw(st.lists(st.sampled_from(LOCATIONS), min_size=1, max_size=2, unique=True))
            hit = PrefixHit(chunks, {w: draw(st.integers(1, chunks)) for w in where})
        out.append(Candidate(name, load, hit))
    return out


@given(
    pools(),
    st.integers(1, 3000),
    st.one_of(st.none(), st.text("xyz", min_size=1, max_size=3)),
    st.sampled_from([(1.0, 1.0), (1.0, 0.5), (0.1, 1.0), (10.0, 0.01)]),
    st.integers(0, 8),
)
@settings(max_examples=400, deadline=None)
def test_every_policy_decides_as_one_at_a_time(
    cands: list[Candidate],
    tokens: int,
    session: str | None,
    weights: tuple[float, float],
    imbalance: int,
) -> None:
    request = RouteRequest(tokens, CHUNK, session)
    guards = Guards(imbalance_abs=imbalance)
    table = Candidates.of(cands)
    d = KvAwarePolicy(*weights, guards=guards).choose(request, table)
    assert (d.instance, d.reason, d.predicted_hit_tokens) == reference_kv_aware(
        request, cands, guards, *weights
    )
    assert d.instance in d.scores
    assert LeastLoadPolicy().choose(request, table).instance == reference_least_load(cands)
    rr = RoundRobinPolicy()
    ordered = sorted(c.name for c in cands)
    assert [rr.choose(request, table).instance for _ in range(3)] == [
        ordered[i % len(ordered)] for i in range(3)
    ]
    if session:
        low = min(c.load.inflight for c in cands)
        cap = max(low + guards.imbalance_abs, guards.imbalance_ratio * low)
        ok = {c.name for c in cands if c.load.inflight <= cap}
        want = next(n for n in rendezvous_rank(session, ordered) if n in ok)
        assert SessionPolicy(guards).choose(request, table).instance == want


@given(
    st.dictionaries(st.integers(0, 9), st.integers(1, 6), max_size=6),
    st.dictionaries(st.integers(0, 9), st.integers(1, 6), max_size=4),
)
@settings(max_examples=100, deadline=None)
def test_selector_candidates_equal_the_per_instance_construction(
    index: dict[int, int], pending: dict[int, int]
) -> None:
    """Two P2P groups and index/pending hits on random members: each candidate row holds what
    merge_pending + extend_hit give for that instance alone."""
    groups = {"g1": [f"a{i}" for i in range(5)], "g2": [f"b{i}" for i in range(5)]}
    raw = {
        "model": "m",
        "chunkSize": CHUNK,
        "controllerUrl": "http://127.0.0.1:9",
        "p2pGroups": [
            {"name": g, "instances": [{"name": n, "url": f"http://127.0.0.1:1/{n}"} for n in ns]}
            for g, ns in groups.items()
        ],
    }
    state = build_state(parse_config(raw))
    for inst in state.instances:
        inst.ready = True
    names = groups["g1"] + groups["g2"]
    hashes = tuple(range(100, 108))
    hits = {names[i]: PrefixHit(n, {"LocalCPUBackend": n}) for i, n in index.items()}
    for i, n in pending.items():
        state.selector.pending.record(names[i], hashes[:n], 0.0)
    state.selector.clock = lambda: 0.5
    table = state.selector.candidates(state.instances.peers(), Prompt(2048, hashes, None), hits,
                                      set())  # fmt: skip
    best = {
        g: max((hits[n].hit_chunks for n in ns if n in hits), default=0) for g, ns in groups.items()
    }
    for i, name in enumerate(table.names):
        group = "g1" if name.startswith("a") else "g2"
        want = merge_pending(hits.get(name), pending.get(names.index(name), 0))
        want = extend_hit(want, best[group], P2P_LOCATION)
        assert table.hit(i) == want, name


def _ready_state_without_p2p(names: list[str]) -> GatewayState:
    """A gateway over one P2PGroup with ``p2p: false`` (no member pulls), every member ready."""
    raw = {
        "model": "m",
        "chunkSize": CHUNK,
        "controllerUrl": "http://127.0.0.1:9",
        "p2pGroups": [
            {
                "name": "fleet",
                "p2p": False,
                "instances": [{"name": n, "url": f"http://127.0.0.1:1/{n}"} for n in names],
            }
        ],
    }
    state = build_state(parse_config(raw))
    for inst in state.instances:
        inst.ready = True
    return state


def test_a_group_without_p2p_credits_no_peer_hits() -> None:
    """P2PGroup spec.p2p false: members do not pull from each other, so only the holder is
    credited its hit."""
    state = _ready_state_without_p2p(list("abc"))
    hits = {"a": PrefixHit(4, {"LocalCPUBackend": 4})}
    table = state.selector.candidates(
        state.instances.peers(), Prompt(2048, tuple(range(8)), None), hits, set()
    )
    assert [table.hit(i) for i in range(3)] == [hits["a"], None, None]


@given(
    st.lists(  # per index instance: (name, chunks held, tier) — a name may have two ids
        st.tuples(st.integers(0, 11), st.integers(1, 8), st.sampled_from(LOCATIONS[:3])),
        max_size=30,
    ),
    st.lists(  # pending prompts: (name, chunks, how its request stands)
        st.tuples(
            st.integers(0, 11),
            st.integers(1, 8),
            st.sampled_from(["prefetch", "prefilling", "answered", "failed"]),
        ),
        max_size=12,
    ),
    st.floats(0.0, 4.0),
)
@settings(max_examples=300, deadline=None)
def test_grouped_index_answers_give_the_per_name_candidates(
    held: list[tuple[int, int, str]],
    pending: list[tuple[int, int, str]],
    now: float,
) -> None:
    """The replica's grouped answer (GroupedHits: bitmasks of instance ids, mapped to
    positions with numpy, pending prefixes merged per group) gives every candidate the hit
    the per-name answer gives it (the longest of a name's ids, extended by its live pending
    chunks), and the kv-aware policy the same H_i."""
    from kvpool.gateway.hitgroups import GroupedHits
    from kvpool.protocol.index import ChunkIndex

    names = [f"w{i}" for i in range(12)]
    state = _ready_state_without_p2p(names)  # no pullers: the grouped path
    sel = state.selector
    sel.clock = lambda: now
    hashes = tuple(range(500, 508))
    index = ChunkIndex()
    for k, (i, chunks, location) in enumerate(held):
        fingerprint = "f0" if k % 3 else "f1"  # some names under two fingerprints
        index.admit(f"{names[i]}~{fingerprint}", 0, location, hashes[:chunks])
    for i, chunks, how in pending:
        if how == "prefetch":
            sel.pending.record(names[i], hashes[:chunks], 0.0)
            continue
        ticket = sel.load.start(names[i], 100, 0.0)
        sel.pending.record(names[i], hashes[:chunks], 0.0, ticket)
        if how == "answered":
            sel.load.first_byte(ticket, 1.0)
            sel.load.finish(ticket)
        elif how == "failed":
            sel.load.finish(ticket)
    version, ids = index.instance_names()
    grouped = GroupedHits(index.prefix_groups(hashes), ids, version)
    prompt = Prompt(2048, hashes, None)
    pool = state.instances.peers()
    fast = sel.candidates(pool, prompt, grouped, set())
    slow = sel.candidates(pool, prompt, grouped.by_name(), set())
    assert list(fast.names) == list(slow.names)
    for i in range(len(fast)):
        a, b = fast.hit(i), slow.hit(i)
        assert (a and (a.hit_chunks, dict(a.per_location))) == (
            b and (b.hit_chunks, dict(b.per_location))
        ), fast.names[i]
    request = RouteRequest(2048, CHUNK, None)
    policy = KvAwarePolicy()
    assert policy.cached(request, fast).tolist() == policy.cached(request, slow).tolist()
