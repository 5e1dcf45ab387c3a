"""CacheGen codec benchmark: size, speed and quality against LMCache 0.5.6's own CacheGen serde.

Why: CacheGen is only worth running on the KV path if it makes chunks clearly smaller than
fp16 (target >= 3.5x at chunk 2048, all metadata included) and decodes faster than the link
it saves (target >= 200 MB/s of raw KV on one core). Everything is measured in one run, one
thread (``torch.set_num_threads(1)``; the numba coders are single-threaded):

- KV comes from a real prefill of a random-weight Llama-style model built with
  ``transformers`` (the reference engine's family and sizes: hidden 256, 2 KV heads, head
  dim 64, 8 layers, init std 0.02, fixed seed), not from Gaussian noise;
- ours: :func:`kvpool.kernels.cachegen.encode` / ``decode`` with the arithmetic coder
  (LMCache-compatible bytes) and with PAC; ratios are fp16 bytes / container bytes, with all
  metadata (scales, histograms or code lengths, stream lengths, header, checksum) and
  without it (payload only);
- the peer: LMCache's ``CacheGenSerializer``/``CacheGenDeserializer`` created through its
  own ``CreateSerde("cachegen", ...)`` on the CPU (its torch/numba fallbacks; slow, so the
  quick mode gives it a small chunk);
- speeds are MB of raw fp16 KV per CPU-second of this process (median of several runs; the
  ``_wall`` variants use wall-clock time, which on a busy shared box is lower);
- quality proxy: the relative error of every layer's attention output for 16 continuation
  tokens decoded with the reconstructed cache, against the same with the fp16 cache.
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvpool.kernels.cachegen import decode, encode, inspect
from kvpool.kernels.cachegen.container import parse

LAYERS, KV_HEADS, HEAD_DIM, QUERIES = 8, 2, 64, 16


def _median_time(
    fn: Callable[[], object], reps: int, clock: Callable[[], float] = time.process_time
) -> float:
    """Median seconds of ``fn``; by default CPU seconds of this process (all its threads), so
    other jobs on a shared box do not count, while a multi-threaded peer pays for every thread."""
    fn()
    times = []
    for _ in range(reps):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return statistics.median(times)


def _model() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=8192,
        initializer_range=0.02,
    )
    return LlamaForCausalLM(config).eval()


def _prefill(model: Any, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """KV_2LTD fp16 of a prefill of ``tokens`` random ids, and 16 continuation ids."""
    g = torch.Generator().manual_seed(tokens)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens + QUERIES), generator=g)
    with torch.no_grad():
        out = model(ids[:, :tokens], use_cache=True)
    cache = out.past_key_values
    keys = [cache.layers[i].keys for i in range(LAYERS)]
    values = [cache.layers[i].values for i in range(LAYERS)]
    kv = torch.stack(
        [
            torch.stack([t[0].permute(1, 0, 2).reshape(tokens, -1) for t in keys]),
            torch.stack([t[0].permute(1, 0, 2).reshape(tokens, -1) for t in values]),
        ]
    )
    return kv.to(torch.float16), ids[:, tokens:]


def _attention_outputs(model: Any, kv: torch.Tensor, queries: torch.Tensor) -> list[torch.Tensor]:
    from transformers import DynamicCache

    tokens = kv.shape[2]
    cache = DynamicCache()
    for layer in range(LAYERS):
        k, v = (
            kv[i, layer].float().view(tokens, KV_HEADS, HEAD_DIM).permute(1, 0, 2)[None]
            for i in (0, 1)
        )
        cache.update(k.contiguous(), v.contiguous(), layer)
    captured: list[torch.Tensor] = []
    hooks = [
        blk.self_attn.register_forward_hook(lambda _m, _i, o: captured.append(o[0].detach()))
        for blk in model.model.layers
    ]
    try:
        with torch.no_grad():
            model(queries, past_key_values=cache, use_cache=True)
    finally:
        for h in hooks:
            h.remove()
    return captured


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _bits_per_group(blob: bytes) -> dict[str, float]:
    parts = parse(blob)
    h = parts.header
    per_stream = parts.lengths.astype(np.int64).sum(axis=0).reshape(2 * h.num_layers, -1)
    per_layer = per_stream.sum(axis=1) * 8 / (h.num_tokens * h.channels)
    out: dict[str, float] = {}
    for kind, offset in (("K", 0), ("V", h.num_layers)):
        start = 0
        for layer in range(1, h.num_layers + 1):
            if layer == h.num_layers or h.bins[offset + layer] != h.bins[offset + start]:
                name = f"{kind}_L{start}-{layer - 1}_b{h.bins[offset + start]}"
                out[name] = float(per_layer[offset + start : offset + layer].mean())
                start = layer
    return out


def _lmcache_peer(kv: torch.Tensor, reps: int) -> dict[str, float] | None:
    """LMCache's own CacheGen serde, created through CreateSerde, on this KV chunk."""
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    try:
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.naive_serde import CreateSerde
        from transformers import LlamaConfig
    except ImportError:
        return None
    _, layers, tokens, _ = kv.shape
    with tempfile.TemporaryDirectory() as model_dir:
        # LMCache picks CacheGen bins from the model's config.json (AutoConfig).
        LlamaConfig(num_hidden_layers=layers, num_key_value_heads=KV_HEADS).save_pretrained(
            model_dir
        )
        meta = LMCacheMetadata(
            model_name=model_dir,
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=kv.dtype,
            kv_shape=(layers, 2, tokens, KV_HEADS, HEAD_DIM),
            chunk_size=tokens,
        )
        config = LMCacheEngineConfig.from_dict({"chunk_size": tokens, "remote_serde": "cachegen"})
        ser, deser = CreateSerde("cachegen", meta, config)
    obj = TensorMemoryObj(
        raw_data=kv,
        metadata=MemoryObjMetadata(
            shape=kv.shape,
            dtype=kv.dtype,
            address=-1,
            phy_size=kv.numel() * kv.element_size(),
            ref_count=-1,
            fmt=MemoryFormat.KV_2LTD,
        ),
        parent_allocator=None,
    )
    blob = ser.serialize(obj)
    t_enc = _median_time(lambda: ser.serialize(obj), reps)
    t_dec = _median_time(lambda: deser.deserialize(blob), reps)
    out = deser.deserialize(blob).tensor
    raw = kv.numel() * kv.element_size()
    return {
        "ratio": raw / len(blob.byte_array),
        "encode_MBps": raw / t_enc / 1e6,
        "decode_MBps": raw / t_dec / 1e6,
        "kv_rel_err": _rel(out, kv),
    }


