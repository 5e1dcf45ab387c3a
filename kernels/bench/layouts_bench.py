"""Gather/scatter bandwidth against memcpy and against the copies users would otherwise run.

Why: every LMCache store and retrieve on the worker goes through these copies, so their
bandwidth bounds TTFT on a hit. Measured in one run, one thread, same bytes:
- memcpy: ``dst.copy_(src)`` of one chunk's bytes (the ceiling),
- ours: :func:`kvpool.kernels.layouts.paged_to_chunk` / ``chunk_to_paged``,
- LMCache 0.5.6's own CPU fallback (``multi_layer_kv_transfer`` in
  ``lmcache/v1/platform/torch_ops/mem_kernels.py``), the peer,
- a plain torch loop (``out[:, l] = flat[:, slots]`` per layer), what one writes by hand.
Shape: a 256-token chunk of a 32-layer, 8-KV-head, 128-dim fp16 model (quick: 8 layers).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from kvpool.kernels.layouts import chunk_to_paged, paged_to_chunk


def _best_of(fn: Callable[[], None], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _lmcache_peer() -> tuple[Callable[..., None], Any, Any] | None:
    try:
        from lmcache.lmcache_native import EngineKVFormat, TransferDirection
        from lmcache.v1.platform.torch_ops.mem_kernels import multi_layer_kv_transfer
    except ImportError:
        return None
    return multi_layer_kv_transfer, EngineKVFormat, TransferDirection


def run(quick: bool) -> dict[str, Any]:
    torch.set_num_threads(1)
    layers = 8 if quick else 32
    heads, dim, tokens, bs = 8, 128, 256, 16
    num_blocks = 4 * tokens // bs  # cache 4x larger than one chunk; slots scattered in it
    reps = 5 if quick else 15
    gen = torch.Generator().manual_seed(0)
    caches = [
        torch.randn((2, num_blocks, bs, heads, dim), generator=gen).to(torch.float16)
        for _ in range(layers)
    ]
    blocks = random.Random(0).sample(range(num_blocks), tokens // bs)
    slots = torch.tensor([b * bs + o for b in blocks for o in range(bs)], dtype=torch.int64)
    chunk = torch.empty((2, layers, tokens, heads * dim), dtype=torch.float16)
    nbytes = chunk.numel() * chunk.element_size()
    src = torch.randn(nbytes // 2).to(torch.float16)
    dst = torch.empty_like(src)

    t_memcpy = _best_of(lambda: dst.copy_(src), reps)
    t_gather = _best_of(lambda: paged_to_chunk(caches, slots, chunk), reps)
    t_scatter = _best_of(lambda: chunk_to_paged(chunk, caches, slots), reps)

    def naive_gather() -> None:
        for layer, c in enumerate(caches):
            chunk[:, layer] = c.view(2, -1, heads * dim)[:, slots]

    t_naive = _best_of(naive_gather, reps)
    metrics: dict[str, float] = {
        "chunk_MB": nbytes / 1e6,
        "memcpy_GBps": nbytes / t_memcpy / 1e9,
        "gather_GBps": nbytes / t_gather / 1e9,
        "scatter_GBps": nbytes / t_scatter / 1e9,
        "naive_gather_GBps": nbytes / t_naive / 1e9,
    }
    metrics["gather_scatter_vs_memcpy"] = (
        (metrics["gather_GBps"] + metrics["scatter_GBps"]) / 2 / metrics["memcpy_GBps"]
    )
    ratios = {"gather_vs_naive_loop": t_naive / t_gather}
    peers: dict[str, str] = {}
    peer = _lmcache_peer()
    if peer is not None:
        transfer, fmt_enum, direction = peer
        fmt = fmt_enum.NL_X_TWO_NB_BS_NH_HS
        kw = {"block_size": bs, "head_size": dim}
        flat = [c.view(2, -1, heads * dim) for c in caches]  # the fallback's [2, NB*BS, H*D]

        def lm_gather() -> None:
            transfer(
                chunk, flat, slots, torch.device("cpu"), num_blocks * bs, direction.D2H, fmt, **kw
            )

        def lm_scatter() -> None:
            transfer(
                chunk, flat, slots, torch.device("cpu"), num_blocks * bs, direction.H2D, fmt, **kw
            )

        t_lg, t_ls = _best_of(lm_gather, reps), _best_of(lm_scatter, reps)
        metrics["lmcache_gather_GBps"] = nbytes / t_lg / 1e9
        metrics["lmcache_scatter_GBps"] = nbytes / t_ls / 1e9
        ratios["gather_vs_lmcache"] = t_lg / t_gather
        ratios["scatter_vs_lmcache"] = t_ls / t_scatter
        import lmcache

        peers["lmcache"] = getattr(lmcache, "__version__", "0.5.6")
    rows = [
        f"| copy (256-token chunk, {layers} layers, fp16, {nbytes / 1e6:.1f} MB) | GB/s |",
        "|---|---|",
        f"| memcpy (`copy_`) | {metrics['memcpy_GBps']:.2f} |",
        f"| kvpool gather (paged → KV_2LTD) | {metrics['gather_GBps']:.2f} |",
        f"| kvpool scatter (KV_2LTD → paged) | {metrics['scatter_GBps']:.2f} |",
        f"| plain torch loop gather | {metrics['naive_gather_GBps']:.2f} |",
    ]
    if "lmcache_gather_GBps" in metrics:
        rows += [
            f"| LMCache 0.5.6 CPU fallback gather | {metrics['lmcache_gather_GBps']:.2f} |",
            f"| LMCache 0.5.6 CPU fallback scatter | {metrics['lmcache_scatter_GBps']:.2f} |",
        ]
    rows.append(f"| **gather/scatter ÷ memcpy** | **{metrics['gather_scatter_vs_memcpy']:.2f}** |")
    return {"metrics": metrics, "ratios": ratios, "peers": peers, "markdown": "\n".join(rows)}


if __name__ == "__main__":
    print(run(quick=True)["markdown"])
