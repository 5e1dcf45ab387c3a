"""The reference engine's transformer: HF weights, our own forward over a paged KV cache.

Why this module exists: the reference engine must produce real KV (so LMCache stores and
loads real tensors and a hit really saves prefill time) without vLLM, which does not run on
CPU. The weights and the small building blocks (embedding, RMSNorm, projections, MLP, rotary
frequencies) come from a ``transformers`` Llama/Qwen-family model, either a local HF model
directory or a Qwen3-style config with random weights drawn from a fixed seed (so two worker
processes with the same seed compute bit-identical KV). The attention and the KV cache are
ours: K and V are written into per-layer paged caches in the vLLM flash NHD layout
``[2, num_blocks, block_size, num_kv_heads, head_dim]`` through a slot mapping and read back
through block tables, exactly the memory that the KV offload (LMCache) reads and writes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, Qwen3Config

from kvpool.worker.engine_api import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    EngineError,
    ReferenceEngineOptions,
)

logger = logging.getLogger(__name__)

# Model families whose decoder layer is: RMSNorm → attention (q/k/v/o projections, optional
# per-head q/k norm, RoPE) → residual → RMSNorm → gated MLP → residual.
SUPPORTED_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# Default reference sizes: an 8K-token prefill takes a few seconds on 2 CPU cores, and
# attention (quadratic in the prompt) dominates it, as on a real accelerator.
REFERENCE_SIZES: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
}
INIT_STD = 0.02


@dataclass(frozen=True)
class ModelShape:
    """What the KV cache and the offload need to know about the model."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    dtype: torch.dtype

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers, in bytes."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem


@dataclass
class SeqChunk:
    """The tokens one sequence computes in one forward pass (a prefill chunk or a decode)."""

    token_ids: Sequence[int]
    start_pos: int  # KV of positions [0, start_pos) is already in the cache
    block_table: Sequence[int]
    want_logits: bool = True


def resolve_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise EngineError(
            f"dtype {name!r} is not supported by the reference engine; use one of {sorted(DTYPES)}"
        ) from None


def reference_config(options: ReferenceEngineOptions, **overrides: Any) -> Qwen3Config:
    """The Qwen3-style config of the random-weight reference model."""
    sizes = {**REFERENCE_SIZES, **overrides}
    return Qwen3Config(
        vocab_size=options.vocab_size,
        max_position_embeddings=max(options.max_model_len, 1),
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        pad_token_id=PAD_TOKEN_ID,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        **sizes,
    )


