"""Synthetic CacheBlend workloads: a tiny random-weight transformers model and RAG prompts.

Why this exists: the blend properties and the benchmark need a real model's math and a
RAG-shaped prompt whose chunks were cached independently, and this machine cannot download
weights. Tests and ``kernels/bench/blend_bench.py`` share this one builder so they measure the
same thing. ``transformers`` is imported lazily: the blend core does not need it.

A RAG prompt here is ``[system][chunk_0 .. chunk_{n-1} in a shuffled order][question]``. The
system prompt is cached as an exact prefix; every chunk is cached on its own behind the system
prompt (positions ``sys_len ..``), as a retrieval store would have produced it, and then placed
at a different position in the request; the question is never cached.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch

from kvpool.kernels.blend.blend import CachedSegment
from kvpool.kernels.blend.model import DecoderWeights, KVCache, full_prefill, logits

__all__ = [
    "RagPrompt",
    "TinyModelSpec",
    "build_hf_model",
    "quality",
    "rag_prompt",
    "single_thread",
]


@contextmanager
def single_thread() -> Iterator[None]:
    """Run tiny tensor work on one intra-op thread, restoring the setting afterwards.

    On a shared 2-core box a second thread only spins for these small matrices (~30x slower).
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the random-weight model (defaults: 4 layers, GQA 4/2 heads, head dim 64)."""

    family: Literal["llama", "qwen2", "qwen3"] = "llama"
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 512
    vocab: int = 512
    init_std: float = 0.02
    seed: int = 0
    dtype: torch.dtype = torch.float32


def build_hf_model(spec: TinyModelSpec) -> Any:
    """A transformers Llama/Qwen2/Qwen3 causal LM with seeded random weights."""
    import transformers  # noqa: PLC0415 - optional: only tests and the bench build models

    kwargs: dict[str, Any] = {
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "initializer_range": spec.init_std,
        "max_position_embeddings": 32768,
    }
    if spec.family == "llama":
        config: Any = transformers.LlamaConfig(**kwargs)
        model_cls: Any = transformers.LlamaForCausalLM
    elif spec.family == "qwen2":
        config = transformers.Qwen2Config(**kwargs)
        model_cls = transformers.Qwen2ForCausalLM
    else:
        config = transformers.Qwen3Config(**kwargs)
        model_cls = transformers.Qwen3ForCausalLM
    config._attn_implementation = "sdpa"
    torch.manual_seed(spec.seed)
    model = model_cls(config).eval().to(spec.dtype)
    # biases (Qwen2 q/k/v) start at zero and norms (Qwen3 q/k) at one: perturb them so that a
    # path that ignored them would be caught
    gen = torch.Generator().manual_seed(spec.seed + 1)
    with torch.no_grad():
        for layer in model.model.layers:
            att = layer.self_attn
            params = [(getattr(p, "bias", None), 0.0) for p in (att.q_proj, att.k_proj, att.v_proj)]
            params += [
                (getattr(att, n).weight, 1.0) for n in ("q_norm", "k_norm") if hasattr(att, n)
            ]
            for param, base in params:
                if param is not None:
                    noise = torch.randn(param.shape, generator=gen) * 0.5 + base
                    param.copy_(noise.to(spec.dtype))
    return model


@dataclass(frozen=True)
class RagPrompt:
    """The request tokens, its cached segments and where the (uncached) question starts."""

    tokens: torch.Tensor
    segments: tuple[CachedSegment, ...]
    question_start: int


def rag_prompt(
    w: DecoderWeights,
    *,
    n_chunks: int,
    chunk_len: int,
    sys_len: int,
    question_len: int,
    seed: int,
) -> RagPrompt:
    """Random tokens; chunks prefilled one by one behind the system prompt, then shuffled."""
    if min(n_chunks, chunk_len, question_len) < 1 or sys_len < 0:
        raise ValueError("n_chunks, chunk_len and question_len must be >= 1 and sys_len >= 0")
    gen = torch.Generator().manual_seed(seed)
    vocab = int(w.embed.shape[0])
    dev = w.embed.device
    system = torch.randint(0, vocab, (sys_len,), generator=gen).to(dev)
    chunks = [torch.randint(0, vocab, (chunk_len,), generator=gen).to(dev) for _ in range(n_chunks)]
    question = torch.randint(0, vocab, (question_len,), generator=gen).to(dev)
    cached = []
    for chunk in chunks:
        kv = full_prefill(w, torch.cat((system, chunk))).kv
        cached.append(KVCache(kv.k[:, sys_len:], kv.v[:, sys_len:], kv.positions[sys_len:].clone()))
    segments: list[CachedSegment] = []
    if sys_len:
        segments.append(CachedSegment(0, system, full_prefill(w, system).kv))
    start = sys_len
    for i in torch.randperm(n_chunks, generator=gen).tolist():
        segments.append(CachedSegment(start, chunks[i], cached[i]))
        start += chunk_len
    tokens = torch.cat((system, *(s.tokens for s in segments[1 if sys_len else 0 :]), question))
    return RagPrompt(tokens=tokens, segments=tuple(segments), question_start=start)


def quality(w: DecoderWeights, reference: torch.Tensor, blended: torch.Tensor) -> dict[str, float]:
    """Relative L2 error of final-normed hidden states and logits, top-1 agreement, and the mean
    KL divergence ``KL(reference || blended)`` of the next-token distributions (nats).

    ``reference`` and ``blended`` are ``[R, hidden]`` rows of the same tokens.
    """
    ref_logits, bl_logits = logits(w, reference), logits(w, blended)
    ref_lp = ref_logits.to(torch.float64).log_softmax(-1)
    bl_lp = bl_logits.to(torch.float64).log_softmax(-1)
    return {
        "kl_nats": float((ref_lp.exp() * (ref_lp - bl_lp)).sum(-1).mean()),
        "hidden_rel_error": float((blended - reference).norm() / reference.norm()),
        "logits_rel_error": float((bl_logits - ref_logits).norm() / ref_logits.norm()),
        "top1_agreement": float(
            (bl_logits.argmax(-1) == ref_logits.argmax(-1)).to(torch.float64).mean()
        ),
    }
