"""The public encode/decode API and the container (reference notes §6.2.6, §6.2.7).

The end-to-end compatibility test runs LMCache 0.5.6's own ``encode_function`` on the CPU
(its torch/numba fallbacks) and compares the CDF, the scales, the per-stream lengths and
the bytes of every sub-chunk with what our container holds.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
import torch

from kvpool.kernels.cachegen import CacheGenError, decode, default_bins, encode, inspect
from kvpool.kernels.cachegen.cdf import cdf_from_counts
from kvpool.kernels.cachegen.container import parse


def _kv(layers: int, tokens: int, channels: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, layers, tokens, channels, generator=g)
    kv[0, :, :, 3] *= 12.0  # outlier channel in K
    return kv.to(dtype)


@pytest.mark.parametrize("coder", ["ac", "pac"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_roundtrip_error_bound_and_metadata(coder: str, dtype: torch.dtype) -> None:
    layers, tokens, channels = 12, 300, 64
    kv = _kv(layers, tokens, channels, dtype)
    kv[1, 4, 17] = 0.0  # a zero row
    blob = encode(kv, coder=coder)  # type: ignore[arg-type]
    out = decode(blob)
    assert out.shape == kv.shape and out.dtype == kv.dtype
    kb, vb = default_bins(layers)
    half = torch.tensor([b // 2 - 1 for b in kb + vb], dtype=torch.float32).view(2, layers, 1, 1)
    xf = kv.float()
    scale = xf.abs().amax(dim=-1, keepdim=True)
    eps = 1e-6 * scale if dtype == torch.float32 else 2.0**-7 * xf.abs() + 2.0**-7 * scale / 8
    assert bool(((xf - out.float()).abs() <= scale / (2 * half) + eps).all())
    assert bool((out[1, 4, 17] == 0).all())
    h = inspect(blob)
    assert (h.coder, h.num_layers, h.num_tokens, h.channels, h.subchunk) == (
        coder,
        layers,
        tokens,
        channels,
        256,
    )
    assert h.bins == tuple(kb + vb) and h.lp == 33 and h.total_len == len(blob)
    assert encode(kv, coder=coder) == blob  # type: ignore[arg-type]


def test_explicit_bins_subchunk_and_device() -> None:
    kv = _kv(2, 50, 32, torch.float16, seed=1)
    blob = encode(kv, coder="pac", key_bins=[64, 8], value_bins=[4, 16], subchunk=7)
    h = inspect(blob)
    assert h.bins == (64, 8, 4, 16) and h.lp == 65 and h.nsub == 8
    out = decode(blob, device="cpu")
    assert out.device.type == "cpu" and out.shape == kv.shape


def test_compression_beats_fp16() -> None:
    kv = _kv(12, 2048, 128, torch.float16, seed=2)
    for coder in ("ac", "pac"):
        assert len(encode(kv, coder=coder)) * 3 < kv.numel() * 2  # type: ignore[arg-type]


def test_matches_lmcache_encode_function_end_to_end() -> None:
    from lmcache.storage_backend.serde.cachegen_encoder import encode_function

    layers, tokens, heads, dim = 2, 300, 2, 16
    kv = _kv(layers, tokens, heads * dim, torch.bfloat16, seed=3)
    kb, vb = default_bins(layers)
    theirs = encode_function(
        kv.view(2, layers, tokens, heads, dim).permute(1, 0, 2, 3, 4),
        None,
        torch.tensor(kb, dtype=torch.float32),
        torch.tensor(vb, dtype=torch.float32),
        tokens,
    )
    parts = parse(encode(kv, coder="ac"))
    counts = np.stack([t.astype(np.int64) for t in parts.tables])  # [2L, C, 31]
    counts = np.concatenate([counts, np.zeros((*counts.shape[:2], 1), np.int64)], axis=-1)
    cdf = cdf_from_counts(counts, 33)
    assert np.array_equal(theirs.cdf.numpy().view(np.uint16), cdf)
    scales = torch.from_numpy(parts.scales.copy()).view(torch.bfloat16).view(2, layers, tokens)
    assert torch.equal(scales[0], theirs.max_tensors_key[..., 0])
    assert torch.equal(scales[1], theirs.max_tensors_value[..., 0])
    offset = 0
    for k, chunk in enumerate(theirs.data_chunks):
        lengths = parts.lengths[k].astype(np.int64)
        assert np.array_equal(lengths, chunk.bytestream_lengths.numpy().reshape(-1))
        n = int(lengths.sum())
        assert np.array_equal(parts.payload[offset : offset + n], chunk.bytestream.numpy())
        offset += n
    assert offset == parts.payload.shape[0]


def test_rejects_bad_input() -> None:
    kv = _kv(2, 10, 8, torch.float16)
    with pytest.raises(CacheGenError, match="KV_2LTD"):
        encode(kv[0])
    with pytest.raises(CacheGenError, match="dtype"):
        encode(kv.to(torch.float64))
    with pytest.raises(CacheGenError, match="coder"):
        encode(kv, coder="zstd")  # type: ignore[arg-type]
    with pytest.raises(CacheGenError, match="key_bins"):
        encode(kv, key_bins=[32])
    with pytest.raises(CacheGenError, match="bins must be in"):
        encode(kv, value_bins=[32, 2])
    bad = kv.clone()
    bad[0, 0, 0, 0] = float("inf")
    with pytest.raises(CacheGenError, match="NaN or Inf"):
        encode(bad)
    with pytest.raises(CacheGenError, match="num_tokens"):
        encode(torch.zeros(2, 1, 65536, 1, dtype=torch.float16))


def _recrc(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


def test_rejects_bad_containers() -> None:
    blob = encode(_kv(2, 40, 16, torch.float16), coder="ac")
    body = blob[:-4]
    with pytest.raises(CacheGenError, match="checksum"):
        decode(blob[:-1] + bytes([blob[-1] ^ 1]))
    with pytest.raises(CacheGenError, match="magic"):
        decode(_recrc(b"XXXX" + body[4:]))
    with pytest.raises(CacheGenError, match="version"):
        decode(_recrc(body[:4] + b"\x02\x00" + body[6:]))
    with pytest.raises(CacheGenError, match="describes"):
        decode(blob[:-7])
    with pytest.raises(CacheGenError, match="too short"):
        decode(b"KVCG")
    with pytest.raises(CacheGenError, match="max_elements"):
        decode(blob, max_elements=100)
    huge = bytearray(body)
    struct.pack_into("<I", huge, 12, 65535)  # num_tokens
    struct.pack_into("<I", huge, 16, 65536)  # channels
    with pytest.raises(CacheGenError, match="max_elements"):
        decode(_recrc(bytes(huge)))


def test_lmcache_has_no_serde_registry() -> None:
    """Why there is no LMCache serde adapter: 0.5.6's CreateSerde is a closed if/elif.

    If a later LMCache accepts other names, this fails and the adapter becomes possible.
    """
    from lmcache.v1.storage_backend.naive_serde import CreateSerde

    with pytest.raises(ValueError, match="Invalid type"):
        CreateSerde("kvpool_cachegen", None, None)  # type: ignore[arg-type]