def run(quick: bool) -> dict[str, Any]:
    torch.set_num_threads(1)
    reps = 3 if quick else 7
    model = _model()
    metrics: dict[str, float] = {}
    rows: list[tuple[str, int, float, float, float, float, float]] = []
    kv256, _ = _prefill(model, 256)
    kv2048, queries = _prefill(model, 2048)
    for coder in ("ac", "pac"):
        for tokens, kv in ((256, kv256), (2048, kv2048)):
            raw = kv.numel() * 2
            blob = encode(kv, coder=coder)  # type: ignore[arg-type]
            h = inspect(blob)
            prefix = "cachegen" if coder == "ac" else "cachegen_pac"
            metrics[f"{prefix}_ratio_incl_meta_c{tokens}"] = raw / len(blob)
            metrics[f"{prefix}_ratio_excl_meta_c{tokens}"] = raw / h.payload_len
            t_enc = _median_time(lambda kv=kv, c=coder: encode(kv, coder=c), reps)  # type: ignore[misc]
            t_dec = _median_time(lambda b=blob: decode(b), reps)
            out = decode(blob)
            rows.append(
                (
                    coder,
                    tokens,
                    raw / len(blob),
                    raw / h.payload_len,
                    raw / t_enc / 1e6,
                    raw / t_dec / 1e6,
                    _rel(out, kv),
                )
            )
            if tokens == 2048:
                metrics[f"{coder}_encode_MBps"] = raw / t_enc / 1e6
                metrics[f"{coder}_decode_MBps"] = raw / t_dec / 1e6
                t_wall = _median_time(lambda b=blob: decode(b), reps, time.perf_counter)
                metrics[f"{coder}_decode_MBps_wall"] = raw / t_wall / 1e6
                for name, bits in _bits_per_group(blob).items():
                    metrics[f"{coder}_bits_per_elem_{name}"] = bits
                metrics[f"{coder}_meta_bits_per_elem_c2048"] = (
                    8 * (len(blob) - h.payload_len) / kv.numel()
                )
    blob = encode(kv2048, coder="ac")
    ref = _attention_outputs(model, kv2048, queries)
    got = _attention_outputs(model, decode(blob), queries)
    errs = [_rel(a, b) for a, b in zip(got, ref, strict=True)]
    metrics["quality_attn_rel_err_mean"] = float(np.mean(errs))
    metrics["quality_attn_rel_err_max"] = float(np.max(errs))
    metrics["quality_kv_rel_err_c2048"] = _rel(decode(blob), kv2048)

    peer_kv = kv256[:, :, :64] if quick else kv256
    peer = _lmcache_peer(peer_kv, 1 if quick else 3)
    ratios: dict[str, float] = {}
    peers: dict[str, str] = {}
    if peer is not None:
        from importlib.metadata import version

        peers["lmcache"] = version("lmcache")
        metrics["lmcache_peer_chunk_tokens"] = float(peer_kv.shape[2])
        for key, val in peer.items():
            metrics[f"lmcache_cachegen_{key}"] = val
        ours = encode(peer_kv, coder="ac")
        raw = peer_kv.numel() * 2
        t_dec = _median_time(lambda: decode(ours), reps)
        ours_pac = encode(peer_kv, coder="pac")
        t_dec_pac = _median_time(lambda: decode(ours_pac), reps)
        t_enc = _median_time(lambda: encode(peer_kv, coder="ac"), reps)
        ratios["decode_speedup_vs_lmcache"] = raw / t_dec / 1e6 / peer["decode_MBps"]
        ratios["pac_decode_speedup_vs_lmcache"] = raw / t_dec_pac / 1e6 / peer["decode_MBps"]
        ratios["encode_speedup_vs_lmcache"] = raw / t_enc / 1e6 / peer["encode_MBps"]
        ratios["size_ratio_vs_lmcache"] = (raw / len(ours)) / peer["ratio"]
        rows.append(
            (
                "lmcache",
                peer_kv.shape[2],
                peer["ratio"],
                float("nan"),
                peer["encode_MBps"],
                peer["decode_MBps"],
                peer["kv_rel_err"],
            )
        )
    return {
        "metrics": metrics,
        "ratios": ratios,
        "peers": peers,
        "markdown": _markdown(rows, metrics, ratios),
    }


