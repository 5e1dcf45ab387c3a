"""Token sampling: greedy, or temperature with nucleus (top-p) filtering from a seeded RNG.

Why this module exists: the invariant the project is built on (same prompt, same tokens with
and without a KV hit) needs sampling that depends only on the logits and the request's own
seed, never on which other requests share the batch: each request draws from its own
``torch.Generator``.
"""

from __future__ import annotations

import random

import torch

from kvpool.worker.engine_api import EngineError, SamplingParams


def validate_sampling(params: SamplingParams, vocab_size: int) -> None:
    """Reject out-of-range sampling parameters with the field name and the allowed range."""
    if params.max_tokens < 1:
        raise EngineError(f"max_tokens must be at least 1, got {params.max_tokens}")
    if not params.temperature >= 0.0:  # also rejects NaN
        raise EngineError(f"temperature must be >= 0, got {params.temperature}")
    if not 0.0 < params.top_p <= 1.0:
        raise EngineError(f"top_p must be in (0, 1], got {params.top_p}")
    for token in params.stop_token_ids:
        if not 0 <= token < vocab_size:
            raise EngineError(
                f"stop_token_ids contains {token}, outside the vocabulary [0, {vocab_size})"
            )


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """The request's RNG (None for greedy); an unseeded request gets a fresh random seed."""
    if params.temperature == 0.0:
        return None
    seed = params.seed if params.seed is not None else random.getrandbits(63)
    return torch.Generator().manual_seed(seed)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from a 1-D float32 logits row."""
    if params.temperature == 0.0 or generator is None:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = (cumulative - sorted_probs) >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    choice = torch.multinomial(probs, 1, generator=generator)
    return int(choice.item())
