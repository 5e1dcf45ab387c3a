"""PD bypass benchmark: TTFT of the requests the gateway sends straight to the decoder, against
the same requests through prefill and transfer.

Why this module exists: the bypass (``spec.gateway.pd.bypassMinCachedRatio``) is worth having
only if a decoder that already holds most of a prompt answers sooner alone than a prefill
instance that recomputes the whole prompt and then transfers it. The domain is
``pd_bypass_pool.yaml`` (one platform cpu PD pair, the reference engine with the real LMCache,
KV over NIXL/UCX, the controller), run from the operator's render like the routing benchmark's
(``domain.Domain``); the bypass arm is the rendered gateway, the PD arm the gateway of the same
pool rendered with the ratio 0. Both replay the same trace with the product's client
(:mod:`kvpool.gateway.loadgen`: streamed requests one at a time, TTFT to the first content
event). The box is shared and its load drifts, so a full run makes two passes in opposite order
(bypass then PD, PD then bypass) and pools them by request. Before each bypass arm every prompt
of the trace is evicted from the decoder and the bench waits until neither the decoder nor the
controller's index holds any of it (``replay.clear_workers``), so each bypass arm starts cold:
its first turns go through PD and later ones find what the decoder kept. The PD arm's requests
go through prefill whatever the decoder holds (it loads the transferred prompt), and the
prefill instance keeps nothing. Each gateway first answers one warm-up request.

The trace is the agent trace (multi-turn sessions; ``--trace agent:...``) or any Mooncake-format
file (``--trace FILE``): its rows are scaled to ``--block-size`` tokens a hash id (the reference
model's context is short) and their answers cut to ``--max-output`` tokens.

    python gateway/bench/pd_bypass.py --out bench-results/pd_bypass.json [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import domain
import httpx
import replay as replay_bench
import yaml
from domain import log

from kvpool.gateway.loadgen import Endpoint, Outcome, Replay
from kvpool.gateway.prompts import local_tokenizer
from kvpool.gateway.replay_plan import Loaded, load_trace, make_jobs, prompt_builder
from kvpool.gateway.traces import MOONCAKE_BLOCK_TOKENS, TraceRequest, Window

HERE = Path(__file__).resolve().parent
POOL = HERE / "pd_bypass_pool.yaml"
AGENT = (
    "agent:tenants=2,sessions_per_tenant=3,turns=4,system_words=500,docs_per_turn=2,max_tokens=8"
)
AGENT_QUICK = (
    "agent:tenants=2,sessions_per_tenant=1,turns=3,system_words=400,docs_per_turn=1,max_tokens=4"
)
BYPASS, PD = "pd-bypass", "pd"


def off_pool(root: Path) -> Path:
    """``pd_bypass_pool.yaml`` with the bypass off (the PD arm's gateway renders from it)."""
    docs = list(yaml.safe_load_all(POOL.read_text(encoding="utf-8")))
    for doc in docs:
        if doc.get("kind") == "KVCachePool":
            doc["spec"]["gateway"]["pd"]["bypassMinCachedRatio"] = 0
    path = root / "pd-bypass-off.yaml"
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False), encoding="utf-8")
    return path


def scaled(req: TraceRequest, block: int, max_output: int) -> TraceRequest:
    """A Mooncake row at ``block`` tokens a hash id (the last block cut in proportion) and at
    most ``max_output`` answer tokens."""
    n = len(req.hash_ids)
    last = req.input_length - (n - 1) * MOONCAKE_BLOCK_TOKENS
    tail = max(1, math.ceil(last * block / MOONCAKE_BLOCK_TOKENS))
    return dataclasses.replace(
        req,
        input_length=(n - 1) * block + tail,
        output_length=max(1, min(req.output_length, max_output)),
    )


#: The domain's engines serve 4096 tokens (pd_bypass_pool.yaml's maxModelLen): a scaled
#: Mooncake row longer than this with its answer is left out (and counted).
MAX_TOKENS = 4000


def trace(spec: str, count: int | None, block: int, max_output: int) -> tuple[Loaded, int]:
    """The trace's window (a Mooncake file's rows scaled) and how many rows were left out."""
    loaded = load_trace(spec, window=Window(count=count))
    if loaded.format != "mooncake":
        return loaded, 0
    rows = [scaled(r, block, max_output) for r in loaded.requests if isinstance(r, TraceRequest)]
    kept = [r for r in rows if r.input_length + r.output_length <= MAX_TOKENS]
    return Loaded(loaded.source, loaded.format, kept), len(rows) - len(kept)


