"""kvpool's agent trace (kvpool.gateway.traces.agent): determinism, shape, timing, files.

Pure code only (no processes, no clock, no timed assertion): the routing benchmark and
``kvpool-gateway replay`` are only comparable across routers and runs if the trace is the same
every time and has the sharing structure it claims (a tenant's sessions share its system prompt;
a turn extends the previous turn; RAG turns carry the tenant's documents in a per-request order).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from kvpool.gateway.traces import TraceError, Window
from kvpool.gateway.traces import agent as tr


def test_same_seed_same_trace_other_seed_other_trace() -> None:
    cfg = tr.TraceConfig(seed=7)
    assert tr.generate(cfg) == tr.generate(tr.TraceConfig(seed=7))
    other = tr.generate(tr.TraceConfig(seed=8))
    assert [r.messages for r in other.requests] != [r.messages for r in tr.generate(cfg).requests]


def test_counts_and_interleaving() -> None:
    cfg = tr.TraceConfig(tenants=4, sessions_per_tenant=3, turns=2)
    trace = tr.generate(cfg)
    assert len(trace.sessions) == 12
    assert len(trace.requests) == 24
    assert len({s.id for s in trace.sessions}) == 12
    # consecutive sessions belong to different tenants (concurrent sessions spread tenants)
    tenants = [s.tenant for s in trace.sessions]
    assert all(a != b for a, b in itertools.pairwise(tenants))
    assert [r.turn for r in trace.sessions[0].requests] == [0, 1]


def test_hot_tenant_burst_comes_last() -> None:
    trace = tr.generate(tr.TraceConfig(tenants=3, sessions_per_tenant=1, hot_sessions=3))
    assert [s.tenant for s in trace.sessions] == ["t0", "t1", "t2", "t0", "t0", "t0"]
    assert len({s.id for s in trace.sessions}) == 6


def test_sharing_structure() -> None:
    cfg = tr.TraceConfig(tenants=2, sessions_per_tenant=4, turns=3, rag_every=2)
    trace = tr.generate(cfg)
    by_tenant: dict[str, set[str]] = {}
    for s in trace.sessions:
        systems = {r.messages[0]["content"] for r in s.requests}
        assert len(systems) == 1 and s.requests[0].messages[0]["role"] == "system"
        by_tenant.setdefault(s.tenant, set()).update(systems)
        for prev, cur in itertools.pairwise(s.requests):
            # each turn is the previous conversation, the scripted reply, then a new user turn
            assert cur.messages[: len(prev.messages)] == prev.messages
            assert [m["role"] for m in cur.messages[len(prev.messages) :]] == ["assistant", "user"]
    assert all(len(v) == 1 for v in by_tenant.values())
    assert len({next(iter(v)) for v in by_tenant.values()}) == 2  # tenants differ
    rag = [s for s in trace.sessions if s.rag]
    assert len(rag) == 4  # every second session of each tenant
    firsts = [s.requests[0].messages[1]["content"] for s in rag]
    assert all("[document " in text for text in firsts)
    assert not any("[document " in s.requests[0].messages[1]["content"] for s in trace.sessions
                   if not s.rag)  # fmt: skip


def test_request_body_is_openai_chat() -> None:
    req = tr.generate(tr.TraceConfig()).requests[0]
    body = req.body("m")
    assert body["model"] == "m" and body["stream"] is True and body["temperature"] == 0
    assert body["stream_options"] == {"include_usage": True}
    assert body["user"] == req.session
    assert "stream_options" not in req.body("m", stream=False)


def test_ideal_hit_tokens() -> None:
    a = list(range(1000))
    b = a[:600] + [-1] * 400
    assert tr.ideal_hit_tokens([a, b, a, a[:512]], 256) == [0, 512, 768, 511]


def test_bad_config_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"TraceConfig\.turns"):
        tr.TraceConfig(turns=0)
    with pytest.raises(ValueError, match="docs_per_turn"):
        tr.TraceConfig(docs_per_tenant=2, docs_per_turn=3)


def test_requests_carry_replay_order_and_session_start_times() -> None:
    trace = tr.generate(tr.TraceConfig(tenants=2, sessions_per_tenant=2, turns=2,
                                       session_interval_ms=250))  # fmt: skip
    reqs = trace.requests
    assert [r.index for r in reqs] == list(range(len(reqs)))
    for k, s in enumerate(trace.sessions):
        assert {r.arrival_s for r in s.requests} == {k * 0.25}


def test_file_round_trip_and_window(tmp_path: Path) -> None:
    trace = tr.generate(tr.TraceConfig(tenants=2, turns=2, session_interval_ms=1000))
    path = tmp_path / "agent.jsonl"
    path.write_text("".join(tr.dump_row(r) + "\n" for r in trace.requests))
    back = tr.read_agent(path)
    assert [(r.session, r.turn, r.messages, r.max_tokens, r.arrival_s) for r in back] == [
        (r.session, r.turn, r.messages, r.max_tokens, r.arrival_s) for r in trace.requests
    ]
    assert [r.line for r in back] == list(range(1, len(back) + 1))
    win = Window(start=1, count=2, from_s=1.0)
    assert [r.index for r in tr.read_agent(path, win)] == [r.index for r in tr.windowed(trace, win)]
    assert all(r.arrival_s >= 1.0 for r in tr.read_agent(path, win))


def test_bad_agent_row_names_line_and_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    good = tr.dump_row(tr.generate(tr.TraceConfig()).requests[0])
    path.write_text(good + "\n" + good.replace('"turn": 0', '"turn": "zero"') + "\n")
    with pytest.raises(TraceError, match=r"bad\.jsonl:2: turn: Expected `int`"):
        tr.read_agent(path)
    path.write_text(good.replace('"messages": [', '"messages": [1, ') + "\n")
    with pytest.raises(TraceError, match=r":1: messages\[0\]"):
        tr.read_agent(path)


def test_config_from_spec() -> None:
    cfg = tr.config_from_spec("tenants=5, turns=4,session-interval-ms=2.5")
    assert (cfg.tenants, cfg.turns, cfg.session_interval_ms) == (5, 4, 2.5)
    assert tr.config_from_spec("") == tr.TraceConfig()
    with pytest.raises(ValueError, match="'colour=1'"):
        tr.config_from_spec("colour=1")
    with pytest.raises(ValueError, match="turns: 'x' is not an integer"):
        tr.config_from_spec("turns=x")
    with pytest.raises(ValueError, match=r"TraceConfig\.turns"):
        tr.config_from_spec("turns=0")
