"""HKVD token selection for CacheBlend: which rows get recomputed after a check layer.

Why this exists: CacheBlend recomputes only the tokens whose reused KV deviates most from the
freshly computed KV ("high KV deviation"). The score is ``sum((new - old)^2)`` over heads and
head dims, in float32, on K (LMCache's choice, post-RoPE; RoPE preserves norms so pre- or
post-RoPE gives the same score) or on V (the original CacheBlend's choice). A seeded random
score is the baseline the benchmark and tests compare HKVD against.

Contract (reference §6.5.4): ``|S| = min(floor(r * N), candidates)`` plus the forced rows (gaps,
uncached suffix, the last token); ``S`` is sorted and unique; ties break towards the lower index.
"""

from __future__ import annotations

import math
from enum import StrEnum

import torch

__all__ = ["Selector", "deviation", "select_rows", "target_count"]


class Selector(StrEnum):
    """How rows are scored at a check layer."""

    K_DEVIATION = "k"
    V_DEVIATION = "v"
    RANDOM = "random"  # baseline: seeded uniform scores


def deviation(fresh: torch.Tensor, loaded: torch.Tensor) -> torch.Tensor:
    """Per-row squared L2 deviation ``[R]`` of ``fresh`` vs ``loaded`` (``[R, H, D]``), float32.

    float64 inputs are scored in float64 so exact-cache tests see exact zeros.
    """
    dt = torch.float64 if fresh.dtype == torch.float64 else torch.float32
    diff = fresh.to(dt) - loaded.to(dt)
    return diff.pow(2).flatten(1).sum(dim=1)


def target_count(ratio: float, n_tokens: int) -> int:
    """``floor(ratio * N)`` with a tolerance so that e.g. 0.15 * 100 gives 15, not 14."""
    return min(n_tokens, math.floor(ratio * n_tokens + 1e-9))


def select_rows(
    rows: torch.Tensor, scores: torch.Tensor, forced: torch.Tensor, count: int
) -> torch.Tensor:
    """Pick the ``count`` highest-scoring unforced rows, add every forced row, sort.

    ``rows[R]`` are absolute token indices (sorted), ``scores[R]`` their scores, ``forced[R]``
    a bool mask of rows that must be kept. Returns the sorted absolute indices of the selection.
    """
    if not (rows.shape == scores.shape == forced.shape) or rows.dim() != 1:
        raise ValueError(
            f"rows, scores and forced must be equal-length 1-D tensors, got "
            f"{tuple(rows.shape)}, {tuple(scores.shape)}, {tuple(forced.shape)}"
        )
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    candidates = (~forced).nonzero().squeeze(1)
    take = min(count, int(candidates.shape[0]))
    # stable descending sort: among equal scores the lower index (earlier token) wins
    order = torch.sort(scores[candidates], descending=True, stable=True).indices[:take]
    keep = torch.cat((candidates[order], forced.nonzero().squeeze(1)))
    return torch.sort(rows[keep]).values
