"""The replay's pure parts after the wire: worker counters from /metrics text, their deltas, and
the summary and Markdown of a run (kvpool.gateway.promscrape, kvpool.gateway.replay_report).
"""

from __future__ import annotations

import math

import pytest

from kvpool.gateway.loadgen import Outcome, ReplayRun
from kvpool.gateway.promscrape import ScrapeError, metrics_url, worker_counters
from kvpool.gateway.replay_report import markdown, summarize_run, worker_deltas

KVPOOL = """# HELP kvpool_worker_requests_total Requests by endpoint and outcome
# TYPE kvpool_worker_requests_total counter
kvpool_worker_requests_total{endpoint="chat",status="200"} 3.0
kvpool_worker_requests_total{endpoint="completions",status="200"} 4.0
kvpool_worker_requests_created{endpoint="chat",status="200"} 1.7e9
# TYPE kvpool_worker_prompt_tokens_total counter
kvpool_worker_prompt_tokens_total 1200.0
# TYPE kvpool_worker_prefix_hit_tokens_total counter
kvpool_worker_prefix_hit_tokens_total 512.0
"""
VLLM = """# TYPE vllm:request_success_total counter
vllm:request_success_total{finished_reason="length",model_name="m"} 5
vllm:request_success_total{finished_reason="stop",model_name="m"} 1
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{model_name="m"} 640
"""


def test_worker_counters_kvpool_and_vllm() -> None:
    assert worker_counters(KVPOOL) == {"requests": 7.0, "prompt_tokens": 1200.0,
                                       "prefix_hit_tokens": 512.0}  # fmt: skip
    assert worker_counters(VLLM) == {"requests": 6.0, "prefix_hit_tokens": 640.0}
    with pytest.raises(ScrapeError, match="not a Prometheus"):
        worker_counters('x{a="b} 1\n')


def test_metrics_url() -> None:
    assert metrics_url("http://w:8100") == "http://w:8100/metrics"
    assert metrics_url("http://w:8100/") == "http://w:8100/metrics"
    assert metrics_url("http://w:9090/custom/metrics") == "http://w:9090/custom/metrics"


def test_worker_deltas_count_a_counter_first_seen_after_from_zero() -> None:
    before = {"a": {"prompt_tokens": 100.0}, "b": {"requests": 2.0, "prompt_tokens": 0.0}}
    after = {
        "a": {"requests": 3.0, "prompt_tokens": 400.0},
        "b": {"requests": 3.0, "prompt_tokens": 50.0},
    }
    d = worker_deltas(before, after)
    assert d["a"] == {"requests": 3.0, "prompt_tokens": 300.0, "share": 0.75}
    assert d["b"] == {"requests": 1.0, "prompt_tokens": 50.0, "share": 0.25}
    assert worker_deltas(before, {"a": after["a"]}).keys() == {"a"}  # b unreadable after


def run_of(outcomes: list[Outcome]) -> ReplayRun:
    return ReplayRun(outcomes, duration_s=2.0, stopped=False, not_sent=1)


def ok(i: int, inst: str | None, ttft: float, late: float = 0.0) -> Outcome:
    return Outcome(
        i, None, due_s=i, sent_s=i + late, trace_prompt_tokens=90, status=200, ttft_s=ttft,
        e2e_s=ttft + 0.3, events=4, output_tokens=4, prompt_tokens=100, cached_tokens=25 * i,
        instance=inst, reason="kv-hit" if inst else None,
    )  # fmt: skip


def test_summary_markdown_errors_instances_lateness() -> None:
    bad = Outcome(9, None, 0.0, 0.5, status=503, error="http_503", detail="draining | soon")
    outcomes = [ok(0, "w0", 0.1), ok(1, "w1", 0.2, late=0.2), ok(2, "w0", 0.9), bad]
    s = summarize_run(run_of(outcomes), slo_ttft_s=0.5, workers={"http://w/metrics": {
        "requests": 3.0, "prompt_tokens": 300.0, "share": 1.0}})  # fmt: skip
    assert s["hit_ratio"] == pytest.approx(75 / 300)
    assert s["trace_prompt_tokens"] == 270 and s["missing_usage"] == 0
    assert s["errors"] == {"http_503": 1} and s["error_details"]["http_503"] == "draining | soon"
    assert {k: v["requests"] for k, v in s["per_instance"].items()} == {"w0": 2, "w1": 1}
    assert s["reasons"] == {"kv-hit": 3}
    assert s["lateness_s"]["max"] == pytest.approx(0.5)
    assert s["goodput"]["requests"] == 2 and s["goodput"]["share"] == pytest.approx(0.5)
    assert s["not_sent"] == 1 and s["sse_events"] == 12
    text = markdown(s)
    assert "| http_503 | 1 | draining \\| soon |" in text
    assert "| w0 | 2 | 0.667 |" in text and "| http://w/metrics | 3 | 1.000 | 300 | - |" in text
    assert "goodput: completed with TTFT ≤ 500 ms" in text


def test_summary_without_instance_header_or_answers() -> None:
    s = summarize_run(run_of([ok(0, None, 0.1)]))
    assert s["per_instance"] == {} and s["load_imbalance"] is None and s["reasons"] == {}
    empty = summarize_run(run_of([Outcome(0, None, 0.0, 0.0, error="connect")]))
    assert math.isnan(empty["ttft_s"]["p50"]) and empty["completed"] == 0
    assert "| TTFT | - | - | - | - |" in markdown(empty)