def init_weights(model: nn.Module, seed: int) -> None:
    """Deterministic weights from ``seed`` alone (independent of transformers' init order):
    norms are ones, biases zeros, every other parameter N(0, INIT_STD) in name order."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if "norm" in name:
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                values = torch.randn(param.shape, generator=gen, dtype=torch.float32)
                param.copy_(values * INIT_STD)


def load_hf_model(
    options: ReferenceEngineOptions, **config_overrides: Any
) -> tuple[PreTrainedModel, Any]:
    """Build (random weights) or load (local directory, never a hub) the HF model."""
    dtype = resolve_dtype(options.dtype)
    if options.model_dir is None:
        config = reference_config(options, **config_overrides)
        config._attn_implementation = "sdpa"
        auto: Any = AutoModelForCausalLM  # untyped classmethods
        model = auto.from_config(config, dtype=torch.float32)
        init_weights(model, options.weights_seed)
        logger.info(
            "reference model %s: random weights from seed %d, %d layers, hidden %d",
            options.model_name,
            options.weights_seed,
            config.num_hidden_layers,
            config.hidden_size,
        )
    else:
        config = local_config(options.model_dir)
        check_supported(config, options.model_dir)
        model = AutoModelForCausalLM.from_pretrained(
            options.model_dir, local_files_only=True, dtype=torch.float32
        )
        logger.info("reference model %s loaded from %s", options.model_name, options.model_dir)
    model = model.to(dtype).eval()
    model.requires_grad_(False)
    return model, config


def check_supported(config: Any, where: str) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise EngineError(
            f"model_dir {where!r} has model_type {model_type!r}; the reference engine runs "
            f"{sorted(SUPPORTED_MODEL_TYPES)} models"
        )
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        layer_types = getattr(config, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types) or not layer_types:
            raise EngineError(
                f"model_dir {where!r} uses sliding-window attention, which the reference "
                "engine does not implement; use a full-attention model"
            )


def shape_of(config: Any, dtype: torch.dtype) -> ModelShape:
    num_heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return ModelShape(
        num_layers=int(config.num_hidden_layers),
        num_heads=num_heads,
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or num_heads),
        head_dim=int(head_dim),
        hidden_size=int(config.hidden_size),
        vocab_size=int(config.vocab_size),
        dtype=dtype,
    )


def model_shape(options: ReferenceEngineOptions, **config_overrides: Any) -> ModelShape:
    """The model's KV shape from its config alone (no weights loaded): what an offload
    (LMCache) needs to be built before the engine starts."""
    dtype = resolve_dtype(options.dtype)
    if options.model_dir is None:
        return shape_of(reference_config(options, **config_overrides), dtype)
    return shape_of(local_config(options.model_dir), dtype)


def local_config(model_dir: str) -> Any:
    """The config of a local HF model directory; never contacts a hub."""
    try:
        return AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise EngineError(
            f"model_dir {model_dir!r} is not a local HF model directory (config.json): {exc}"
        ) from exc


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class PagedModel:
    """Our forward pass over the HF model's weights, with K/V in paged caches."""

    def __init__(self, hf_model: PreTrainedModel, config: Any) -> None:
        self.hf_model = hf_model
        self.config = config
        body = hf_model.model
        self.embed: nn.Module = body.embed_tokens
        self.layers: list[Any] = list(body.layers)
        self.norm: nn.Module = body.norm
        self.rotary: nn.Module = body.rotary_emb
        self.lm_head: nn.Module = hf_model.lm_head
        self.shape = shape_of(config, next(hf_model.parameters()).dtype)
        # cos/sin of every position computed so far (the rotary module's own values: each is
        # one elementwise product, so a table lookup gives the same bits); None when the
        # rotary depends on the sequence length (dynamic scaling) and must run per call.
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None
        self._rope_static = getattr(self.rotary, "rope_type", "default") in _STATIC_ROPE

    def allocate_kv_caches(self, num_blocks: int, block_size: int) -> list[torch.Tensor]:
        """One zeroed NHD cache per layer: [2, num_blocks, block_size, kv_heads, head_dim]."""
        s = self.shape
        return [
            torch.zeros(2, num_blocks, block_size, s.num_kv_heads, s.head_dim, dtype=s.dtype)
            for _ in range(s.num_layers)
        ]

    @torch.inference_mode()
    def forward(
        self, chunks: Sequence[SeqChunk], kv_caches: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        """Compute ``chunks`` (concatenated, varlen) and return float32 logits of the last
        token of every chunk with ``want_logits``, in order: [num_wanted, vocab].

        Written for few ops per layer (a hit computes one token, so per-op overhead is most
        of its time): weights are applied with ``F.linear``, RMSNorm is one fused op in
        fp32, cos/sin come from a table, GQA heads are shared inside the attention kernel.
        """
        s = self.shape
        block_size = kv_caches[0].shape[2]
        ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long)
        positions = torch.cat(
            [torch.arange(c.start_pos, c.start_pos + len(c.token_ids)) for c in chunks]
        )
        slots = torch.cat(
            [slot_mapping(c.block_table, block_size, c.start_pos, len(c.token_ids)) for c in chunks]
        )
        blocks = [
            torch.tensor(
                list(c.block_table[: math.ceil((c.start_pos + len(c.token_ids)) / block_size)]),
                dtype=torch.long,
            )
            for c in chunks
        ]
        hidden = self.embed(ids)  # [T, H]
        cos, sin = self._cos_sin(hidden, positions)  # [T, 1, D]
        total = ids.shape[0]
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            attn = layer.self_attn
            x = _rms_norm(layer.input_layernorm, hidden)
            q = _linear(attn.q_proj, x).view(total, s.num_heads, s.head_dim)
            k = _linear(attn.k_proj, x).view(total, s.num_kv_heads, s.head_dim)
            v = _linear(attn.v_proj, x).view(total, s.num_kv_heads, s.head_dim)
            if hasattr(attn, "q_norm"):
                q = _rms_norm(attn.q_norm, q)
                k = _rms_norm(attn.k_norm, k)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            kv[0].view(-1, s.num_kv_heads, s.head_dim)[slots] = k
            kv[1].view(-1, s.num_kv_heads, s.head_dim)[slots] = v
            out = self._attention(q, chunks, blocks, kv)
            hidden = hidden + _linear(attn.o_proj, out)
            mlp = layer.mlp
            x = _rms_norm(layer.post_attention_layernorm, hidden)
            gated = mlp.act_fn(_linear(mlp.gate_proj, x)) * _linear(mlp.up_proj, x)
            hidden = hidden + _linear(mlp.down_proj, gated)
        ends = []
        offset = 0
        for c in chunks:
            offset += len(c.token_ids)
            if c.want_logits:
                ends.append(offset - 1)
        if not ends:
            return torch.empty(0, s.vocab_size, dtype=torch.float32)
        last = _rms_norm(self.norm, hidden[torch.tensor(ends, dtype=torch.long)])
        logits: torch.Tensor = self.lm_head(last)
        return logits.float()

    def _cos_sin(
        self, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, 1, D]`` of ``positions``."""
        if not self._rope_static:
            cos, sin = self.rotary(hidden, positions.unsqueeze(0))
            return cos[0].unsqueeze(1), sin[0].unsqueeze(1)
        need = int(positions.max()) + 1 if positions.numel() else 0
        table = self._rope_table
        if table is None or table[0].size(0) < need:
            size = max(need, 2 * table[0].size(0) if table is not None else 1024)
            cos, sin = self.rotary(hidden, torch.arange(size).unsqueeze(0))
            table = self._rope_table = (cos[0].unsqueeze(1), sin[0].unsqueeze(1))
        return table[0][positions], table[1][positions]

    def _attention(
        self,
        q: torch.Tensor,
        chunks: Sequence[SeqChunk],
        blocks: Sequence[torch.Tensor],
        kv: torch.Tensor,
    ) -> torch.Tensor:
        """Causal attention of each chunk's queries over its sequence's paged K/V."""
        s = self.shape
        gqa = s.num_heads != s.num_kv_heads
        outs = []
        offset = 0
        for c, table in zip(chunks, blocks, strict=True):
            n = len(c.token_ids)
            ctx = c.start_pos + n
            keys = kv[0][table].reshape(-1, s.num_kv_heads, s.head_dim)[:ctx]
            values = kv[1][table].reshape(-1, s.num_kv_heads, s.head_dim)[:ctx]
            qi = q[offset : offset + n].transpose(0, 1).unsqueeze(0)  # [1, h, n, D]
            ki = keys.transpose(0, 1).unsqueeze(0)  # [1, kv_h, ctx, D]
            vi = values.transpose(0, 1).unsqueeze(0)
            if c.start_pos == 0:
                o = _sdpa(qi, ki, vi, is_causal=True, enable_gqa=gqa)
            elif n == 1:
                o = _sdpa(qi, ki, vi, enable_gqa=gqa)
            else:
                qpos = torch.arange(c.start_pos, ctx).unsqueeze(1)
                mask = torch.arange(ctx).unsqueeze(0) <= qpos  # [n, ctx], bottom-right causal
                o = _sdpa(qi, ki, vi, attn_mask=mask, enable_gqa=gqa)
            outs.append(o[0].transpose(0, 1).reshape(n, s.num_heads * s.head_dim))
            offset += n
        return outs[0] if len(outs) == 1 else torch.cat(outs)


# Rotary types whose frequencies do not depend on the sequence length.
_STATIC_ROPE = frozenset({"default", "linear", "llama3"})
_sdpa = torch.nn.functional.scaled_dot_product_attention


def _linear(proj: Any, x: torch.Tensor) -> torch.Tensor:
    """``proj(x)`` for an ``nn.Linear`` without the module call's hooks machinery."""
    return torch.nn.functional.linear(x, proj.weight, proj.bias)


def _rms_norm(norm: Any, x: torch.Tensor) -> torch.Tensor:
    """The model's RMSNorm: one fused op in fp32 (equal to HF's to rounding), the module
    itself for other dtypes (HF normalises in fp32 and scales in the model's dtype)."""
    if x.dtype != torch.float32:
        return norm(x)  # type: ignore[no-any-return]
    return torch.nn.functional.rms_norm(x, (x.size(-1),), norm.weight, norm.variance_epsilon)


def slot_mapping(
    block_table: Sequence[int], block_size: int, start: int, count: int
) -> torch.Tensor:
    """Slots (``block_id * block_size + offset``) of positions [start, start + count)."""
    pos = torch.arange(start, start + count, dtype=torch.long)
    table = torch.tensor(list(block_table), dtype=torch.long)
    return table[pos // block_size] * block_size + pos % block_size
