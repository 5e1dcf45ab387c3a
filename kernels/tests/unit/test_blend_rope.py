"""RoPE and re-rotation properties for CacheBlend (reference §6.4).

Checked against an independent complex-number rotation (NeoX and GPT-J pairings), against
transformers' own Llama rotary code, and between the fused delta form, LMCache's two-step
(inverse-then-forward) form and RoPE computed at the new positions from scratch.
"""

import pytest
import torch

from kvpool.kernels.blend import RopeConfig, RopeStyle, apply_rope, rerope, rerope_two_step
from kvpool.kernels.blend.select import deviation

STYLES = [RopeStyle.NEOX, RopeStyle.GPTJ]


def _x(t: int = 10, h: int = 3, d: int = 64, dtype: torch.dtype = torch.float64, seed: int = 0):
    return torch.randn(t, h, d, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _complex_reference(x: torch.Tensor, angle: torch.Tensor, style: RopeStyle) -> torch.Tensor:
    """Rotation written as multiplication by e^{i*angle}, independent of the code under test."""
    half = x.shape[-1] // 2
    x = x.to(torch.float64)
    if style is RopeStyle.NEOX:
        z = torch.complex(x[..., :half], x[..., half:])
    else:
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], half, 2).contiguous())
    r = z * torch.polar(torch.ones_like(angle), angle).unsqueeze(-2)
    if style is RopeStyle.NEOX:
        return torch.cat((r.real, r.imag), dim=-1)
    return torch.view_as_real(r).flatten(-2)


