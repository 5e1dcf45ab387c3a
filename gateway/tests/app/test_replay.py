"""``kvpool-gateway replay`` against a scripted fake OpenAI upstream on 127.0.0.1.

The fake answers each request as its script says (a delay before the first token, tokens at a
pace, usage with cached tokens, an ``x-kvpool-instance`` header, a 503, a hang, a cut, an error
event), so the client's own logic is tested: open-loop timing with a time scale, TTFT/TPOT,
the hit ratio from usage, SLO goodput, per-instance load, errors and timeouts counted, sessions
in order, and the command's exit codes and outputs. Every replay is bounded in time; timing
assertions use generous margins (they check the schedule, not speed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fakes import serving
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from kvpool.gateway import cli
from kvpool.gateway.loadgen import Endpoint, Replay, ReplayRun
from kvpool.gateway.replay_plan import Loaded, make_jobs
from kvpool.gateway.replay_report import summarize_run
from kvpool.gateway.traces import BlockPromptBuilder, TraceConfig, TraceRequest, Vocabulary
from kvpool.gateway.traces import agent as agent_trace
from kvpool.protocol.chat import REFERENCE_TOKENIZER_DIR, load_tokenizer

BLOCK = 16
LIMIT_S = 20  # no replay here may take longer


@dataclass
class Answer:
    """How the fake answers one request."""

    status: int = 200
    ttft_s: float = 0.0
    tokens: int = 3
    gap_s: float = 0.0
    prompt_tokens: int = 100
    cached_tokens: int = 0
    instance: str | None = None
    hang: bool = False
    cut_after: int | None = None
    error_event: bool = False
    retry_after: str | None = None


@dataclass
class Upstream:
    answer: Callable[[int, dict[str, Any]], Answer] = lambda n, body: Answer()
    arrivals: list[float] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    done: list[float] = field(default_factory=list)


def ev(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def fake_openai(up: Upstream) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.get("/metrics")
    async def metrics() -> Response:
        n = len(up.done)
        return PlainTextResponse(
            "# TYPE kvpool_worker_requests counter\n"
            f'kvpool_worker_requests_total{{endpoint="completions",status="200"}} {n}\n'
            "# TYPE kvpool_worker_prompt_tokens counter\n"
            f"kvpool_worker_prompt_tokens_total {100 * n}\n"
        )

    async def complete(request: Request) -> Response:
        loop = asyncio.get_running_loop()
        body = await request.json()
        n = len(up.arrivals)
        up.arrivals.append(loop.time())
        up.bodies.append(body)
        a = up.answer(n, body)
        headers = {"x-kvpool-instance": a.instance} if a.instance else {}
        if a.retry_after is not None:
            headers["Retry-After"] = a.retry_after
        if a.status != 200:
            return JSONResponse({"error": {"message": "draining"}}, a.status, headers=headers)
        chat = "messages" in body

        async def events() -> AsyncIterator[bytes]:
            if a.hang:
                await asyncio.sleep(3600)
            await asyncio.sleep(a.ttft_s)
            for i in range(a.tokens):
                if a.cut_after is not None and i >= a.cut_after:
                    raise RuntimeError("killed mid-stream")
                if i:
                    await asyncio.sleep(a.gap_s)
                choice = {"index": 0, "delta": {"content": f"t{i}"}} if chat else {"text": f"t{i}"}
                if i == a.tokens - 1:
                    choice["finish_reason"] = "length"
                yield ev({"choices": [choice]})
            if a.error_event:
                yield ev({"error": {"message": "x", "type": "bad_gateway", "code": "upstream_cut"}})
            usage = {"prompt_tokens": a.prompt_tokens, "completion_tokens": a.tokens,
                     "prompt_tokens_details": {"cached_tokens": a.cached_tokens}}  # fmt: skip
            yield ev({"choices": [], "usage": usage})
            yield b"data: [DONE]\n\n"
            up.done.append(loop.time())

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    app.add_api_route("/v1/completions", complete, methods=["POST"])
    app.add_api_route("/v1/chat/completions", complete, methods=["POST"])
    return app


@pytest.fixture(scope="module")
def builder() -> BlockPromptBuilder:
    vocab = Vocabulary.from_tokenizer(load_tokenizer(REFERENCE_TOKENIZER_DIR))
    return BlockPromptBuilder(vocab, block_size=BLOCK)


def mooncake(times_ms: list[float], length: int = 40, out: int = 3) -> Loaded:
    blocks = -(-length // BLOCK)
    reqs = [TraceRequest(i, i + 1, t / 1000, length, out, tuple(range(i * 10, i * 10 + blocks)))
            for i, t in enumerate(times_ms)]  # fmt: skip
    return Loaded("test", "mooncake", reqs)


async def replay(url: str, jobs: list[Any], **kw: Any) -> ReplayRun:
    endpoint = Endpoint(url, timeout_s=kw.pop("timeout_s", 10), **kw)
    return await asyncio.wait_for(Replay(endpoint, jobs).run(), LIMIT_S)


@contextlib.asynccontextmanager
async def upstream(up: Upstream) -> AsyncIterator[str]:
    async with serving(fake_openai(up)) as url:
        yield url


async def test_open_loop_on_trace_times_with_time_scale(builder: BlockPromptBuilder) -> None:
    # the first answer takes a second: an open loop still sends the rest on time
    up = Upstream(answer=lambda n, body: Answer(ttft_s=1.0 if n == 0 else 0.0))
    async with upstream(up) as url:
        jobs = make_jobs(mooncake([0, 1000, 2000, 3000]), builder, "m", time_scale=4)
        assert [j.at_s for j in jobs] == [0.0, 0.25, 0.5, 0.75]
        run = await replay(url, jobs)
    offsets = [t - up.arrivals[0] for t in up.arrivals]
    assert offsets == pytest.approx([0.0, 0.25, 0.5, 0.75], abs=0.1)
    assert all(o.ok for o in run.outcomes)
    assert max(o.lateness_s for o in run.outcomes) < 0.1
    assert run.outcomes[0].ttft_s is not None and run.outcomes[0].ttft_s >= 1.0


async def test_any_order_of_rows_is_sent_in_time_order(builder: BlockPromptBuilder) -> None:
    up = Upstream()
    async with upstream(up) as url:
        jobs = make_jobs(mooncake([300, 0, 150]), builder, "m", time_scale=1)
        await replay(url, jobs)
    # row 1 (t=0) first, then row 2, then row 0: their prompts tell them apart
    sent = [b["prompt"] for b in up.bodies]
    want = [builder.text(tuple(range(i * 10, i * 10 + 3)), 40) for i in (1, 2, 0)]
    assert sent == want


async def test_bodies_text_and_token_ids(builder: BlockPromptBuilder) -> None:
    up = Upstream()
    async with upstream(up) as url:
        loaded = mooncake([0], length=40, out=7)
        await replay(url, make_jobs(loaded, builder, "m", token_ids=True))
        await replay(url, make_jobs(loaded, builder, "m"))
    ids_body, text_body = up.bodies
    assert ids_body["prompt"] == builder.token_ids((0, 1, 2), 40)
    assert text_body["prompt"] == builder.text((0, 1, 2), 40)
    for body in up.bodies:
        assert body["max_tokens"] == 7 and body["ignore_eos"] is True and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True} and body["model"] == "m"


async def test_ttft_and_tpot(builder: BlockPromptBuilder) -> None:
    up = Upstream(answer=lambda n, body: Answer(ttft_s=0.2, tokens=5, gap_s=0.05))
    async with upstream(up) as url:
        run = await replay(url, make_jobs(mooncake([0]), builder, "m"))
    (o,) = run.outcomes
    assert o.ttft_s is not None and 0.2 <= o.ttft_s < 0.5
    assert o.tpot_s is not None and 0.045 <= o.tpot_s < 0.2
    assert o.e2e_s is not None and o.e2e_s >= 0.4
    assert o.output_tokens == 5 and o.events == 6  # five tokens and the usage event


async def test_hit_ratio_goodput_and_per_instance_load(builder: BlockPromptBuilder) -> None:
    script = [("a", 0, 0.0), ("a", 50, 0.0), ("b", 50, 0.3), ("a", 100, 0.0)]

    def answer(n: int, body: dict[str, Any]) -> Answer:
        inst, cached, ttft = script[n]
        return Answer(instance=inst, cached_tokens=cached, ttft_s=ttft, tokens=2)

    up = Upstream(answer=answer)
    async with upstream(up) as url:
        run = await replay(url, make_jobs(mooncake([0, 50, 100, 150]), builder, "m"),
                           concurrency=1)  # fmt: skip
    s = summarize_run(run, slo_ttft_s=0.15)
    assert s["hit_ratio"] == pytest.approx(200 / 400)
    assert (s["prompt_tokens"], s["cached_tokens"], s["trace_prompt_tokens"]) == (400, 200, 160)
    assert s["goodput"]["requests"] == 3 and s["goodput"]["share"] == pytest.approx(0.75)
    assert s["goodput"]["req_per_s"] == pytest.approx(3 / s["duration_s"])
    assert {k: v["requests"] for k, v in s["per_instance"].items()} == {"a": 3, "b": 1}
    assert s["load_imbalance"] == pytest.approx(1.5)
    assert s["errors"] == {} and s["completed"] == 4


async def test_errors_and_timeouts_are_counted_and_never_hang(
    builder: BlockPromptBuilder,
) -> None:
    script = [Answer(status=503), Answer(hang=True), Answer(cut_after=1),
              Answer(error_event=True), Answer(), Answer(status=429)]  # fmt: skip
    up = Upstream(answer=lambda n, body: script[n])
    async with upstream(up) as url:
        jobs = make_jobs(mooncake([i * 20 for i in range(6)]), builder, "m")
        t0 = time.monotonic()
        run = await replay(url, jobs, timeout_s=0.5)
        assert time.monotonic() - t0 < 5
    kinds = [o.error for o in sorted(run.outcomes, key=lambda o: o.index)]
    assert kinds == ["http_503", "timeout", "disconnect", "stream_upstream_cut", None, "http_429"]
    s = summarize_run(run)
    assert s["errors"] == {"http_503": 1, "timeout": 1, "disconnect": 1,
                           "stream_upstream_cut": 1, "http_429": 1}  # fmt: skip
    assert s["completed"] == 1 and "draining" in s["error_details"]["http_503"]
    assert run.outcomes[0].status in (503, 200)


async def test_unreachable_endpoint_counts_connect_errors(builder: BlockPromptBuilder) -> None:
    run = await replay("http://127.0.0.1:9", make_jobs(mooncake([0, 0]), builder, "m"))
    assert [o.error for o in run.outcomes] == ["connect", "connect"]


async def test_concurrency_bound_shows_as_lateness(builder: BlockPromptBuilder) -> None:
    up = Upstream(answer=lambda n, body: Answer(ttft_s=0.2))
    async with upstream(up) as url:
        run = await replay(url, make_jobs(mooncake([0, 0, 0]), builder, "m"), concurrency=1)
    late = sorted(o.lateness_s for o in run.outcomes)
    assert late[0] < 0.1 and late[2] >= 0.35
    assert summarize_run(run)["lateness_s"]["max"] >= 0.35


def agent_loaded() -> Loaded:
    trace = agent_trace.generate(TraceConfig(tenants=2, sessions_per_tenant=1, turns=2,
                                             system_words=20, rag_every=0))  # fmt: skip
    return Loaded("agent", "agent", trace.requests)


@pytest.mark.parametrize("max_sessions", [None, 1])
async def test_session_turns_in_order_and_max_sessions(max_sessions: int | None) -> None:
    up = Upstream(answer=lambda n, body: Answer(ttft_s=0.15))
    async with upstream(up) as url:
        jobs = make_jobs(agent_loaded(), None, "m")
        run = await replay(url, jobs, max_sessions=max_sessions)
    seen = [(b["user"], (len(b["messages"]) - 2) // 2) for b in up.bodies]
    if max_sessions == 1:  # one session at a time, each turn after the previous answer
        assert seen == [("t0-s0", 0), ("t0-s0", 1), ("t1-s0", 0), ("t1-s0", 1)]
    else:  # both sessions at once, turns in order
        assert sorted(seen[:2]) == [("t0-s0", 0), ("t1-s0", 0)]
        assert sorted(seen[2:]) == [("t0-s0", 1), ("t1-s0", 1)]
    late = {(o.session, o.index): o.lateness_s for o in run.outcomes}
    assert all(o.ok for o in run.outcomes)
    # waiting for the session's previous turn is not lateness; waiting for a session slot is
    assert late[("t0-s0", 0)] < 0.1 and late[("t0-s0", 1)] < 0.1 and late[("t1-s0", 3)] < 0.1
    assert (late[("t1-s0", 2)] >= 0.25) if max_sessions == 1 else (late[("t1-s0", 2)] < 0.1)


async def test_stop_cancels_in_flight_and_reports(builder: BlockPromptBuilder) -> None:
    up = Upstream(answer=lambda n, body: Answer(hang=True))
    async with upstream(up) as url:
        jobs = make_jobs(mooncake([0, 0, 5000]), builder, "m")
        rep = Replay(Endpoint(url, timeout_s=60), jobs)
        task = asyncio.create_task(rep.run())
        await asyncio.sleep(0.3)
        rep.stop()
        run = await asyncio.wait_for(task, 5)
    assert run.stopped and run.not_sent == 1
    assert [o.error for o in run.outcomes] == ["cancelled", "cancelled"]


async def test_a_retrying_client_retries_what_it_may_and_keeps_each_attempt(
    builder: BlockPromptBuilder,
) -> None:
    # per row: a 503 with Retry-After then an answer; a 502 without it then a cut stream then an
    # error event then an answer; a hang (timeout: never retried); a 400 (never retried)
    script = {0: [Answer(status=503, retry_after="0"), Answer()],
              1: [Answer(status=502), Answer(cut_after=1), Answer(error_event=True), Answer()],
              2: [Answer(hang=True)], 3: [Answer(status=400)]}  # fmt: skip
    tries: dict[int, int] = {}

    def answer(n: int, body: dict[str, Any]) -> Answer:
        row = next(i for i in script if body["prompt"] == prompts[i])
        tries[row] = tries.get(row, 0) + 1
        return script[row][tries[row] - 1]

    jobs = make_jobs(mooncake([0, 0, 0, 0]), builder, "m")
    prompts = [builder.text(tuple(range(i * 10, i * 10 + 3)), 40) for i in range(4)]
    async with upstream(Upstream(answer=answer)) as url:
        run = await replay(url, jobs, timeout_s=1, retries=4, keep_text=True)
    by = {o.index: o for o in run.outcomes}
    assert by[0].ok and [(a.error, a.retry_after, a.wait_s) for a in by[0].attempts] == [
        ("http_503", "0", 0.5)  # Retry-After is a floor: the client still backs off
    ]
    assert by[1].ok and [a.error for a in by[1].attempts] == [
        "http_502", "disconnect", "stream_upstream_cut"
    ]  # fmt: skip
    assert [a.wait_s for a in by[1].attempts] == [0.5, 1.0, 2.0]  # no Retry-After: backoff
    for o in (by[0], by[1]):
        assert (o.text, o.done, o.finish_reason, o.output_tokens) == ("t0t1t2", True, "length", 3)
    assert (by[2].error, by[2].attempts) == ("timeout", [])
    assert (by[3].error, by[3].attempts) == ("http_400", [])


async def test_finish_sends_nothing_more_and_lets_in_flight_answer(
    builder: BlockPromptBuilder,
) -> None:
    up = Upstream(answer=lambda n, body: Answer(ttft_s=0.5))
    async with upstream(up) as url:
        rep = Replay(Endpoint(url, timeout_s=10), make_jobs(mooncake([0, 5000]), builder, "m"))
        task = asyncio.create_task(rep.run())
        await asyncio.sleep(0.2)
        rep.finish()
        run = await asyncio.wait_for(task, 5)
    assert run.not_sent == 1 and [o.error for o in run.outcomes] == [None]


# the command: flags, exit codes, outputs (it runs its own event loop: in a thread here)


async def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = await asyncio.wait_for(asyncio.to_thread(cli.main, ["replay", *argv]), LIMIT_S)
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def trace_file(tmp_path: Path, rows: int = 6, length: int = 40) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(
        json.dumps({"timestamp": i * 100, "input_length": length, "output_length": 2,
                    "hash_ids": [0] + [i * 10 + k for k in range(1, -(-length // BLOCK))]}) + "\n"
        for i in range(rows)))  # fmt: skip
    return path


async def test_cli_replays_and_writes_json_table_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    up = Upstream(answer=lambda n, body: Answer(instance=f"w{n % 2}", cached_tokens=16))
    async with upstream(up) as url:
        out_json, png = tmp_path / "r.json", tmp_path / "r.png"
        code, out, err = await run_cli(
            ["--trace", str(trace_file(tmp_path)), "--url", url + "/v1/", "--block-size",
             str(BLOCK), "--time-scale", "10", "--slo-ttft-ms", "1000", "--worker-metrics",
             url, "--out", str(out_json), "--plot", str(png), "--progress", "0.02",
             "--header", "x-test: 1", "--api-key", "sk-test"], capsys)  # fmt: skip
    assert code == 0, err
    assert "| TTFT |" in out and "| w0 |" in out and "goodput" in out
    assert "replay:" in err and "sent 6/6" in err
    doc = json.loads(out_json.read_text())
    s = doc["summary"]
    assert s["requests"] == 6 and s["completed"] == 6 and s["hit_ratio"] == pytest.approx(0.16)
    assert s["goodput"]["share"] == 1.0
    assert s["workers"][url + "/metrics"]["requests"] == 6
    assert doc["config"]["model"] == "fake-model" and len(doc["requests"]) == 6
    assert doc["trace"]["requests"] == 6 and doc["trace"]["distinct_blocks"] == 13
    assert png.stat().st_size > 10_000
    assert all(b["model"] == "fake-model" for b in up.bodies)


async def test_cli_sends_headers_and_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[dict[str, str]] = []
    app = fake_openai(Upstream())

    @app.middleware("http")
    async def record(request: Request, call_next: Any) -> Response:
        seen.append(dict(request.headers))
        return await call_next(request)  # type: ignore[no-any-return]

    key = tmp_path / "key"
    key.write_text("sk-file\n")
    async with serving(app) as url:
        code, _, err = await run_cli(
            ["--trace", str(trace_file(tmp_path, rows=1)), "--url", url, "--block-size",
             str(BLOCK), "--header", "x-team: kv", "--api-key", f"@{key}", "--progress", "0"],
            capsys)  # fmt: skip
    assert code == 0, err
    posted = [h for h in seen if "content-type" in h and h["content-type"] == "application/json"]
    assert posted and all(h["authorization"] == "Bearer sk-file" for h in posted)
    assert all(h["x-team"] == "kv" for h in posted)


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--url", "http://127.0.0.1:9"], "--url: cannot reach http://127.0.0.1:9"),
        (["--url", "ftp://x"], "--url: 'ftp://x' is not an http"),
        (["--dry-run", "--time-scale", "0"], "--time-scale: out of range"),
        (["--dry-run", "--block-size", "512"], r":1: input_length 40 needs 1 block\(s\) of 512"),
        (["--dry-run", "--tokenizer", "/nope"], "--tokenizer: no tokenizer file"),
        (["--dry-run", "--count", "0"], "--count.*count must be >= 1"),
        (["--url", "http://127.0.0.1:9", "--slo-tpot-ms", "5"], "--slo-tpot-ms: .*--slo-ttft-ms"),
        (["--url", "http://127.0.0.1:9", "--header", "nocolon"], "--header: 'nocolon'"),
        ([], "--url: the endpoint to replay against is required"),
    ],
)  # fmt: skip
async def test_cli_refusals_are_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], match: str
) -> None:
    base = ["--trace", str(trace_file(tmp_path, rows=2, length=40))]
    if "--block-size" not in argv:
        base += ["--block-size", str(BLOCK)]
    code, _, err = await run_cli([*base, *argv], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvpool-gateway replay: ")
    assert re.search(match, lines[0]), lines[0]


async def test_cli_bad_trace_file_names_line_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = trace_file(tmp_path, rows=3)
    rows = path.read_text().splitlines()
    rows[2] = rows[2].replace('"output_length": 2', '"output_length": "two"')
    path.write_text("\n".join(rows) + "\n")
    code, _, err = await run_cli(["--trace", str(path), "--dry-run"], capsys)
    assert code == 2
    assert err.strip() == (f"kvpool-gateway replay: --trace: {path}:3: output_length: "
                           "Expected `int`, got `str`")  # fmt: skip
    code, _, err = await run_cli(["--trace", str(tmp_path / "missing.jsonl"), "--dry-run"], capsys)
    assert code == 2 and "missing.jsonl: cannot read" in err


async def test_cli_dry_run_window_and_save_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    saved = tmp_path / "window.jsonl"
    code, out, err = await run_cli(
        ["--trace", str(trace_file(tmp_path, rows=10)), "--block-size", str(BLOCK), "--from-s",
         "0.2", "--start", "1", "--count", "3", "--dry-run", "--save-trace", str(saved)],
        capsys)  # fmt: skip
    assert code == 0, err
    assert "| requests | 3 |" in out
    rows = [json.loads(line) for line in saved.read_text().splitlines()]
    assert [r["timestamp"] for r in rows] == [300, 400, 500]
    code, out, _ = await run_cli(["--trace", "agent:tenants=2,turns=2", "--dry-run"], capsys)
    assert code == 0 and "| format | agent |" in out and "| sessions | 4 |" in out


async def test_cli_agent_trace_through_chat(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    up = Upstream()
    async with upstream(up) as url:
        code, _, err = await run_cli(
            ["--trace", "agent:tenants=2,sessions_per_tenant=1,turns=2,system_words=20",
             "--url", url, "--max-sessions", "1", "--model", "given", "--progress", "0"],
            capsys)  # fmt: skip
    assert code == 0, err
    assert len(up.bodies) == 4 and all(b["model"] == "given" for b in up.bodies)
    assert all("messages" in b for b in up.bodies)
