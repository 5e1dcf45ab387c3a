"""Worker benchmark: TTFT of the reference engine on a KV miss vs a KV hit from each LMCache
tier, and LMCache store/retrieve bandwidth against torch's memcpy of the same bytes.

Why this module exists: the worker's claims ("a DDR hit costs under a fifth of a prefill",
"retrieve runs at over half of memcpy") are measured here, side by side in one run, never in
tests. Tiers: local_cpu (DDR), local_disk, Redis and Mooncake, each a real service started on
127.0.0.1 free ports and stopped at the end; the hit of a lower tier is served by that tier
(``local_cpu: false``). Writes the JSON of DESIGN.md to ``--out``, a Markdown table to stdout
and a PNG plot of TTFT against prompt length next to the JSON. KV transfer between processes
(LMCache P2P and PD next to raw NIXL, the same bytes) is measured by ``transfer_bench``.

    python worker/bench/run.py [--quick] --out bench-results/worker.json
"""

from __future__ import annotations

import os

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

import argparse
import asyncio
import contextlib
import dataclasses
import importlib.metadata
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_bench
import services
import torch
import transfer_bench

from kvpool.worker.engine import ReferenceEngine
from kvpool.worker.engine.model import model_shape
from kvpool.worker.engine.offload import LMCacheOffload
from kvpool.worker.engine_api import ReferenceEngineOptions

TIERS = ("local_cpu", "local_disk", "redis", "mooncake")
SUFFIX = {"local_cpu": "", "local_disk": "_disk", "redis": "_redis", "mooncake": "_mooncake"}
CHUNK = 256