def prompts(loaded: Loaded, decoder: str, model: str, block: int) -> list[list[int]]:
    """The exact prompt token ids of every request (an agent turn as the decoder renders it)."""
    builder = prompt_builder(loaded, local_tokenizer("reference", model), block)
    if builder is None:
        return replay_bench.tokenize_all(decoder, loaded)  # type: ignore[arg-type]
    rows = [r for r in loaded.requests if isinstance(r, TraceRequest)]
    return [builder.token_ids(r.hash_ids, r.input_length) for r in rows]


async def replay(url: str, loaded: Loaded, model: str, block: int) -> list[Outcome]:
    """Every request of ``loaded`` through ``url``, one at a time (a session's turns in
    order), after one warm-up request; a failure raises."""
    builder = prompt_builder(loaded, local_tokenizer("reference", model), block)
    jobs = make_jobs(loaded, builder, model, time_scale=1e9, token_ids=True)
    async with httpx.AsyncClient(timeout=300) as client:
        warm = {"model": model, "prompt": [7] * 40, "max_tokens": 2, "temperature": 0}
        (await client.post(f"{url}/v1/completions", json=warm)).raise_for_status()
    endpoint = Endpoint(url, timeout_s=300, concurrency=1, max_sessions=1, keep_text=True)
    run = await Replay(endpoint, jobs).run()
    for o in run.outcomes:
        if not o.ok or o.ttft_s is None:
            raise RuntimeError(f"{url}: request {o.index}: {o.error}: {o.detail[:300]}")
    return sorted(run.outcomes, key=lambda o: o.index)


def _ms(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3, 1)


def paired(on: list[Outcome], off: list[Outcome]) -> list[tuple[Outcome, Outcome]]:
    """Each request of one pass in the bypass arm (``on``) and the PD arm, by trace index."""
    by_off = {o.index: o for o in off}
    return [(o, by_off[o.index]) for o in on if o.index in by_off]


def summarize(pairs: list[tuple[Outcome, Outcome]]) -> dict[str, Any]:
    """Per request its TTFT in both arms (every pass); the bypassed ones' and the rest's
    medians and p90s, and the bypassed ones' per-request speedup."""
    bypassed = [(a, b) for a, b in pairs if a.reason == BYPASS]
    other = [(a, b) for a, b in pairs if a.reason != BYPASS]
    assert all(b.reason == PD for _, b in pairs), "the PD arm must send every request through PD"
    speedup = [b.ttft_s / a.ttft_s for a, b in bypassed if a.ttft_s and b.ttft_s]

    def side(rows: list[tuple[Outcome, Outcome]], i: int) -> list[float]:
        return [float(r[i].ttft_s or 0.0) for r in rows]

    return {
        "requests": len(pairs),
        "bypassed": len(bypassed),
        "bypassed_ttft_p50_ms": _ms(side(bypassed, 0), 0.5),
        "bypassed_ttft_p90_ms": _ms(side(bypassed, 0), 0.9),
        "same_via_pd_ttft_p50_ms": _ms(side(bypassed, 1), 0.5),
        "same_via_pd_ttft_p90_ms": _ms(side(bypassed, 1), 0.9),
        "speedup_median": round(statistics.median(speedup), 2) if speedup else float("nan"),
        "speedup_min": round(min(speedup), 2) if speedup else float("nan"),
        "not_bypassed_ttft_p50_ms": _ms(side(other, 0), 0.5),
        "not_bypassed_via_pd_ttft_p50_ms": _ms(side(other, 1), 0.5),
        "bypassed_cached_tokens_mean": round(
            statistics.mean(a.cached_tokens or 0 for a, _ in bypassed), 1
        )
        if bypassed
        else 0.0,
        "bypassed_prompt_tokens_mean": round(
            statistics.mean(a.prompt_tokens or 0 for a, _ in bypassed), 1
        )
        if bypassed
        else 0.0,
        "same_text": sum(a.text == b.text for a, b in pairs),
    }


def _row(a: Outcome, b: Outcome) -> dict[str, Any]:
    """One request in both arms (``a``: the bypass arm's, ``b``: the PD arm's)."""
    return {
        "index": a.index,
        "session": a.session,
        "reason": a.reason,
        "prompt_tokens": a.prompt_tokens,
        "cached_tokens": a.cached_tokens,
        "ttft_ms_bypass_arm": round((a.ttft_s or 0) * 1e3, 1),
        "ttft_ms_pd_arm": round((b.ttft_s or 0) * 1e3, 1),
    }


