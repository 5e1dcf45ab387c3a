"""The demo's report: its numbers are derived from the turns, nothing else (pure parts).

The demo itself runs against a live domain (``make demo``); here its table, summary and tier
attribution are checked on hand-made turns, so a wrong formula cannot hide behind a live run.
"""

from __future__ import annotations

from kvpool.operator.local.demo import Demo, Domain, Turn, summary, table


def _turn(label: str, hit: int, prompt: int, ttft: float, cold: float | None, tier: str) -> Turn:
    kind = "pd" if label.startswith("pd") else "chat"
    return Turn(label, label, kind, "a", "kv-hit", prompt, hit, tier, ttft, cold)


def test_summary_divides_mean_hit_ttft_by_mean_cold_ttft_of_the_same_turns() -> None:
    turns = [
        _turn("t1", 0, 1000, 2.0, 1.0, "-"),  # a miss: not in the TTFT ratio
        _turn("t2", 512, 1000, 0.2, 1.0, "LocalCPUBackend"),
        _turn("t3", 768, 1000, 0.4, 3.0, "P2P from b"),
        _turn("pd 1", 900, 1000, 0.5, None, "PD transfer"),
    ]
    out = summary(turns)
    assert out["hit_ratio"] == round((512 + 768) / 3000, 4)
    assert out["p2p_hit_tokens"] == 768
    assert out["pd_requests"] == 1
    assert out["pd_transferred_tokens"] == 900
    assert out["ttft_hit_over_cold"] == round((0.2 + 0.4) / (1.0 + 3.0), 3)
    assert "| t3 | a | kv-hit | 768 / 1000 | P2P from b |" in table(turns)


def test_no_hit_turn_means_no_ratio() -> None:
    assert summary([_turn("t1", 0, 10, 1.0, 1.0, "-")])["ttft_hit_over_cold"] is None


def test_a_hit_beyond_the_instance_s_own_chunks_is_attributed_to_its_peer() -> None:
    demo = Demo(Domain("g", "c", {"a": "u", "b": "v"}, [], {}, 256), print)
    held = {"b": {"hit_chunks": 4, "per_location": {"LocalCPUBackend": 4}}}
    assert demo.tier("a", 1024, held) == "P2P from b"
    own = {"a": {"hit_chunks": 4, "per_location": {"LocalCPUBackend": 4}}, **held}
    assert demo.tier("a", 1024, own) == "LocalCPUBackend"
    assert demo.tier("a", 0, own) == "-"
