"""Split a blend request into independently cached segments at a separator token sequence.

Why this exists: CacheBlend reuses a chunk wherever it appears, so a chunk's cache key must
depend on its tokens only, never on what precedes it (unlike prefix caching's hash chain).
LMCache's ``SegmentTokenDatabase`` splits the prompt at the tokens of ``blend_special_str`` and
hashes each piece on its own; the separator tokens belong to no segment (they become gaps, which
the blend recomputes).

Defined here where upstream is loose: matches are found left to right and never overlap; empty
pieces (separator at the start or end, or two in a row) are dropped; an empty separator or a
prompt shorter than it gives one segment (upstream yields that segment and then keeps going).
The key is SHA-256 over the int64 little-endian token ids, so it is the same on every host.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

__all__ = ["Segment", "segment_key", "split_segments"]


@dataclass(frozen=True)
class Segment:
    """Tokens ``[start, end)`` of the request, cached under ``key``."""

    start: int
    end: int
    key: str


def segment_key(tokens: torch.Tensor) -> str:
    """Position-independent cache key of a segment's tokens."""
    data = tokens.detach().to("cpu", torch.int64).contiguous().numpy().astype("<i8").tobytes()
    return hashlib.sha256(data).hexdigest()


def split_segments(tokens: torch.Tensor, separator: torch.Tensor) -> list[Segment]:
    """Segments of ``tokens[N]`` between occurrences of ``separator[S]`` (separators excluded)."""
    if tokens.dim() != 1 or separator.dim() != 1:
        raise ValueError(
            f"tokens and separator must be 1-D token-id tensors, got {tuple(tokens.shape)} "
            f"and {tuple(separator.shape)}"
        )
    toks = tokens.detach().to("cpu", torch.int64)
    sep = separator.detach().to("cpu", torch.int64)
    n, s = int(toks.shape[0]), int(sep.shape[0])
    bounds: list[tuple[int, int]] = []
    if s == 0 or n < s:
        bounds.append((0, n))
    else:
        hits = (toks.unfold(0, s, 1) == sep).all(dim=1).nonzero()[:, 0].tolist()
        start = 0
        for hit in hits:
            if hit < start:  # overlaps the previous match
                continue
            bounds.append((start, hit))
            start = hit + s
        bounds.append((start, n))
    return [Segment(a, b, segment_key(toks[a:b])) for a, b in bounds if b > a]
