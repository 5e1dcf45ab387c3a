"""CacheGen's quantizer: LMCache's per-token absmax scaling with layer-group bin counts.

Why this module exists: the codec must produce the same symbols as LMCache's
``torch_quant_vectorized`` so that our arithmetic coder's bytes can be compared with
LMCache's, while defining what LMCache leaves undefined (an all-zero token row gives 0/0 = NaN
upstream; here it gives the middle symbol and reconstructs to exact zeros).

Semantics, for one layer with ``bins`` bins and ``MAX = bins // 2 - 1``:

* ``scale[l, t] = amax(|x[l, t, :]|)`` over all channels of that (layer, token);
* ``sym = round(x * (MAX / scale) + MAX)`` in float32 (round half to even), in ``[0, 2*MAX]``;
* ``x_hat = ((sym - MAX) / MAX) * scale`` in float32, then cast to the KV dtype.

Everything is plain torch, so it runs on whatever device the KV lives on.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvpool.kernels.cachegen.errors import CacheGenError

MIN_BINS = 4
MAX_BINS = 64
LMCACHE_KEY_FINE_LAYERS = 10
LMCACHE_VALUE_FINE_LAYERS = 2


def default_bins(num_layers: int) -> tuple[list[int], list[int]]:
    """LMCache 0.5.6's bin table for a model with ``num_layers`` layers: (key bins, value bins).

    Every model family LMCache names (Mistral-7B, Llama-3.1-8B, Qwen-7B, glm-4-9b) and its
    ``AutoConfig`` fallback reduce to one rule: below 10 layers 32 bins everywhere; otherwise
    K layers 0-9 and V layers 0-1 get 32 bins and every other layer 16.
    """
    if num_layers < 1:
        raise CacheGenError(f"num_layers must be >= 1, got {num_layers}")
    if num_layers < LMCACHE_KEY_FINE_LAYERS:
        return [32] * num_layers, [32] * num_layers
    key = [32 if i < LMCACHE_KEY_FINE_LAYERS else 16 for i in range(num_layers)]
    value = [32 if i < LMCACHE_VALUE_FINE_LAYERS else 16 for i in range(num_layers)]
    return key, value


def check_bins(bins: Sequence[int], num_layers: int, what: str) -> list[int]:
    """Validate a per-layer bin list; return it as a list of ints."""
    out = [int(b) for b in bins]
    if len(out) != num_layers:
        raise CacheGenError(
            f"{what} has {len(out)} entries but the KV has {num_layers} layers: "
            "give one bin count per layer"
        )
    for i, b in enumerate(out):
        if not MIN_BINS <= b <= MAX_BINS:
            raise CacheGenError(f"{what}[{i}] = {b}: bins must be in [{MIN_BINS}, {MAX_BINS}]")
    return out


def half_range(bins: Sequence[int]) -> list[int]:
    """``MAX = bins // 2 - 1`` per layer: symbols lie in ``[0, 2*MAX]``."""
    return [b // 2 - 1 for b in bins]


def quantize(x: torch.Tensor, bins: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [layers, tokens, channels]`` with ``bins[layer]`` bins.

    Returns ``(sym uint8 [layers, tokens, channels], scale float32 [layers, tokens])`` on the
    device of ``x``. Raises :class:`CacheGenError` on NaN/Inf input.
    """
    if x.dim() != 3:
        raise CacheGenError(f"quantize expects [layers, tokens, channels], got {tuple(x.shape)}")
    if x.shape[0] != len(bins):
        raise CacheGenError(f"{len(bins)} bin counts for {x.shape[0]} layers")
    xf = x.to(torch.float32)
    scale = torch.amax(torch.abs(xf), dim=-1, keepdim=True)  # [L, T, 1]
    if not bool(torch.isfinite(scale).all()):
        raise CacheGenError("kv contains NaN or Inf: CacheGen can only quantize finite values")
    half = torch.tensor(half_range(bins), dtype=torch.float32, device=x.device)[:, None, None]
    # LMCache: factor = MAX / max1 (float32), sym = round(x * factor + MAX).
    factor = half / scale
    bad = ~torch.isfinite(factor)  # scale == 0 (zero row) or a float32 subnormal scale
    if bool(bad.any()):
        tiny = bad & (scale > 0)
        factor = torch.where(bad, torch.zeros_like(factor), factor)
        q = xf * factor + half
        if bool(tiny.any()):
            # MAX / scale overflows: divide first so the row still spans [0, 2*MAX].
            q = torch.where(tiny, xf / torch.where(tiny, scale, 1.0) * half + half, q)
    else:
        q = xf * factor + half
    q = torch.round(q).clamp_(min=0.0).clamp_(max=half * 2)
    return q.to(torch.uint8), scale[..., 0]


def level_table(bins: Sequence[int], device: torch.device | None = None) -> torch.Tensor:
    """``lut[l, s] = (s - MAX_l) / MAX_l`` in float32, exactly LMCache's dequantization steps.

    Shape ``[layers, max(bins) - 1]``; entries past ``2*MAX_l`` are never produced by a valid
    stream and are set to 0.
    """
    width = max(bins) - 1
    lut = torch.zeros((len(bins), width), dtype=torch.float32)
    for i, m in enumerate(half_range(bins)):
        s = torch.arange(2 * m + 1, dtype=torch.float32)
        lut[i, : 2 * m + 1] = (s - m) / m
    return lut.to(device) if device is not None else lut


def dequantize(
    sym: torch.Tensor, scale: torch.Tensor, bins: Sequence[int], dtype: torch.dtype
) -> torch.Tensor:
    """Inverse of :func:`quantize`: ``x_hat [layers, tokens, channels]`` in ``dtype``."""
    lut = level_table(bins, sym.device)
    idx = sym.to(torch.int64) + (
        torch.arange(len(bins), device=sym.device, dtype=torch.int64) * lut.shape[1]
    ).view(-1, 1, 1)
    vals = lut.view(-1)[idx]
    return (vals * scale.to(torch.float32)[..., None]).to(dtype)
