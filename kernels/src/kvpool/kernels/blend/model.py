"""The decoder math that full prefill and CacheBlend share: Llama/Qwen layers from raw weights.

Why this exists: blending must recompute *some* rows of a layer and reuse cached K/V for the
rest, which a stock ``transformers`` forward cannot do. So the per-layer forward is written
here, once, from the model's own weights (RMSNorm, q/k/v/o projections with optional bias,
Qwen3's per-head q/k norms, RoPE, grouped-query attention, SwiGLU MLP), and both
:func:`full_prefill` and the blend path in :mod:`.blend` call the same three steps
(:func:`project_qkv`, :func:`attend`, :func:`finish_layer`). Tests check :func:`full_prefill`
against the transformers model's forward.

Attention takes query and key *positions* and uses the exact causal rule: key ``j`` is visible to
a query iff ``pos_k[j] <= pos_q``. The bottom-right-aligned mask that FlashAttention applies when
there are fewer queries than keys (LMCache issue #1152) is available only as
``MaskKind.BOTTOM_RIGHT`` so that tests can show it is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch
import torch.nn.functional as nnf

from kvpool.kernels.blend.rope import RopeConfig, RopeStyle, rope_cos_sin, rotate_cos_sin

__all__ = [
    "DecoderWeights",
    "KVCache",
    "LayerWeights",
    "MaskKind",
    "PrefillResult",
    "attend",
    "causal_mask",
    "final_norm",
    "finish_layer",
    "full_prefill",
    "logits",
    "project_qkv",
]


_QUERY_BLOCK = 256  # selected queries per attention call when the keys can be cut per block


class MaskKind(StrEnum):
    """Which causal mask :func:`attend` applies for a subset of queries."""

    EXACT = "exact"  # key j visible iff pos_k[j] <= pos_q[i]
    BOTTOM_RIGHT = "bottom_right"  # FlashAttention's alignment for q_len < k_len (LMCache #1152)


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's parameters, in ``nn.Linear`` orientation (``[out, in]``)."""

    input_norm: torch.Tensor
    q_w: torch.Tensor
    k_w: torch.Tensor
    v_w: torch.Tensor
    o_w: torch.Tensor
    post_norm: torch.Tensor
    gate_w: torch.Tensor
    up_w: torch.Tensor
    down_w: torch.Tensor
    q_b: torch.Tensor | None = None
    k_b: torch.Tensor | None = None
    v_b: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # Qwen3: RMSNorm over each head's dims, before RoPE
    k_norm: torch.Tensor | None = None


@dataclass(frozen=True)
class DecoderWeights:
    """A Llama/Qwen2-style decoder: embeddings, layers, final norm, LM head and shapes."""

    embed: torch.Tensor
    layers: tuple[LayerWeights, ...]
    final_norm: torch.Tensor
    lm_head: torch.Tensor
    n_heads: int
    n_kv_heads: int
    rope: RopeConfig
    eps: float

    @property
    def head_dim(self) -> int:
        return self.rope.head_dim

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @classmethod
    def from_hf(cls, model: Any) -> DecoderWeights:
        """Take the weights of a transformers Llama/Qwen2/Qwen3 causal LM (no copy).

        Rejects what blending cannot re-rotate (rope scaling, partial rotary) and MLPs other than
        SwiGLU, naming the config field.
        """
        cfg = model.config
        rope_params = dict(getattr(cfg, "rope_parameters", None) or {})
        legacy = getattr(cfg, "rope_scaling", None) or {}  # transformers < 5 spelling
        rope_type = rope_params.get("rope_type", legacy.get("rope_type", "default"))
        if rope_type != "default":
            raise ValueError(
                f"config.rope_parameters.rope_type={rope_type!r}: blending supports only plain "
                "RoPE (no rope scaling), as LMCache's validate_rope_params does"
            )
        if float(rope_params.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError("config.partial_rotary_factor must be 1.0 for blending")
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"config.hidden_act={cfg.hidden_act!r}: only SwiGLU ('silu') is wired")
        layer_types = list(getattr(cfg, "layer_types", None) or [])
        if getattr(cfg, "use_sliding_window", False) or "sliding_attention" in layer_types:
            raise ValueError(
                "config.use_sliding_window/layer_types: sliding-window attention is not "
                "supported by the blend path (its mask is plain causal)"
            )
        theta = rope_params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        layers = []
        for layer in model.model.layers:
            att, mlp = layer.self_attn, layer.mlp
            layers.append(
                LayerWeights(
                    input_norm=layer.input_layernorm.weight.detach(),
                    q_w=att.q_proj.weight.detach(),
                    k_w=att.k_proj.weight.detach(),
                    v_w=att.v_proj.weight.detach(),
                    o_w=att.o_proj.weight.detach(),
                    post_norm=layer.post_attention_layernorm.weight.detach(),
                    gate_w=mlp.gate_proj.weight.detach(),
                    up_w=mlp.up_proj.weight.detach(),
                    down_w=mlp.down_proj.weight.detach(),
                    q_b=_bias(att.q_proj),
                    k_b=_bias(att.k_proj),
                    v_b=_bias(att.v_proj),
                    q_norm=_norm_weight(att, "q_norm"),
                    k_norm=_norm_weight(att, "k_norm"),
                )
            )
        return cls(
            embed=model.model.embed_tokens.weight.detach(),
            layers=tuple(layers),
            final_norm=model.model.norm.weight.detach(),
            lm_head=model.lm_head.weight.detach(),
            n_heads=int(cfg.num_attention_heads),
            n_kv_heads=int(cfg.num_key_value_heads),
            rope=RopeConfig(head_dim=int(head_dim), base=float(theta), style=RopeStyle.NEOX),
            eps=float(cfg.rms_norm_eps),
        )