def _angle(positions: torch.Tensor, cfg: RopeConfig) -> torch.Tensor:
    i = torch.arange(cfg.head_dim // 2, dtype=torch.float64)
    return positions.to(torch.float64)[:, None] * cfg.base ** (-2 * i / cfg.head_dim)[None, :]


@pytest.mark.parametrize("style", STYLES)
def test_apply_rope_matches_complex_rotation(style: RopeStyle) -> None:
    cfg = RopeConfig(64, style=style)
    x, pos = _x(), torch.tensor([0, 1, 2, 7, 100, 999, 4096, 20000, 31999, 5])
    torch.testing.assert_close(
        apply_rope(x, pos, cfg), _complex_reference(x, _angle(pos, cfg), style), rtol=0, atol=1e-10
    )


@pytest.mark.parametrize("style", STYLES)
def test_fused_delta_is_one_rotation_by_the_difference(style: RopeStyle) -> None:
    cfg = RopeConfig(64, base=500000.0, style=style)
    k = _x()
    old = torch.tensor([0, 5, 9, 100, 32000, 17, 4, 3, 2, 1])
    new = torch.tensor([100, 5, 0, 30000, 12, 18, 4000, 3, 9, 31999])  # includes b < a and b == a
    expected = _complex_reference(k, _angle(new - old, cfg), style)
    torch.testing.assert_close(rerope(k, old, new, cfg), expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize("style", STYLES)
def test_rerope_equals_unrotate_then_rotate_and_rope_from_scratch(style: RopeStyle) -> None:
    cfg = RopeConfig(64, style=style)
    x = _x()
    # LMCache's start-up check: 0..9 -> 100..109, plus a large backwards move
    for old, new in [
        (torch.arange(10), torch.arange(100, 110)),
        (torch.arange(30000, 30010), torch.arange(10)),
    ]:
        k_old = apply_rope(x, old, cfg)
        fused = rerope(k_old, old, new, cfg)
        torch.testing.assert_close(fused, rerope_two_step(k_old, old, new, cfg), rtol=0, atol=1e-9)
        torch.testing.assert_close(fused, apply_rope(x, new, cfg), rtol=0, atol=1e-9)


def test_identity_composition_inverse_and_norm() -> None:
    cfg = RopeConfig(64)
    k = _x(seed=3)
    a, b, c = torch.arange(10), torch.arange(500, 510), torch.arange(7, 17).flip(0)
    torch.testing.assert_close(rerope(k, a, a, cfg), k, rtol=0, atol=0)
    torch.testing.assert_close(
        rerope(rerope(k, a, b, cfg), b, c, cfg), rerope(k, a, c, cfg), rtol=0, atol=1e-10
    )
    torch.testing.assert_close(rerope(rerope(k, a, b, cfg), b, a, cfg), k, rtol=0, atol=1e-10)
    torch.testing.assert_close(
        rerope(k, a, b, cfg).norm(dim=-1), k.norm(dim=-1), rtol=1e-12, atol=0
    )


@pytest.mark.parametrize("style", STYLES)
def test_relative_position_invariance(style: RopeStyle) -> None:
    cfg = RopeConfig(64, style=style)
    q, k = _x(seed=1), _x(seed=2)
    m, n = torch.arange(10) * 3, torch.arange(10) + 40
    base = (apply_rope(q, m, cfg) * apply_rope(k, n, cfg)).sum(-1)
    for shift in (1, 1000, 25000):
        shifted = (apply_rope(q, m + shift, cfg) * apply_rope(k, n + shift, cfg)).sum(-1)
        torch.testing.assert_close(shifted, base, rtol=0, atol=1e-8)


def test_hkvd_score_is_rotation_invariant() -> None:
    cfg = RopeConfig(64)
    a, b, pos = _x(seed=4), _x(seed=5), torch.arange(1000, 1010)
    torch.testing.assert_close(
        deviation(apply_rope(a, pos, cfg), apply_rope(b, pos, cfg)),
        deviation(a, b),
        rtol=1e-12,
        atol=0,
    )


def test_neox_matches_transformers_llama_rotary() -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64)
    rotary = LlamaRotaryEmbedding(cfg)
    q, k = _x(dtype=torch.float32, seed=6), _x(dtype=torch.float32, seed=7)
    pos = torch.tensor([0, 1, 2, 3, 50, 51, 1000, 2047, 4000, 8191])
    cos, sin = rotary(q, pos[None])
    hq, hk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    ours = RopeConfig(64, base=10000.0, style=RopeStyle.NEOX)
    torch.testing.assert_close(apply_rope(q, pos, ours), hq[0].transpose(0, 1), rtol=0, atol=2e-5)
    torch.testing.assert_close(apply_rope(k, pos, ours), hk[0].transpose(0, 1), rtol=0, atol=2e-5)


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 3e-3), (torch.bfloat16, 6e-2)])
def test_low_precision_within_budget_at_large_positions(dtype: torch.dtype, atol: float) -> None:
    """fp32 angle error grows like |p|*eps (~2e-3 rad at 32k); bf16 adds its own rounding."""
    cfg = RopeConfig(64)
    x = _x(seed=8)
    old, new = torch.arange(31990, 32000), torch.arange(10)
    exact = rerope(apply_rope(x, old, cfg), old, new, cfg)
    low = rerope(apply_rope(x, old, cfg).to(dtype), old, new, cfg)
    assert low.dtype == dtype
    torch.testing.assert_close(low.to(torch.float64), exact, rtol=0, atol=atol * x.abs().max())
    # the fused form never touches absolute angles, so for small deltas it is as good as fp32
    k32 = _x(dtype=torch.float32, seed=9)
    torch.testing.assert_close(
        rerope(k32, old, old + 3, cfg).to(torch.float64),
        rerope(k32.to(torch.float64), old, old + 3, cfg),
        rtol=0,
        atol=1e-5,
    )


def test_bad_input_is_rejected_with_a_named_field() -> None:
    with pytest.raises(ValueError, match="head_dim"):
        RopeConfig(63)
    with pytest.raises(ValueError, match="base"):
        RopeConfig(64, base=1.0)
    cfg = RopeConfig(64)
    with pytest.raises(ValueError, match="one entry per token"):
        rerope(_x(), torch.arange(9), torch.arange(10), cfg)
    with pytest.raises(ValueError, match="integer"):
        apply_rope(_x(), torch.arange(10.0), cfg)
    with pytest.raises(ValueError, match=r"\[\.\.\., T, H, 64\]"):
        apply_rope(torch.zeros(10, 2, 32), torch.arange(10), cfg)
