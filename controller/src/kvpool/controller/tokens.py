"""Token ids → LMCache chunk hashes, the way LMCache's own controller computes them.

Why: LMCache's ``/lookup`` takes raw tokens and hashes them with a default
``ChunkedTokenDatabase()``: 256-token chunks (the last one may be partial), Python's builtin
``hash`` chained from ``NONE_HASH = 0`` over ``(prefix_hash, tuple(chunk), ())``. Builtin hashes
of int tuples do not depend on ``PYTHONHASHSEED``, so this matches every LMCache process that
uses the builtin algorithm. Pools configured with another ``pre_caching_hash_algorithm`` (e.g.
``sha256_cbor``) must send hashes (``/v1/prefix_lookup {"hashes": ...}``), not tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

NONE_HASH = 0


def chunk_hashes(tokens: Sequence[int], chunk_size: int = 256) -> list[int]:
    """Chained per-chunk hashes of ``tokens`` (``hash((prev, tuple(chunk), ()))``)."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    out: list[int] = []
    prefix = NONE_HASH
    for start in range(0, len(tokens), chunk_size):
        prefix = hash((prefix, tuple(tokens[start : start + chunk_size]), ()))
        out.append(prefix)
    return out
