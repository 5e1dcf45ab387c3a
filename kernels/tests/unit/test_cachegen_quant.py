"""Properties of the CacheGen quantizer (reference notes §6.1), and its agreement with LMCache.

LMCache's own ``torch_quant_vectorized`` runs on the CPU, so symbol equality is checked
against the real upstream function, not a transcription of it.
"""

from __future__ import annotations

import pytest
import torch

from kvpool.kernels.cachegen import CacheGenError, default_bins, dequantize, quantize


def _kv(layers: int = 4, tokens: int = 64, channels: int = 96, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(layers, tokens, channels, generator=g)
    x[:, :, 5] *= 20.0  # an outlier channel, as real K caches have
    x[:, :, 17] = torch.distributions.StudentT(2.0).sample((layers, tokens))
    return x


def test_bins_follow_lmcache_table() -> None:
    k, v = default_bins(32)
    assert k == [32] * 10 + [16] * 22
    assert v == [32] * 2 + [16] * 30
    k, v = default_bins(8)
    assert k == v == [32] * 8
    k, v = default_bins(40)
    assert k[9:11] == [32, 16] and v[1:3] == [32, 16]


@pytest.mark.parametrize("bins", [[32, 32, 16, 16], [16, 32, 64, 4]])
def test_symbol_range_and_extremes(bins: list[int]) -> None:
    x = _kv()
    sym, scale = quantize(x, bins)
    for layer, b in enumerate(bins):
        top = 2 * (b // 2 - 1)
        s = sym[layer].to(torch.int64)
        assert int(s.min()) >= 0 and int(s.max()) <= top
        # the absmax element of every (layer, token) row maps to 0 or 2*MAX
        arg = x[layer].abs().argmax(dim=-1)
        ext = s.gather(1, arg[:, None])[:, 0]
        assert bool(((ext == 0) | (ext == top)).all())
    assert torch.equal(scale, x.abs().amax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_error_bound(dtype: torch.dtype) -> None:
    x = _kv().to(dtype)
    bins = [32, 16, 32, 16]
    sym, scale = quantize(x, bins)
    xh = dequantize(sym, scale, bins, dtype)
    half = torch.tensor([b // 2 - 1 for b in bins], dtype=torch.float32)[:, None, None]
    bound = scale[..., None] / (2 * half)
    xf = x.float()
    eps = 1e-6 * scale[..., None] if dtype == torch.float32 else 2.0**-7 * xf.abs()
    assert bool(((xf - xh.float()).abs() <= bound + eps + 1e-12).all())


def test_grid_points_quantize_exactly() -> None:
    bins = [32, 16]
    half = [15, 7]
    g = torch.Generator().manual_seed(1)
    rows = []
    for m in half:
        k = torch.randint(-m, m + 1, (8, 40), generator=g)
        k[:, 0] = m  # pin the row's absmax to the top grid point
        rows.append(k)
    k = torch.stack(rows)
    scale = torch.rand(2, 8, generator=g) + 0.5
    x = k.float() / torch.tensor(half, dtype=torch.float32)[:, None, None] * scale[..., None]
    sym, sc = quantize(x, bins)
    assert torch.equal(sym.to(torch.int64), k + torch.tensor(half)[:, None, None])
    xh = dequantize(sym, sc, bins, torch.float32)
    torch.testing.assert_close(xh, x, rtol=4e-7, atol=0)
    assert torch.equal(xh[:, :, 0], sc)  # the absmax reconstructs exactly: MAX/MAX == 1


def test_idempotent() -> None:
    x = _kv(seed=2)
    bins = [32, 16, 16, 32]
    sym, scale = quantize(x, bins)
    sym2, _ = quantize(dequantize(sym, scale, bins, torch.float32), bins)
    assert torch.equal(sym, sym2)


def test_scale_invariance_power_of_two() -> None:
    x = _kv(seed=3)
    bins = [32, 16, 32, 16]
    sym, scale = quantize(x, bins)
    for alpha in (0.25, 8.0, 2.0**20):
        s2, sc2 = quantize(x * alpha, bins)
        assert torch.equal(sym, s2)
        assert torch.equal(sc2, scale * alpha)


def test_zero_rows_are_defined() -> None:
    x = _kv(seed=4)
    x[1, 7] = 0.0
    x[2, :3] = 0.0
    x[0, 9] = 1e-44  # a float32 subnormal scale: MAX / scale overflows to inf
    x[0, 9, 3] = -1e-44
    bins = [32, 32, 16, 16]
    sym, scale = quantize(x, bins)
    assert bool((sym[1, 7] == 15).all()) and bool((sym[2, :3] == 7).all())
    xh = dequantize(sym, scale, bins, torch.float32)
    assert torch.isfinite(xh).all()
    assert bool((xh[1, 7] == 0).all()) and bool((xh[2, :3] == 0).all())
    assert int(sym[0, 9, 0]) == 30 and int(sym[0, 9, 3]) == 0


def test_lmcache_gives_nan_on_zero_rows_and_we_match_it_elsewhere() -> None:
    from lmcache.storage_backend.serde.cachegen_encoder import torch_quant_vectorized

    x = _kv(seed=5).to(torch.bfloat16)
    bins = [32, 32, 16, 16]
    ours, scale = quantize(x, bins)
    theirs, max1 = torch_quant_vectorized(torch.tensor(bins, dtype=torch.float32), x)
    assert torch.equal(ours.to(torch.int8), theirs)
    assert torch.equal(scale, max1[..., 0].float())
    x[0, 0] = 0.0
    _, max1 = torch_quant_vectorized(torch.tensor(bins, dtype=torch.float32), x)
    lm_factor = (torch.tensor(bins, dtype=torch.float32) // 2 - 1)[:, None, None] / max1
    assert bool(torch.isnan(x[0, 0].float() * lm_factor[0, 0]).all())  # upstream: 0 * inf
    ours, _ = quantize(x, bins)
    assert bool((ours[0, 0] == 15).all())


def test_rejects_non_finite_and_bad_bins() -> None:
    x = _kv()
    x[0, 0, 0] = float("nan")
    with pytest.raises(CacheGenError, match="NaN"):
        quantize(x, [32] * 4)
    with pytest.raises(CacheGenError):
        quantize(_kv(), [32] * 3)
