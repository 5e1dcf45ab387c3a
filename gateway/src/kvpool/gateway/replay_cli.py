"""``kvpool-gateway replay``: replay a trace against any OpenAI-compatible endpoint and report
what its clients saw.

Why this module exists: whether a router (kvpool's gateway or any other) serves a real workload
well is measured from the client's side, on the trace's own arrival times. This command reads a
Mooncake-format trace (prompts built from its hash ids) or kvpool's agent trace
(:mod:`kvpool.gateway.replay_plan`), sends it open loop (:mod:`kvpool.gateway.loadgen`) and
reports TTFT, TPOT,
end-to-end latency, the hit ratio from usage, SLO goodput, per-instance load and errors
(:mod:`kvpool.gateway.replay_report`) as a Markdown table, JSON and a plot, with a progress line
on stderr. It is the glue: every decision lives in those modules.

    kvpool-gateway replay --trace ../shared/traces/mooncake_conversation_trace.jsonl \\
        --url http://127.0.0.1:8000 --count 500 --time-scale 4 --slo-ttft-ms 2000 --out r.json
    kvpool-gateway replay --trace agent:tenants=5,turns=4 --url http://127.0.0.1:8000

A refused input (a flag, the trace, the tokenizer, an unreachable endpoint) is one line on
stderr naming it, exit 2; a replay that ran exits 0 (its errors are in the report), 130 when
interrupted (Ctrl-C stops sending and reports what was done).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib.util
import json
import math
import signal
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from kvpool.gateway.fleetsim.stats import json_safe
from kvpool.gateway.loadgen import Endpoint, Progress, Replay, ReplayRun
from kvpool.gateway.prompts import local_tokenizer
from kvpool.gateway.promscrape import ScrapeError, metrics_url, scrape
from kvpool.gateway.replay_plan import (
    Loaded,
    load_trace,
    make_jobs,
    prompt_builder,
    save_trace,
    trace_figures,
)
from kvpool.gateway.replay_report import markdown, plot, summarize_run, worker_deltas
from kvpool.gateway.traces import (
    MOONCAKE_BLOCK_TOKENS,
    BlockPromptBuilder,
    TokenizerError,
    TraceError,
    Window,
)

EXIT_OK = 0
EXIT_REFUSED = 2
EXIT_INTERRUPTED = 130


class ReplayError(Exception):
    """Refused input; the message starts with the flag to fix."""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``replay`` on ``kvpool-gateway``'s subcommands (called by ``cli.main``)."""
    p = sub.add_parser(
        "replay",
        help="replay a Mooncake-format or agent trace against an OpenAI-compatible endpoint",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    t = p.add_argument_group("the trace")
    t.add_argument(
        "--trace",
        required=True,
        help="a trace file (Mooncake JSONL or agent JSONL, .gz too), or "
        "agent[:key=value,...] to generate kvpool's agent trace",
    )
    t.add_argument(
        "--format",
        choices=["auto", "mooncake", "agent"],
        default="auto",
        help="the file's format (default: from its first row)",
    )
    t.add_argument(
        "--start", type=int, default=0, help="skip this many requests (of the time window)"
    )
    t.add_argument("--count", type=int, help="replay at most this many requests")
    t.add_argument("--from-s", type=float, help="only requests at or after this trace second")
    t.add_argument("--to-s", type=float, help="only requests before this trace second")
    t.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="replay this many times faster than the trace (default 1)",
    )
    t.add_argument(
        "--save-trace",
        metavar="FILE",
        help="also write the selected requests to FILE, in the trace's format",
    )
    t.add_argument(
        "--dry-run",
        action="store_true",
        help="read the trace, check the prompts, print its figures; send nothing",
    )
    e = p.add_argument_group("the endpoint")
    e.add_argument("--url", help="base URL of the OpenAI-compatible endpoint (http://host:port)")
    e.add_argument("--model", help="model name (default: the first of GET /v1/models)")
    e.add_argument("--api-key", help="sent as Authorization: Bearer KEY (@FILE: read from FILE)")
    e.add_argument(
        "--header",
        action="append",
        default=[],
        metavar="'NAME: VALUE'",
        help="an extra request header (repeatable)",
    )
    e.add_argument("--concurrency", type=int, default=256, help="requests in flight at most (256)")
    e.add_argument(
        "--max-sessions",
        type=int,
        help="agent trace: sessions in progress at most (default: no limit)",
    )
    e.add_argument(
        "--timeout", type=float, default=600.0, help="seconds a request may take in all (600)"
    )
    b = p.add_argument_group("prompts of a Mooncake trace")
    b.add_argument(
        "--tokenizer",
        default="reference",
        help="tokenizer.json (or its directory) of the served model, or 'reference' "
        "(the reference engine's; default)",
    )
    b.add_argument(
        "--block-size",
        type=int,
        default=MOONCAKE_BLOCK_TOKENS,
        help=f"tokens per hash id ({MOONCAKE_BLOCK_TOKENS})",
    )
    b.add_argument("--prompt-seed", type=int, default=0, help="seed of the block texts (0)")
    b.add_argument(
        "--token-ids", action="store_true", help="send prompts as token ids instead of text"
    )
    r = p.add_argument_group("the report")
    r.add_argument("--slo-ttft-ms", type=float, help="goodput: TTFT at most this")
    r.add_argument("--slo-tpot-ms", type=float, help="goodput: TPOT at most this too")
    r.add_argument(
        "--worker-metrics",
        action="append",
        default=[],
        metavar="URL",
        help="a worker's Prometheus /metrics, read before and after (repeatable)",
    )
    r.add_argument("--out", metavar="FILE", help="write the summary and every request as JSON")
    r.add_argument("--plot", metavar="FILE", help="write a PNG (needs matplotlib)")
    r.add_argument(
        "--progress",
        type=float,
        default=5.0,
        help="seconds between progress lines on stderr (0: none; default 5)",
    )
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """The ``replay`` handler."""
    try:
        check_args(args)
        loaded, builder = load(args)
        if args.save_trace:
            try:
                save_trace(loaded, Path(args.save_trace))
            except OSError as exc:
                raise ReplayError(f"--save-trace: cannot write: {exc}") from None
        if args.dry_run:
            print(describe(loaded, args.block_size))
            return EXIT_OK
        return asyncio.run(replay(args, loaded, builder))
    except ReplayError as exc:
        print(f"kvpool-gateway replay: {exc}", file=sys.stderr)
        return EXIT_REFUSED


