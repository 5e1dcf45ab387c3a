"""The PD bypass decision (``pd_bypass.decide``): the decoder holding most of the prompt, its
share against the pair's ratio, ties, and the reasons the metric and the explain step carry."""

from __future__ import annotations

from kvpool.gateway.candidates import Candidate, Candidates, InstanceLoad, PrefixHit
from kvpool.gateway.pd_bypass import REASON_BELOW, REASON_CACHED, REASON_OFF, decide


def cands(*rows: tuple[str, int, int]) -> Candidates:
    """(name, hit chunks, requests in flight) per decoder."""
    return Candidates.of(
        Candidate(n, InstanceLoad(inflight=f), PrefixHit(h) if h else None) for n, h, f in rows
    )


def test_the_decoder_holding_the_share_is_bypassed_to() -> None:
    c = cands(("d0", 1, 0), ("d1", 3, 5))
    v = decide(c, 1000, 256, 0.5)
    assert (v.position, v.cached_tokens, v.bypass, v.reason) == (1, 768, True, REASON_CACHED)
    assert v.share == 0.768
    note = v.note(c.names, 1000)
    assert "d1 holds 768 of 1000" in note and "bypassMinCachedRatio 0.5" in note
    assert "skipped" in note


def test_below_the_ratio_or_off_goes_through_prefill() -> None:
    c = cands(("d0", 1, 0))
    below = decide(c, 1000, 256, 0.5)
    assert (below.bypass, below.reason, below.cached_tokens) == (False, REASON_BELOW, 256)
    assert "through prefill" in below.note(c.names, 1000)
    off = decide(c, 1000, 256, 0.0)
    assert (off.bypass, off.reason) == (False, REASON_OFF)
    # the whole prompt held (a hit may cover more chunks than a shorter prompt has)
    assert decide(cands(("d0", 4, 0)), 700, 256, 1.0).cached_tokens == 700
    assert decide(cands(("d0", 4, 0)), 700, 256, 1.0).bypass


def test_nothing_held_never_bypasses_and_ties_go_to_the_less_loaded() -> None:
    none = decide(cands(("d0", 0, 0), ("d1", 0, 0)), 600, 256, 0.01)
    assert (none.position, none.bypass) == (-1, False)
    assert "no decoder holds 0" in none.note(["d0", "d1"], 600)
    assert decide(cands(("d0", 2, 0)), 0, 256, 0.5).bypass is False  # an empty prompt
    tie = decide(cands(("d0", 2, 3), ("d1", 2, 1), ("d2", 2, 1)), 600, 256, 0.5)
    assert (tie.position, tie.bypass) == (1, True)