def log(msg: str) -> None:
    print(f"[worker-bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def tier_config(tier: str, tmp: Path, svc: dict[str, Any]) -> dict[str, Any]:
    base: dict[str, Any] = {"chunk_size": CHUNK, "max_local_cpu_size": 1.0}
    if tier == "local_cpu":
        return {**base, "local_cpu": True}
    if tier == "local_disk":
        disk = tmp / "disk"
        disk.mkdir(exist_ok=True)
        return {**base, "local_cpu": False, "local_disk": f"file://{disk}/",
                "max_local_disk_size": 2.0}  # fmt: skip
    if tier == "redis":
        return {**base, "local_cpu": False, "remote_url": svc["redis"], "remote_serde": "naive"}
    mc = svc["mooncake"]
    return {**base, "local_cpu": False, "remote_url": mc["remote_url"], "remote_serde": "naive",
            "extra_config": mc["extra_config"]}  # fmt: skip


def make_offload(config: dict[str, Any], opts: ReferenceEngineOptions, name: str) -> LMCacheOffload:
    """An offload for the reference engine of ``opts``."""
    return shape_offload(config, demo_shape(opts), name, opts.model_name)


def shape_offload(
    config: dict[str, Any], shape: KVShape, name: str, model_name: str
) -> LMCacheOffload:
    return LMCacheOffload(
        config,
        instance_id=name,
        num_layers=shape.num_layers,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        block_size=shape.block_size,
        dtype=shape.dtype,
        model_name=model_name,
    )


async def ttft_tier(
    tier: str,
    config: dict[str, Any],
    lengths: list[int],
    opts: ReferenceEngineOptions,
    repeats: int,
) -> list[dict[str, Any]]:
    """Miss then hit TTFT of fresh prompts per length (median of ``repeats``), hit served by
    ``tier``."""
    offload = make_offload(config, opts, f"bench-{tier}")
    engine = ReferenceEngine(opts, offload)
    await engine.start()
    rows: list[dict[str, Any]] = []
    try:
        await engine_bench.first_token(engine, engine_bench.random_prompt(300, seed=7))  # warm-up
        for n in lengths:
            misses, hits, cached = [], [], n
            for r in range(repeats):
                seed = TIERS.index(tier) * 1_000_000 + n * 10 + r
                prompt = engine_bench.random_prompt(n, seed=seed)
                miss, _ = await engine_bench.first_token(engine, prompt)
                await engine.flush()
                offload.flush(60)
                hit, got = await engine_bench.first_token(engine, prompt)
                misses.append(miss)
                hits.append(hit)
                cached = min(cached, got)
            miss, hit = statistics.median(misses), statistics.median(hits)
            rows.append(
                {"tier": tier, "tokens": n, "miss_ms": miss, "hit_ms": hit, "cached": cached}
            )
            log(f"{tier:10s} {n:5d} tokens: miss {miss:8.1f} ms, hit {hit:7.1f} ms "
                f"({cached} cached)")  # fmt: skip
    finally:
        await engine.shutdown(15.0)
    return rows


def block_slots(num_blocks: int, block_size: int, tokens: int) -> torch.Tensor:
    """Slots as an engine's block manager hands them out: whole blocks in random order."""
    blocks = torch.randperm(num_blocks)[: -(-tokens // block_size)]
    return (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:tokens]


@dataclasses.dataclass(frozen=True)
class KVShape:
    """The KV one engine rank holds per token: what the bandwidth run moves."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int = 16

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def describe(self) -> str:
        return (
            f"{self.name}: {self.num_layers} layers, {self.num_kv_heads} KV heads x "
            f"{self.head_dim}, {self.dtype}, block {self.block_size}, "
            f"{self.bytes_per_token} B/token/rank"
        )


# Qwen3-8B (36 layers, 8 KV heads x 128, bf16) at TP 2: 73,728 B/token/rank.
PRODUCTION = KVShape("Qwen3-8B TP2", 36, 4, 128, torch.bfloat16)


def demo_shape(opts: ReferenceEngineOptions) -> KVShape:
    s = model_shape(opts)
    return KVShape("reference model", s.num_layers, s.num_kv_heads, s.head_dim, s.dtype,
                   opts.block_size)  # fmt: skip


def bandwidth(shape: KVShape, tokens: int, repeats: int) -> dict[str, float]:
    """LMCache store/retrieve GB/s (local_cpu) of ``tokens`` tokens of ``shape``'s KV and
    torch memcpy of the same bytes, interleaved round by round so the shared box's noise
    hits both alike."""
    config = {"chunk_size": CHUNK, "local_cpu": True, "max_local_cpu_size": 2.0}
    off = shape_offload(config, shape, f"bench-bandwidth-{shape.num_layers}", "kvpool/bench")
    bs = shape.block_size
    nb = tokens // bs + 8
    cache_shape = (2, nb, bs, shape.num_kv_heads, shape.head_dim)
    src = [torch.randn(cache_shape).to(shape.dtype) for _ in range(shape.num_layers)]
    dst = [torch.zeros(cache_shape, dtype=shape.dtype) for _ in range(shape.num_layers)]
    payload = tokens * shape.bytes_per_token
    a = torch.randn(payload // 4)
    b = torch.empty_like(a)
    store_s: list[float] = []
    retrieve_s: list[float] = []
    copy_s: list[float] = []
    try:
        for r in range(repeats + 1):
            prompt = engine_bench.random_prompt(tokens, seed=1000 + r)
            s_src, s_dst = block_slots(nb, bs, tokens), block_slots(nb, bs, tokens)
            t0 = time.perf_counter()
            b.copy_(a)
            t1 = time.perf_counter()
            off.store(prompt, src, s_src)
            t2 = time.perf_counter()
            got = off.retrieve(prompt, tokens, dst, s_dst)
            t3 = time.perf_counter()
            if got != tokens:
                raise RuntimeError(f"bandwidth run retrieved {got} of {tokens} tokens")
            if r:  # the first round warms allocator and caches
                copy_s.append(t1 - t0)
                store_s.append(t2 - t1)
                retrieve_s.append(t3 - t2)
            off.evict(token_ids=prompt)
            for layer in (0, shape.num_layers - 1):  # the last round's KV landed where asked
                flat = (2, nb * bs, shape.num_kv_heads, shape.head_dim)
                if not torch.equal(
                    dst[layer].view(flat)[:, s_dst], src[layer].view(flat)[:, s_src]
                ):
                    raise RuntimeError(f"bandwidth run: layer {layer} retrieved wrong KV")
    finally:
        off.close(10)
    med = statistics.median
    return {
        "store_GBps": payload / med(store_s) / 1e9,
        "retrieve_GBps": payload / med(retrieve_s) / 1e9,
        "memcpy_GBps": payload / med(copy_s) / 1e9,
        "retrieve_vs_memcpy": med(c / r for c, r in zip(copy_s, retrieve_s, strict=True)),
        "bandwidth_bytes": float(payload),
    }


def _k(n: int) -> str:
    return f"{n // 1024}k"


def summarize(
    rows: list[dict[str, Any]], bws: dict[str, dict[str, float]], quick: bool
) -> dict[str, Any]:
    """Metrics and ratios; bandwidth keys of the production shape are unsuffixed, the demo
    shape's end in ``_demo``."""
    metrics: dict[str, float] = {}
    ratios: dict[str, float] = {}
    for sfx, bw in bws.items():
        metrics.update({f"{k}{sfx}": v for k, v in bw.items() if k != "retrieve_vs_memcpy"})
        ratios[f"retrieve_vs_memcpy{sfx}"] = bw["retrieve_vs_memcpy"]
    top = max(r["tokens"] for r in rows)
    for r in rows:
        sfx = SUFFIX[r["tier"]]
        keys = [_k(r["tokens"])] + (["8k"] if r["tokens"] == top and _k(top) != "8k" else [])
        for k in keys:
            metrics[f"ttft_hit_ms_{k}{sfx}"] = r["hit_ms"]
            metrics[f"ttft_miss_ms_{k}{sfx}"] = r["miss_ms"]
            metrics[f"cached_tokens_{k}{sfx}"] = float(r["cached"])
            ratios[f"ttft_hit_over_miss_{k}{sfx}"] = r["hit_ms"] / r["miss_ms"]
            if r["tier"] == "local_cpu":  # issue 15's name: a DDR hit over a cold run
                ratios[f"ttft_hit_over_cold_{k}"] = r["hit_ms"] / r["miss_ms"]
    return {"metrics": metrics, "ratios": ratios, "ttft_8k_keys_measured_at_tokens": top}


def table(
    rows: list[dict[str, Any]], bws: dict[str, dict[str, float]], shapes: dict[str, KVShape]
) -> str:
    lines = [
        "| tier | prompt tokens | TTFT miss (ms) | TTFT hit (ms) | hit / miss | cached tokens |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['tier']} | {r['tokens']} | {r['miss_ms']:.0f} | {r['hit_ms']:.1f} | "
            f"{r['hit_ms'] / r['miss_ms']:.3f} | {r['cached']} |"
        )
    lines += [
        "",
        "| LMCache local_cpu | MB | store GB/s | retrieve GB/s | memcpy GB/s | retrieve / memcpy |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for sfx, bw in bws.items():
        lines.append(
            f"| {shapes[sfx].describe()} | {bw['bandwidth_bytes'] / 1e6:.0f} | "
            f"{bw['store_GBps']:.2f} | {bw['retrieve_GBps']:.2f} | {bw['memcpy_GBps']:.2f} | "
            f"{bw['retrieve_vs_memcpy']:.2f} |"
        )
    return "\n".join(lines)


def transfer_table(x: dict[str, float]) -> str:
    mb = x["transfer_bytes"] / 1e6
    return "\n".join(
        [
            "",
            f"| KV transfer between processes, {mb:.0f} MB (NIXL/UCX, lo) | GB/s | / raw NIXL |",
            "|---|---:|---:|",
            f"| raw NIXL, agent to agent WRITE | {x['raw_nixl_GBps']:.2f} | 1.00 |",
            f"| LMCache P2P pull (lookup + peer write) | {x['p2p_GBps']:.2f} | "
            f"{x['p2p_vs_raw_nixl']:.2f} |",
            f"| LMCache PD push (store + write + notify) | {x['pd_GBps']:.2f} | "
            f"{x['pd_vs_raw_nixl']:.2f} |",
        ]
    )


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    miss: dict[int, list[float]] = {}
    for r in rows:
        miss.setdefault(r["tokens"], []).append(r["miss_ms"])
    xs = sorted(miss)
    ax.plot(xs, [statistics.median(miss[x]) for x in xs], "k-o", label="miss (prefill)")
    for tier in TIERS:
        pts = sorted((r["tokens"], r["hit_ms"]) for r in rows if r["tier"] == tier)
        if pts:
            ax.plot(*zip(*pts, strict=True), "-s", label=f"hit: {tier}")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (ms)")
    ax.set_yscale("log")
    ax.set_title("Reference engine TTFT: KV miss vs hit per LMCache tier")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _version(cmd: list[str]) -> str:
    try:
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=5, check=False
        ).stdout.strip()[:60]
    except (OSError, subprocess.SubprocessError):
        return "unavailable"


async def main_async(args: argparse.Namespace) -> int:
    lengths = [1024, 2048] if args.quick else [1024, 4096, 8192]
    opts = ReferenceEngineOptions(num_kv_blocks=max(lengths) // 16 + 256)
    log(f"lengths {lengths}, tiers {list(TIERS)}")
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-") as tmp_s, contextlib.ExitStack() as st:
        tmp = Path(tmp_s)
        svc: dict[str, Any] = {}
        try:
            svc["redis"], _ = st.enter_context(services.redis_server(tmp))
        except services.ServiceUnavailableError as e:
            skipped["redis"] = str(e)
        try:
            svc["mooncake"] = st.enter_context(services.mooncake_cluster(tmp))
        except services.ServiceUnavailableError as e:
            skipped["mooncake"] = str(e)
        for tier in TIERS:
            if tier in skipped:
                log(f"skipping {tier}: {skipped[tier]}")
                continue
            config = tier_config(tier, tmp, svc)
            rows += await ttft_tier(tier, config, lengths, opts, 1 if args.quick else 3)
        log("bandwidth: store/retrieve vs memcpy, production and demo KV shapes")
        shapes = {"": PRODUCTION, "_demo": demo_shape(opts)}
        tokens = {"": 2048, "_demo": 8192}
        bws = {
            sfx: bandwidth(shape, tokens[sfx], repeats=5 if args.quick else 11)
            for sfx, shape in shapes.items()
        }
        log("transfer: raw NIXL, LMCache P2P and PD between processes (same bytes)")
        try:
            xfer = transfer_bench.measure(tmp, tokens=8192, repeats=3 if args.quick else 7)
        except Exception:  # keep every role's log for the post-mortem
            logs = Path(args.out).parent / "worker-transfer-logs"
            shutil.copytree(tmp / "transfer", logs, dirs_exist_ok=True)
            log(f"transfer bench failed: role logs in {logs}")
            raise
    summary = summarize(rows, bws, args.quick)
    for key in ("p2p_vs_raw_nixl", "pd_vs_raw_nixl"):
        summary["ratios"][key] = xfer[key]
    for key, value in xfer.items():  # GB/s, bytes, and each side's phases in ms
        if not key.endswith("_vs_raw_nixl"):
            summary["metrics"][key] = value
    shape = model_shape(opts)
    result = {
        "component": "worker",
        "quick": bool(args.quick),
        "metrics": summary["metrics"],
        "ratios": summary["ratios"],
        "peers": {
            "torch_memcpy": torch.__version__,
            "lmcache": importlib.metadata.version("lmcache"),
            "redis-server": _version(["redis-server", "--version"]),
            "mooncake": importlib.metadata.version("mooncake-transfer-engine-non-cuda"),
            "raw_nixl": importlib.metadata.version("nixl-cu13"),
        },
        "env": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "model": f"{shape.num_layers} layers, {shape.num_kv_heads} KV heads x "
            f"{shape.head_dim}, {shape.dtype}, {shape.kv_bytes_per_token} KV bytes/token",
            "prompt_lengths": lengths,
            "bandwidth_shapes": {
                f"retrieve_vs_memcpy{sfx}": f"{tokens[sfx]} tokens of {shape.describe()}"
                for sfx, shape in shapes.items()
            },
            "box_load_1min": os.getloadavg()[0],
            "ttft_8k_keys_measured_at_tokens": summary["ttft_8k_keys_measured_at_tokens"],
            "skipped_tiers": skipped,
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    plot(rows, out.with_suffix(".png"))
    print(table(rows, bws, shapes))
    print(transfer_table(xfer))
    log(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1K/2K prompts, fewer repeats")
    parser.add_argument("--out", required=True, help="JSON result path")
    return asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