def check_args(args: argparse.Namespace) -> None:
    for flag, ok in (
        ("--time-scale", args.time_scale > 0 and math.isfinite(args.time_scale)),
        ("--concurrency", args.concurrency >= 1),
        ("--timeout", args.timeout > 0),
        ("--block-size", args.block_size >= 1),
        ("--max-sessions", args.max_sessions is None or args.max_sessions >= 1),
        ("--slo-ttft-ms", args.slo_ttft_ms is None or args.slo_ttft_ms > 0),
        ("--slo-tpot-ms", args.slo_tpot_ms is None or args.slo_tpot_ms > 0),
        ("--progress", args.progress >= 0),
    ):
        if not ok:
            raise ReplayError(f"{flag}: out of range: {getattr(args, _dest(flag))}")
    if args.slo_tpot_ms is not None and args.slo_ttft_ms is None:
        raise ReplayError("--slo-tpot-ms: goodput needs --slo-ttft-ms too")
    if not args.dry_run and not args.url:
        raise ReplayError("--url: the endpoint to replay against is required (or --dry-run)")
    if args.url:
        args.url = base_url(args.url)
    if args.plot and not args.dry_run and importlib.util.find_spec("matplotlib") is None:
        raise ReplayError("--plot: matplotlib is not installed (pip install matplotlib)")


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def base_url(url: str) -> str:
    """``http(s)://host:port[/prefix]`` without a trailing ``/`` or ``/v1``."""
    if not url.startswith(("http://", "https://")):
        raise ReplayError(f"--url: {url!r} is not an http:// or https:// URL")
    url = url.rstrip("/")
    return url.removesuffix("/v1")


def window(args: argparse.Namespace) -> Window:
    try:
        return Window(start=args.start, count=args.count, from_s=args.from_s, to_s=args.to_s)
    except ValueError as exc:
        raise ReplayError(f"--start/--count/--from-s/--to-s: {exc}") from None


def load(args: argparse.Namespace) -> tuple[Loaded, BlockPromptBuilder | None]:
    """The selected requests and, for a Mooncake trace, the prompt builder (every refusal a
    ReplayError naming its flag)."""
    try:
        loaded = load_trace(args.trace, args.format, window(args))
    except (TraceError, ValueError) as exc:
        raise ReplayError(f"--trace: {exc}") from None
    if loaded.format != "mooncake":
        return loaded, None
    try:
        tokenizer = local_tokenizer(args.tokenizer)
    except (OSError, ValueError) as exc:
        raise ReplayError(f"--tokenizer: {exc}") from None
    try:
        return loaded, prompt_builder(loaded, tokenizer, args.block_size, args.prompt_seed)
    except TokenizerError as exc:
        raise ReplayError(f"--tokenizer {args.tokenizer}: refused: {exc}") from None
    except TraceError as exc:
        raise ReplayError(f"--trace: {exc}; --block-size is {args.block_size}") from None


def describe(loaded: Loaded, block_size: int) -> str:
    lines = ["| trace | value |", "|---|---:|"]
    for k, v in trace_figures(loaded, block_size).items():
        lines.append(f"| {k} | {v:,.3f} |" if isinstance(v, float) else f"| {k} | {v} |")
    return "\n".join(lines)


def request_headers(args: argparse.Namespace) -> dict[str, str]:
    headers: dict[str, str] = {}
    for h in args.header:
        name, sep, value = h.partition(":")
        if not sep or not name.strip():
            raise ReplayError(f"--header: {h!r} is not 'Name: value'")
        headers[name.strip()] = value.strip()
    key = args.api_key
    if key and key.startswith("@"):
        try:
            key = Path(key[1:]).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ReplayError(f"--api-key: cannot read {key[1:]}: {exc.strerror}") from None
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return headers


