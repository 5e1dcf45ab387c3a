"""RoPE for CacheBlend: apply rotary position embedding and re-rotate cached K to new positions.

Why this exists: a reused chunk's K was cached *after* RoPE at the positions it had when it was
prefilled. Blending places the chunk at different positions, so its K must be rotated by
``(new - old) * omega_i`` for every pair. Rotations compose, so the fused one-step form (one
rotation by the delta) equals LMCache's two-step kernel (inverse rotation by the old angle, then
forward rotation by the new one) and equals computing K at the new position from scratch. V has
no positional encoding and is never touched.

Two pairings exist: NeoX (``rotate_half``; pairs ``(i, i + D/2)``, used by Llama/Qwen in
transformers and vLLM) and GPT-J (pairs ``(2i, 2i + 1)``). Angles are computed in float32 for
float32/bf16/fp16 inputs (as transformers does) and in float64 for float64 inputs; the fused
form multiplies the *integer* delta by omega, so small deltas lose no precision at large
absolute positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch

__all__ = [
    "RopeConfig",
    "RopeStyle",
    "apply_rope",
    "rerope",
    "rerope_two_step",
    "rope_cos_sin",
    "rotate_cos_sin",
    "rotate_pairs",
]


class RopeStyle(StrEnum):
    """How the head dimension is split into rotated 2-D pairs."""

    NEOX = "neox"  # (i, i + D/2): transformers' rotate_half, vLLM is_neox_style=True
    GPTJ = "gptj"  # (2i, 2i + 1): interleaved, vLLM is_neox_style=False


@dataclass(frozen=True)
class RopeConfig:
    """Full-head rotary embedding (LMCache blending rejects partial rotary and rope_scaling)."""

    head_dim: int
    base: float = 10000.0
    style: RopeStyle = RopeStyle.NEOX

    def __post_init__(self) -> None:
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(
                f"RopeConfig.head_dim must be a positive even number, got {self.head_dim}; "
                "RoPE rotates pairs of dimensions"
            )
        if self.base <= 1.0:
            raise ValueError(f"RopeConfig.base must be > 1 (e.g. 10000.0), got {self.base}")

    def inv_freq(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``omega_i = base^(-2i/D)`` for i in [0, D/2), shape ``[D/2]``."""
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device)
        return 1.0 / (self.base ** (exponent.to(dtype) / self.head_dim))


def _angle_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def rotate_pairs(x: torch.Tensor, angle: torch.Tensor, style: RopeStyle) -> torch.Tensor:
    """Rotate every pair of ``x[..., T, H, D]`` by ``angle[T, D/2]`` (same angle for all heads).

    The computation is done in the angle dtype and cast back to ``x.dtype``.
    """
    return rotate_cos_sin(x, angle.cos(), angle.sin(), style)


def rope_cos_sin(
    positions: torch.Tensor, cfg: RopeConfig, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` tables ``[T, D/2]`` for ``positions``, in the angle dtype for ``like``.

    Compute once per forward and index rows, instead of once per layer and projection.
    """
    dt = _angle_dtype(like)
    angle = positions.to(dt).unsqueeze(-1) * cfg.inv_freq(dt, like.device)
    return angle.cos(), angle.sin()


def rotate_cos_sin(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: RopeStyle
) -> torch.Tensor:
    """Rotate the pairs of ``x[..., T, H, D]`` by the angles whose ``cos``/``sin`` are given."""
    half = x.shape[-1] // 2
    if cos.shape != sin.shape or cos.shape[-1] != half or cos.shape[0] != x.shape[-3]:
        raise ValueError(
            f"cos/sin shape {tuple(cos.shape)} does not match x {tuple(x.shape)}: "
            "expected [T, D/2] for x [..., T, H, D]"
        )
    cos = cos.unsqueeze(-2)  # [T, 1, D/2], broadcast over heads
    sin = sin.unsqueeze(-2)
    xf = x.to(cos.dtype)
    if style is RopeStyle.NEOX:
        a, b = xf[..., :half], xf[..., half:]
        out = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
    else:
        a, b = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    return out.to(x.dtype)


def _check(x: torch.Tensor, cfg: RopeConfig, *positions: torch.Tensor) -> None:
    if x.dim() < 3 or x.shape[-1] != cfg.head_dim:
        raise ValueError(
            f"expected a [..., T, H, {cfg.head_dim}] tensor, got shape {tuple(x.shape)}"
        )
    for p in positions:
        if p.dim() != 1 or p.shape[0] != x.shape[-3]:
            raise ValueError(
                f"positions must be 1-D with one entry per token ({x.shape[-3]}), "
                f"got shape {tuple(p.shape)}"
            )
        if p.is_floating_point():
            raise ValueError("positions must be an integer tensor (token indices), not float")


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cfg: RopeConfig) -> torch.Tensor:
    """RoPE of ``x[..., T, H, D]`` at integer ``positions[T]``."""
    _check(x, cfg, positions)
    cos, sin = rope_cos_sin(positions, cfg, x)
    return rotate_cos_sin(x, cos, sin, cfg.style)


def rerope(
    k: torch.Tensor, old_positions: torch.Tensor, new_positions: torch.Tensor, cfg: RopeConfig
) -> torch.Tensor:
    """Fused re-rotation: K cached at ``old_positions`` becomes K at ``new_positions``.

    One rotation by ``(new - old) * omega_i``; the integer delta is exact, so this is at least as
    accurate as the two-step form. Works for negative deltas and any leading dims (e.g. layers).
    """
    _check(k, cfg, old_positions, new_positions)
    dt = _angle_dtype(k)
    delta = (new_positions.to(torch.int64) - old_positions.to(torch.int64)).to(dt)
    angle = delta.unsqueeze(-1) * cfg.inv_freq(dt, k.device)
    return rotate_pairs(k, angle, cfg.style)


def rerope_two_step(
    k: torch.Tensor, old_positions: torch.Tensor, new_positions: torch.Tensor, cfg: RopeConfig
) -> torch.Tensor:
    """LMCache's kernel form: inverse rotation by the old angle, then rotation by the new one.

    Kept for tests and for comparison with the fused form; both compute in the angle dtype.
    """
    _check(k, cfg, old_positions, new_positions)
    dt = _angle_dtype(k)
    freq = cfg.inv_freq(dt, k.device)
    old = old_positions.to(dt).unsqueeze(-1) * freq
    new = new_positions.to(dt).unsqueeze(-1) * freq
    kf = k.to(dt)
    return rotate_pairs(rotate_pairs(kf, -old, cfg.style), new, cfg.style).to(k.dtype)
