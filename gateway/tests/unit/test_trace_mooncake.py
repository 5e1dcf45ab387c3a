"""The Mooncake-format trace reader (kvpool.gateway.traces.mooncake): any file of the format.

Good files (plain and gzip, blank lines, extra keys, any order of timestamps, float and epoch
timestamps), windows by index and by time and both, bad rows refused with file, line and field,
and the figures of a window. Also the committed real trace, read whole.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from kvpool.gateway.traces import (
    TraceError,
    TraceRequest,
    Window,
    detect_format,
    iter_mooncake,
    read_mooncake,
    trace_stats,
)
from kvpool.gateway.traces.mooncake import dump_row, sample_families

# the checkout's ../shared/traces (DESIGN.md: real traces live beside the repository)
REAL = Path(__file__).resolve().parents[4] / "shared/traces/mooncake_conversation_trace.jsonl"


def row(ts: float, n: int = 600, out: int = 5, ids: list[int] | None = None) -> dict[str, object]:
    return {"timestamp": ts, "input_length": n, "output_length": out,
            "hash_ids": ids if ids is not None else [1, 2][: -(-n // 512)]}  # fmt: skip


def write(path: Path, rows: list[object], *, blank: bool = False) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    if blank:
        lines.insert(1, "   ")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_reads_rows_in_file_order_with_lines_and_any_timestamp_order(tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl", [row(5000), row(0), row(2500.5, 100)], blank=True)
    reqs = read_mooncake(path)
    assert [r.arrival_s for r in reqs] == [5.0, 0.0, 2.5005]
    assert [r.index for r in reqs] == [0, 1, 2]
    assert [r.line for r in reqs] == [1, 3, 4]  # the blank line 2 is skipped, not counted
    assert reqs[2] == TraceRequest(2, 4, 2.5005, 100, 5, (1,))
    assert reqs[0].session is None


def test_extra_keys_ignored_gzip_and_epoch_timestamps(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl.gz"
    rows = [{**row(1.7e12), "session_id": "x", "model": "m"}, row(1.7e12 + 1000)]
    with gzip.open(path, "wt") as fp:
        fp.write("\n".join(json.dumps(r) for r in rows) + "\n")
    reqs = read_mooncake(path)
    assert [r.arrival_s for r in reqs] == [1.7e9, 1.7e9 + 1]


def test_index_window_stops_reading(tmp_path: Path) -> None:
    # rows after the window are never parsed: a bad row there does not matter
    path = write(tmp_path / "t.jsonl", [row(i * 1000) for i in range(5)] + ["not json"])
    reqs = read_mooncake(path, Window(start=1, count=3))
    assert [r.index for r in reqs] == [1, 2, 3]
    with pytest.raises(TraceError, match=r"t\.jsonl:6: not a JSON object"):
        read_mooncake(path, Window(start=1))


def test_time_window_on_unordered_timestamps_then_index_window(tmp_path: Path) -> None:
    ts = [9000, 1000, 5000, 2000, 7000, 3000]
    path = write(tmp_path / "t.jsonl", [row(t) for t in ts])
    got = read_mooncake(path, Window(from_s=2.0, to_s=7.0))
    assert [r.arrival_s for r in got] == [5.0, 2.0, 3.0]  # file order, 7.0 excluded
    got = read_mooncake(path, Window(start=1, count=1, from_s=2.0))
    assert [r.arrival_s for r in got] == [5.0]  # the second of those at or after 2 s
    with pytest.raises(TraceError, match="no request in the file"):
        read_mooncake(path, Window(from_s=100.0))


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ("{", r":2: not a JSON object"),
        ("[1, 2]", r":2: Expected `object`, got `array`"),
        (json.dumps({"timestamp": 0, "output_length": 1}), r":2: input_length: missing"),
        (json.dumps(row(0, n=-3)), r":2: input_length: Expected `int` >= 1"),
        (json.dumps({**row(0), "input_length": 600.5}), r":2: input_length: Expected `int`"),
        (json.dumps({**row(0), "output_length": True}), r":2: output_length: .* got `bool`"),
        (json.dumps(row(-1)), r":2: timestamp: Expected `float` >= 0"),
        (json.dumps({**row(0), "timestamp": "soon"}), r":2: timestamp: Expected `float`"),
        (json.dumps({**row(0), "hash_ids": [1, "x"]}), r":2: hash_ids\[1\]: Expected `int`"),
        (json.dumps({**row(0), "hash_ids": 7}), r":2: hash_ids: Expected `array`"),
    ],
)  # fmt: skip
def test_bad_row_names_file_line_and_field(tmp_path: Path, bad: str, match: str) -> None:
    path = write(tmp_path / "bad.jsonl", [row(0), bad])
    with pytest.raises(TraceError, match=r"bad\.jsonl" + match):
        read_mooncake(path)


def test_missing_empty_and_broken_gzip_files(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"nope\.jsonl: cannot read"):
        read_mooncake(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(TraceError, match="no request"):
        read_mooncake(tmp_path / "empty.jsonl")
    (tmp_path / "x.jsonl.gz").write_bytes(b"not gzip")
    with pytest.raises(TraceError, match=r"x\.jsonl\.gz: cannot read"):
        read_mooncake(tmp_path / "x.jsonl.gz")


def test_iter_is_lazy(tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl", [row(0), row(1), "oops"])
    it = iter_mooncake(path)
    assert next(it).index == 0 and next(it).index == 1
    with pytest.raises(TraceError, match=":3:"):
        next(it)


def test_dump_row_round_trips(tmp_path: Path) -> None:
    reqs = [TraceRequest(0, 1, 1.5, 700, 3, (4, 5)), TraceRequest(1, 2, 2.0, 10, 0, (6,))]
    path = tmp_path / "out.jsonl"
    path.write_text("".join(dump_row(r) + "\n" for r in reqs))
    assert read_mooncake(path) == reqs
    assert json.loads(dump_row(reqs[1]))["timestamp"] == 2000


def test_detect_format(tmp_path: Path) -> None:
    assert detect_format(write(tmp_path / "m.jsonl", [row(0)])) == "mooncake"
    agent = {"session": "s", "turn": 0, "messages": [], "max_tokens": 1}
    assert detect_format(write(tmp_path / "a.jsonl", [agent])) == "agent"
    with pytest.raises(TraceError, match=":1: neither a Mooncake row"):
        detect_format(write(tmp_path / "x.jsonl", [{"prompt": "hi"}]))


def test_trace_stats_counts_leading_blocks_seen_before() -> None:
    reqs = [
        TraceRequest(0, 1, 0.0, 1024, 1, (1, 2)),
        TraceRequest(1, 2, 2.0, 1500, 1, (1, 2, 3)),  # 1024 reusable
        TraceRequest(2, 3, 1.0, 1024, 1, (1, 9)),  # arrives second: 512 reusable
        TraceRequest(3, 4, 3.0, 400, 1, (1,)),  # all but its last token
    ]
    s = trace_stats(reqs)
    assert (s.requests, s.span_s, s.blocks, s.distinct_blocks) == (4, 3.0, 8, 4)
    assert s.prompt_tokens == 1024 + 1500 + 1024 + 400
    assert s.ideal_hit_ratio == pytest.approx((512 + 1024 + 399) / s.prompt_tokens)
    assert s.req_per_s == pytest.approx(4 / 3)


@pytest.mark.skipif(not REAL.is_file(), reason="the shared Mooncake trace is not checked out")
def test_the_real_conversation_trace() -> None:
    reqs = read_mooncake(REAL)
    s = trace_stats(reqs)
    assert (s.requests, s.blocks, s.distinct_blocks) == (12031, 288500, 182790)  # its README
    assert round(s.span_s) == 3537


def _req(index: int, ids: tuple[int, ...]) -> TraceRequest:
    return TraceRequest(index=index, line=index + 1, arrival_s=float(index), input_length=512 *
                        len(ids), output_length=1, hash_ids=ids)  # fmt: skip


def test_sample_families_keeps_whole_families_in_file_order() -> None:
    # families by their first two blocks: (0, 1) x3, (0, 2) x1, (0, 3) x2, (0, 4) x4
    reqs = [_req(i, ids) for i, ids in enumerate([
        (0, 1), (0, 2), (0, 1, 5), (0, 3), (0, 4), (0, 1, 5, 6), (0, 3, 7),
        (0, 4, 8), (0, 4, 8, 9), (0, 4, 8, 9, 10)])]  # fmt: skip
    for seed in range(20):
        got = sample_families(reqs, 6, seed=seed)
        assert [r.index for r in got] == sorted(r.index for r in got)
        assert 1 <= len(got) <= 6
        keys = {r.hash_ids[:2] for r in got}
        for key in keys:  # every chosen family is whole
            assert sum(r.hash_ids[:2] == key for r in got) == sum(
                r.hash_ids[:2] == key for r in reqs
            )
    assert sample_families(reqs, 6, seed=3) == sample_families(reqs, 6, seed=3)
    assert len({tuple(r.index for r in sample_families(reqs, 6, seed=s)) for s in range(20)}) > 1
    assert sample_families(reqs, 100) == reqs  # everything fits


def test_sample_families_cuts_one_family_when_none_fits() -> None:
    reqs = [_req(i, (0, 1, i + 2)) for i in range(5)]
    assert [r.index for r in sample_families(reqs, 3)] == [0, 1, 2]
    with pytest.raises(ValueError, match="count"):
        sample_families(reqs, 0)


@pytest.mark.skipif(not REAL.is_file(), reason="the shared Mooncake trace is not checked out")
def test_sample_of_the_real_trace_keeps_its_reuse() -> None:
    """Drawn from the first 1,500 requests, 300 requests in whole families reuse about as
    much as the 1,500 do (the first 300 of the file reuse far less)."""
    window = read_mooncake(REAL, Window(count=1500))
    whole = trace_stats(window).ideal_hit_ratio
    first = trace_stats(window[:300]).ideal_hit_ratio
    sample = trace_stats(sample_families(window, 300, seed=0)).ideal_hit_ratio
    assert first < 0.75 * whole
    assert abs(sample - whole) < 0.25 * whole