async def probe(http: aiohttp.ClientSession, url: str, model: str | None) -> str:
    """The model to ask for: ``model``, else the first of ``GET /v1/models``; a ReplayError
    when the endpoint cannot be reached or refuses the key."""
    try:
        async with http.get(f"{url}/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as resp:
            status = resp.status
            body = await resp.read()
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        raise ReplayError(f"--url: cannot reach {url}: {exc or type(exc).__name__}") from None
    if status in (401, 403):
        raise ReplayError(f"--url: {url} refused the request (HTTP {status}): check --api-key")
    if model:
        return model
    try:
        return str(json.loads(body)["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise ReplayError(
            f"--model: GET {url}/v1/models answered HTTP {status} without a model; give --model"
        ) from None


class ProgressLine:
    """A progress line on stderr: sent/done/errors, in flight, and the answer rate lately."""

    def __init__(self) -> None:
        self._last = (0.0, 0)

    def __call__(self, p: Progress) -> None:
        t, done = self._last
        rate = (p.done - done) / (p.elapsed_s - t) if p.elapsed_s > t else 0.0
        self._last = (p.elapsed_s, p.done)
        print(
            f"replay: {p.elapsed_s:6.1f}s sent {p.sent}/{p.total} done {p.done} "
            f"errors {p.errors} in flight {p.inflight} | {rate:.1f} answers/s",
            file=sys.stderr,
            flush=True,
        )


async def replay(
    args: argparse.Namespace, loaded: Loaded, builder: BlockPromptBuilder | None
) -> int:
    headers = request_headers(args)
    scrape_urls = [metrics_url(u) for u in args.worker_metrics]
    async with aiohttp.ClientSession(headers=headers) as http:
        model = await probe(http, args.url, args.model)
        before = await _scrape_all(http, scrape_urls, strict=True)
    jobs = make_jobs(loaded, builder, model, args.time_scale, args.token_ids)
    endpoint = Endpoint(args.url, headers, args.timeout, args.concurrency, args.max_sessions)
    rep = Replay(
        endpoint,
        jobs,
        on_progress=ProgressLine() if args.progress else None,
        progress_every_s=args.progress or 5.0,
    )
    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
        loop.add_signal_handler(signal.SIGINT, rep.stop)
    print(
        f"replay: {len(jobs)} requests of {loaded.source} to {args.url} ({model}), "
        f"time scale {args.time_scale:g}",
        file=sys.stderr,
    )
    started = time.time()
    try:
        result = await rep.run()
    finally:
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.remove_signal_handler(signal.SIGINT)
    async with aiohttp.ClientSession(headers=headers) as http:
        after = await _scrape_all(http, scrape_urls, strict=False)
    summary = summarize_run(
        result,
        slo_ttft_s=args.slo_ttft_ms / 1e3 if args.slo_ttft_ms else None,
        slo_tpot_s=args.slo_tpot_ms / 1e3 if args.slo_tpot_ms else None,
        workers=worker_deltas(before, after),
    )
    print(markdown(summary))
    config = {
        "url": args.url,
        "model": model,
        "time_scale": args.time_scale,
        "concurrency": args.concurrency,
        "max_sessions": args.max_sessions,
        "timeout_s": args.timeout,
        "started_unix": started,
        "prompts": {
            "tokenizer": args.tokenizer,
            "block_size": args.block_size,
            "seed": args.prompt_seed,
            "token_ids": args.token_ids,
        },
    }
    write_outputs(args, loaded, config, summary, result)
    return EXIT_INTERRUPTED if result.stopped else EXIT_OK


async def _scrape_all(
    http: aiohttp.ClientSession, urls: list[str], *, strict: bool
) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for url in urls:
        try:
            out[url] = await scrape(http, url)
        except ScrapeError as exc:
            if strict:
                raise ReplayError(f"--worker-metrics: {exc}") from None
            print(f"replay: warning: --worker-metrics: {exc} (left out)", file=sys.stderr)
    return out


def write_outputs(
    args: argparse.Namespace,
    loaded: Loaded,
    config: dict[str, Any],
    summary: dict[str, Any],
    result: ReplayRun,
) -> None:
    if args.out:
        rows = [
            {**dataclasses.asdict(o), "lateness_s": o.lateness_s, "tpot_s": o.tpot_s}
            for o in result.outcomes
        ]
        doc = {
            "tool": "kvpool-gateway replay",
            "trace": trace_figures(loaded, args.block_size),
            "config": config,
            "summary": summary,
            "requests": rows,
        }
        path = Path(args.out)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(json_safe(doc), indent=1) + "\n", encoding="utf-8")
        except OSError as exc:
            print(f"replay: cannot write --out {path}: {exc.strerror}", file=sys.stderr)
    if args.plot:
        title = f"{Path(loaded.source).name} → {args.url}, time scale {args.time_scale:g}"
        try:
            plot(result, summary, Path(args.plot), title)
        except OSError as exc:
            print(f"replay: cannot write --plot {args.plot}: {exc.strerror}", file=sys.stderr)
