"""CacheBlend benchmark: TTFT proxy of full prefill vs load + re-rotate + recompute, with quality.

Why this exists: issue 4 asks whether blending a RAG prompt from independently cached chunks
is faster than prefilling it, and what it costs in accuracy. Both paths run the same decoder
code (``kvpool.kernels.blend.model``) on the same random-weight Llama (built with
transformers, seed 0), side by side in one process, interleaved, best of N (the box is shared
and noisy, so ratios matter, not absolute times). The transformers forward is timed once as a
sanity peer for the full-prefill baseline.

Prompt: ``[system 128][8 chunks, shuffled][question 64]``, 8192 tokens (2048 with ``--quick``).
Each chunk was prefilled on its own behind the system prompt. Quality is measured on the 64
question rows against full prefill: relative L2 error of the final hidden states and of the
logits, KL divergence of the next-token distributions, and top-1 agreement. A random
selection at r=0.15 and plain reuse (r=0, question only) are reported for scale.

Usage: ``python kernels/bench/blend_bench.py [--quick] [--out PATH]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import time
from pathlib import Path
from typing import Any

import torch

from kvpool.kernels.blend import (
    BlendConfig,
    DecoderWeights,
    Selector,
    blend_forward,
    full_prefill,
    load_segments,
    reposition_keys,
)
from kvpool.kernels.blend.synthetic import (
    RagPrompt,
    TinyModelSpec,
    build_hf_model,
    quality,
    rag_prompt,
    single_thread,
)

log = logging.getLogger(__name__)

RATIOS = (0.05, 0.15, 0.3)
SPEC = TinyModelSpec(layers=8, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=768)
CHECK_LAYER = 1
SYS_LEN, QUESTION_LEN, N_CHUNKS = 128, 64, 8


def _key(ratio: float) -> str:
    return f"r{round(ratio * 100):03d}"


def _now() -> tuple[float, float]:
    """(CPU seconds of this process, wall seconds)."""
    return time.process_time(), time.perf_counter()


def _since(t0: tuple[float, float]) -> tuple[float, float]:
    cpu, wall = _now()
    return cpu - t0[0], wall - t0[1]


def _blend_once(w: DecoderWeights, p: RagPrompt, cfg: BlendConfig) -> tuple[dict[str, float], Any]:
    """One timed blend: load (copy into the request buffer), re-rotate K, recompute."""
    t0 = _now()
    loaded = load_segments(w, p.tokens, p.segments, reposition=False)
    load = _since(t0)
    loaded = reposition_keys(w, loaded)
    rope = _since(t0)
    res = blend_forward(w, p.tokens, loaded, cfg, copy=False)
    total = _since(t0)
    times = {
        "load_s": load[0],
        "rerope_s": rope[0] - load[0],
        "total_s": total[0],
        "wall_s": total[1],
    }
    return times, res


def run(quick: bool) -> dict[str, Any]:
    """Measure and return ``{"metrics", "ratios", "peers", "markdown"}``."""
    import transformers

    chunk_len = (2048 if quick else 8192) - SYS_LEN - QUESTION_LEN
    chunk_len //= N_CHUNKS
    reps = 2 if quick else 3
    model = build_hf_model(SPEC)
    w = DecoderWeights.from_hf(model)
    # one intra-op thread: the box is shared, and a second thread mostly measures the neighbours
    with torch.no_grad(), single_thread():
        p = rag_prompt(
            w,
            n_chunks=N_CHUNKS,
            chunk_len=chunk_len,
            sys_len=SYS_LEN,
            question_len=QUESTION_LEN,
            seed=0,
        )
        n = int(p.tokens.shape[0])
        log.info("blend bench: %d-token prompt, %d layers, %d reps", n, SPEC.layers, reps)
        configs = {r: BlendConfig.single(r, check_layer=CHECK_LAYER) for r in (0.0, *RATIOS)}
        full_s: list[float] = []
        hf_s: list[float] = []
        full_wall: list[float] = []
        times: dict[float, list[dict[str, float]]] = {r: [] for r in configs}
        results: dict[float, Any] = {}
        reference = None
        for rep in range(reps):
            t0 = _now()
            reference = full_prefill(w, p.tokens).hidden[p.question_start :]
            full_s.append(_since(t0)[0])
            full_wall.append(_since(t0)[1])
            t0 = _now()
            model(p.tokens[None])
            hf_s.append(_since(t0)[0])
            for r, cfg in configs.items():
                t, results[r] = _blend_once(w, p, cfg)
                times[r].append(t)
            log.info(
                "blend bench: rep %d/%d done (full prefill %.2f CPU s)", rep + 1, reps, full_s[-1]
            )
        assert reference is not None
        cfg_rand = BlendConfig.single(0.15, check_layer=CHECK_LAYER, selector=Selector.RANDOM)
        rand = quality(w, reference, _blend_once(w, p, cfg_rand)[1].hidden[-QUESTION_LEN:])

    full, hf = min(full_s), min(hf_s)
    metrics: dict[str, float] = {
        "blend_prompt_tokens": float(n),
        "blend_full_prefill_ms": full * 1e3,
        "blend_hf_forward_ms": hf * 1e3,
        "blend_rel_error_random_r015": rand["hidden_rel_error"],
    }
    rows = []
    for r in configs:
        best = {k: min(t[k] for t in times[r]) for k in times[r][0]}
        q = quality(w, reference, results[r].hidden[-QUESTION_LEN:])
        key = _key(r)
        metrics[f"blend_ttft_ratio_{key}"] = best["total_s"] / full
        metrics[f"blend_rel_error_{key}"] = q["hidden_rel_error"]
        metrics[f"blend_logits_rel_error_{key}"] = q["logits_rel_error"]
        metrics[f"blend_top1_agreement_{key}"] = q["top1_agreement"]
        metrics[f"blend_kl_nats_{key}"] = q["kl_nats"]
        metrics[f"blend_ttft_wall_ratio_{key}"] = best["wall_s"] / min(full_wall)
        metrics[f"blend_ms_{key}"] = best["total_s"] * 1e3
        metrics[f"blend_load_ms_{key}"] = best["load_s"] * 1e3
        metrics[f"blend_rerope_ms_{key}"] = best["rerope_s"] * 1e3
        metrics[f"blend_selected_{key}"] = float(results[r].selected.shape[0])
        rows.append((r, best, q, int(results[r].selected.shape[0])))
    ratios = {
        f"blend_speedup_{_key(r)}": full / min(t["total_s"] for t in times[r]) for r in RATIOS
    }
    ratios["blend_full_prefill_vs_hf_forward"] = full / hf
    peers = {
        "blend_full_prefill": "kvpool.kernels.blend.full_prefill (same decoder code, every row)",
        "blend_transformers_forward": f"transformers {transformers.__version__}",
    }
    return {
        "metrics": metrics,
        "ratios": ratios,
        "peers": peers,
        "markdown": _table(n, full, hf, rows, rand, quick),
    }


def _table(
    n: int,
    full: float,
    hf_s: float,
    rows: list[tuple[float, dict[str, float], dict[str, float], int]],
    rand: dict[str, float],
    quick: bool,
) -> str:
    head = (
        f"CacheBlend, {n}-token RAG prompt ({N_CHUNKS} shuffled chunks + {QUESTION_LEN}-token "
        f"question), random-weight Llama {SPEC.layers}L/{SPEC.hidden}h/{SPEC.heads}q/"
        f"{SPEC.kv_heads}kv heads, check layer {CHECK_LAYER}, fp32, one thread; times are CPU "
        f"time of the process, best of N{' (quick)' if quick else ''}\n\n"
        "| path | recomputed rows | CPU ms | ÷ full prefill | load ms | re-rope ms "
        "| hidden rel err | logits rel err | KL nats | top-1 agree |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
        f"| full prefill | {n} | {full * 1e3:.0f} | 1.000 | – | – | 0 | 0 | 0 | 1.000 |\n"
        f"| transformers forward (peer) | {n} | {hf_s * 1e3:.0f} | {hf_s / full:.3f} "
        "| – | – | – | – | – | – |\n"
    )
    lines = []
    for r, best, q, sel in rows:
        name = "reuse only (r=0)" if r == 0 else f"blend r={r:.2f}"
        lines.append(
            f"| {name} | {sel} | {best['total_s'] * 1e3:.0f} | {best['total_s'] / full:.3f} "
            f"| {best['load_s'] * 1e3:.0f} | {best['rerope_s'] * 1e3:.0f} "
            f"| {q['hidden_rel_error']:.3f} | {q['logits_rel_error']:.3f} "
            f"| {q['kl_nats']:.4f} | {q['top1_agreement']:.3f} |"
        )
    lines.append(
        f"| random selection r=0.15 | – | – | – | – | – | {rand['hidden_rel_error']:.3f} "
        f"| {rand['logits_rel_error']:.3f} | {rand['kl_nats']:.4f} | {rand['top1_agreement']:.3f} |"
    )
    return head + "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2K-token prompt, 2 repetitions")
    parser.add_argument("--out", type=Path, help="also write the result as JSON here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    result = run(args.quick)
    print(result["markdown"])
    if args.out:
        env = {"python": platform.python_version(), "machine": platform.machine()}
        doc = {"component": "kernels", "quick": args.quick, **result, "env": env}
        args.out.write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