def _bias(linear: Any) -> torch.Tensor | None:
    b = getattr(linear, "bias", None)
    return None if b is None else b.detach()


def _norm_weight(attn: Any, name: str) -> torch.Tensor | None:
    norm = getattr(attn, name, None)
    return None if norm is None else norm.weight.detach()


@dataclass(frozen=True)
class KVCache:
    """Post-RoPE K and V for ``L`` layers and ``N`` tokens: ``k``/``v`` are ``[L, N, Hkv, D]``.

    ``positions[N]`` are the absolute positions K was rotated at.
    """

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor

    def __post_init__(self) -> None:
        if self.k.shape != self.v.shape or self.k.dim() != 4:
            raise ValueError(
                f"KVCache.k/v must both be [L, N, Hkv, D], got {tuple(self.k.shape)} "
                f"and {tuple(self.v.shape)}"
            )
        if self.positions.shape != (self.k.shape[1],):
            got = tuple(self.positions.shape)
            raise ValueError(f"KVCache.positions must be [N={self.k.shape[1]}], got {got}")

    @property
    def n_tokens(self) -> int:
        return int(self.k.shape[1])


@dataclass(frozen=True)
class PrefillResult:
    """Final-normed hidden states ``[N, hidden]`` of every token and the KV cache it produced."""

    hidden: torch.Tensor
    kv: KVCache


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.to(torch.float32) if x.dtype != torch.float64 else x
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def project_qkv(
    w: DecoderWeights,
    lw: LayerWeights,
    hidden: torch.Tensor,
    cos_sin: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input RMSNorm, q/k/v projections and RoPE for the rows given: ``[R, H, D]`` each.

    ``cos_sin`` are the rows' RoPE tables from :func:`~.rope.rope_cos_sin`.
    """
    x = _rms_norm(hidden, lw.input_norm, w.eps)
    rows, d = x.shape[0], w.head_dim
    q = nnf.linear(x, lw.q_w, lw.q_b).view(rows, w.n_heads, d)
    k = nnf.linear(x, lw.k_w, lw.k_b).view(rows, w.n_kv_heads, d)
    v = nnf.linear(x, lw.v_w, lw.v_b).view(rows, w.n_kv_heads, d)
    if lw.q_norm is not None:
        q = _rms_norm(q, lw.q_norm, w.eps)
    if lw.k_norm is not None:
        k = _rms_norm(k, lw.k_norm, w.eps)
    cos, sin = cos_sin
    style = w.rope.style
    return rotate_cos_sin(q, cos, sin, style), rotate_cos_sin(k, cos, sin, style), v


def causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, kind: MaskKind) -> torch.Tensor:
    """Boolean ``[Q, K]`` mask, True where the key is visible to the query.

    EXACT: ``k_pos[j] <= q_pos[i]``. BOTTOM_RIGHT: the ``i``-th query sees the first
    ``i + K - Q + 1`` keys regardless of its position (what flash-attn's ``causal=True`` does for
    ``Q < K``); wrong for a non-suffix selection, kept to demonstrate LMCache #1152.
    """
    if kind is MaskKind.EXACT:
        return k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)
    n_q, n_k = q_pos.shape[0], k_pos.shape[0]
    i = torch.arange(n_q, device=q_pos.device).unsqueeze(1)
    j = torch.arange(n_k, device=q_pos.device).unsqueeze(0)
    return j <= i + (n_k - n_q)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    mask: MaskKind = MaskKind.EXACT,
) -> torch.Tensor:
    """Causal GQA attention of ``q[Q, Hq, D]`` over ``k/v[K, Hkv, D]``; returns ``[Q, Hq*D]``.

    When the queries are exactly the keys (full prefill, or every row selected) this uses the
    fused ``is_causal`` path, which is the exact mask; otherwise it builds the mask explicitly.
    """
    n_q, n_heads, d = q.shape
    # 4-D [1, H, T, D]: PyTorch's fused CPU kernel only takes batched inputs (3-D falls back to
    # the math path, ~10x slower at 8K tokens)
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    gqa = n_heads != k.shape[1]
    if n_q == k.shape[0] and torch.equal(q_pos, k_pos):
        out = nnf.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=gqa)
    elif mask is MaskKind.EXACT and n_q > _QUERY_BLOCK and bool((k_pos[1:] > k_pos[:-1]).all()):
        # blocks of queries, each over only the keys its last query can see: skips most of the
        # masked-out upper triangle, as a causal kernel would
        ends = torch.searchsorted(k_pos, q_pos, right=True).tolist()
        parts = []
        for lo in range(0, n_q, _QUERY_BLOCK):
            hi = min(lo + _QUERY_BLOCK, n_q)
            n_k = max(ends[lo:hi])
            m = causal_mask(q_pos[lo:hi], k_pos[:n_k], mask)
            parts.append(
                nnf.scaled_dot_product_attention(
                    qh[:, :, lo:hi], kh[:, :, :n_k], vh[:, :, :n_k], attn_mask=m, enable_gqa=gqa
                )
            )
        out = torch.cat(parts, dim=2)
    else:
        m = causal_mask(q_pos, k_pos, mask)
        out = nnf.scaled_dot_product_attention(qh, kh, vh, attn_mask=m, enable_gqa=gqa)
    return out[0].transpose(0, 1).reshape(n_q, n_heads * d)


def finish_layer(
    w: DecoderWeights, lw: LayerWeights, hidden: torch.Tensor, attn: torch.Tensor
) -> torch.Tensor:
    """Output projection, residual, post-attention RMSNorm, SwiGLU MLP, residual."""
    h = hidden + nnf.linear(attn, lw.o_w)
    x = _rms_norm(h, lw.post_norm, w.eps)
    return h + nnf.linear(nnf.silu(nnf.linear(x, lw.gate_w)) * nnf.linear(x, lw.up_w), lw.down_w)


def final_norm(w: DecoderWeights, hidden: torch.Tensor) -> torch.Tensor:
    """The model's last RMSNorm (what transformers reports as the last hidden state)."""
    return _rms_norm(hidden, w.final_norm, w.eps)


def logits(w: DecoderWeights, normed_hidden: torch.Tensor) -> torch.Tensor:
    """LM-head logits of final-normed hidden states."""
    return nnf.linear(normed_hidden, w.lm_head)


def full_prefill(
    w: DecoderWeights, tokens: torch.Tensor, positions: torch.Tensor | None = None
) -> PrefillResult:
    """Plain causal prefill of ``tokens[N]`` (at ``positions``, default ``0..N-1``)."""
    if tokens.dim() != 1 or tokens.shape[0] == 0:
        raise ValueError(f"tokens must be a non-empty 1-D tensor, got shape {tuple(tokens.shape)}")
    n = tokens.shape[0]
    pos = torch.arange(n, device=tokens.device) if positions is None else positions
    hidden = nnf.embedding(tokens, w.embed)
    cos_sin = rope_cos_sin(pos, w.rope, hidden)
    ks, vs = [], []
    for lw in w.layers:
        q, k, v = project_qkv(w, lw, hidden, cos_sin)
        ks.append(k)
        vs.append(v)
        hidden = finish_layer(w, lw, hidden, attend(q, k, v, pos, pos))
    return PrefillResult(
        hidden=final_norm(w, hidden), kv=KVCache(torch.stack(ks), torch.stack(vs), pos)
    )