def table(m: dict[str, Any]) -> str:
    rows = [
        ("requests, all passes (bypassed)", f"{m['requests']} ({m['bypassed']})"),
        (
            "bypassed: TTFT p50 / p90, straight to the decoder",
            f"{m['bypassed_ttft_p50_ms']} / {m['bypassed_ttft_p90_ms']} ms",
        ),
        (
            "the same requests through prefill + transfer",
            f"{m['same_via_pd_ttft_p50_ms']} / {m['same_via_pd_ttft_p90_ms']} ms",
        ),
        ("per-request speedup, median (min)", f"{m['speedup_median']}x ({m['speedup_min']}x)"),
        (
            "bypassed: prompt tokens held by the decoder (mean)",
            f"{m['bypassed_cached_tokens_mean']} of {m['bypassed_prompt_tokens_mean']}",
        ),
        (
            "not bypassed (below the ratio): TTFT p50, bypass arm / PD arm",
            f"{m['not_bypassed_ttft_p50_ms']} / {m['not_bypassed_via_pd_ttft_p50_ms']} ms",
        ),
        ("answers equal in both arms", f"{m['same_text']} of {m['requests']}"),
    ]
    head = f"| PD bypass (bypassMinCachedRatio 0.5), {m['passes']} pass(es) | measured |"
    lines = [head, "| --- | --- |"]
    return "\n".join([*lines, *(f"| {a} | {b} |" for a, b in rows)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--out", required=True, help="JSON result path (the table beside it, .md)")
    ap.add_argument("--quick", action="store_true", help="a smaller agent trace")
    ap.add_argument("--trace", help="agent:KEY=VALUE,... or a Mooncake-format file")
    ap.add_argument("--count", type=int, help="replay at most this many requests")
    ap.add_argument("--block-size", type=int, default=16, help="Mooncake: tokens per hash id")
    ap.add_argument("--max-output", type=int, default=8, help="Mooncake: answer tokens at most")
    args = ap.parse_args()
    spec = args.trace or (AGENT_QUICK if args.quick else AGENT)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvpool-pd-bypass-") as tmp:
        dom = domain.Domain.render(Path(tmp), POOL)
        model = str(dom.gateway_config["model"])
        loaded, left_out = trace(spec, args.count, args.block_size, args.max_output)
        if left_out:
            log(f"{left_out} rows longer than {MAX_TOKENS} tokens once scaled: left out")
        orders = [("bypass", "pd")] if args.quick else [("bypass", "pd"), ("pd", "bypass")]
        pairs: list[tuple[Outcome, Outcome]] = []
        drift = []
        try:
            log(f"controller ready in {dom.start(dom.names('controller')):.1f}s")
            log(f"PD pair {dom.names('worker')} ready in {dom.start(dom.names('worker')):.1f}s")
            (decoder,) = [n for n in dom.names("worker") if "-decode-" in n]
            decoder_url = f"http://127.0.0.1:{dom.ports(decoder)['http']}"
            toks = prompts(loaded, decoder_url, model, args.block_size)
            for order in orders:
                arms: dict[str, list[Outcome]] = {}
                for arm in order:
                    if arm == "bypass":
                        took = replay_bench.clear_workers([decoder_url], dom.controller_url, toks)
                        log(f"decoder and index clear of the trace in {took:.1f}s")
                    variant = None if arm == "bypass" else off_pool(Path(tmp))
                    with dom.gateway(pool_file=variant, tag=f"-{arm}") as (url, _):
                        log(f"{arm} arm: {len(loaded.requests)} requests of {spec}")
                        arms[arm] = asyncio.run(replay(url, loaded, model, args.block_size))
                got = paired(arms["bypass"], arms["pd"])
                pairs += got
                drift.append(summarize(got)["not_bypassed_ttft_p50_ms"])
        finally:
            dom.close()
    metrics = summarize(pairs)
    metrics["passes"] = len(orders)
    metrics["wall_s"] = round(time.monotonic() - t0, 1)
    result = {
        "component": "gateway",
        "bench": "pd_bypass",
        "quick": bool(args.quick),
        "metrics": metrics,
        "env": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "pool": str(POOL.relative_to(HERE.parents[1])),
            "trace": spec,
            "rows_left_out": left_out,
            "loadavg_1m_end": os.getloadavg()[0],
            "arm_orders": orders,
            "not_bypassed_ttft_p50_ms_per_pass": drift,
            "requests": [_row(a, b) for a, b in pairs],
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    md = table(metrics)
    out.with_suffix(".md").write_text(md + "\n")
    print(md)
    log(f"wrote {out} and {out.with_suffix('.md')} in {metrics['wall_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