def _markdown(
    rows: list[tuple[str, int, float, float, float, float, float]],
    metrics: dict[str, float],
    ratios: dict[str, float],
) -> str:
    lines = [
        "| codec | chunk | ratio vs fp16 (all metadata) | ratio (payload only) | "
        "encode MB/s | decode MB/s | KV rel. L2 error |",
        "|---|---|---|---|---|---|---|",
    ]
    for coder, tokens, r_all, r_pay, enc, dec, err in rows:
        pay = "-" if math.isnan(r_pay) else f"{r_pay:.2f}"
        lines.append(
            f"| {coder} | {tokens} | {r_all:.2f} | {pay} | {enc:.1f} | {dec:.1f} | {err:.4f} |"
        )
    lines += ["", "| metric | value |", "|---|---|"]
    for key in sorted(metrics):
        if "bits_per_elem" in key or key.startswith("quality"):
            lines.append(f"| {key} | {metrics[key]:.4f} |")
    for key, val in sorted(ratios.items()):
        lines.append(f"| {key} | {val:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse
    import json

    ap = argparse.ArgumentParser(description="CacheGen codec benchmark")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    result = run(args.quick)
    print(result["markdown"])
    print(json.dumps({k: result[k] for k in ("metrics", "ratios", "peers")}, indent=1))
