"""Symbol statistics per (layer, channel): histograms and LMCache's 16-bit integer CDF.

Why this module exists: both entropy coders model each (layer, channel) stream with the
histogram of its symbols over the chunk's tokens. The arithmetic coder turns it into the
16-bit CDF of LMCache's ``calculate_cdf`` (CUDA kernel and torch fallback agree):

    cdf[i] = floor((0xFFFF - max_bins) * cum[i] / T) + i,   cum[i] = sum(count[:i]),

with ``Lp = max_bins + 1`` entries for every layer, so ``cdf[0] = 0``, ``cdf[Lp-1] = 0xFFFF``
and every symbol, seen or not, has a width of at least 1. The container stores the
histogram (it compresses better than the CDF) and the decoder rebuilds the identical CDF.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from numba import njit

from kvpool.kernels.cachegen.errors import CacheGenError

PRECISION_TOP = 0xFFFF
MAX_TOKENS = 65535  # LMCache's histogram is uint16


@njit(cache=True, nogil=True)
def _count(sym: npt.NDArray[np.uint8], nsym: int) -> npt.NDArray[np.int32]:
    nl, nt, nc = sym.shape
    counts = np.zeros((nl, nc, nsym), dtype=np.int32)
    for layer in range(nl):
        for t in range(nt):
            row = sym[layer, t]
            for c in range(nc):
                counts[layer, c, row[c]] += 1
    return counts


def count_symbols(sym: npt.NDArray[np.uint8], nsym: int) -> npt.NDArray[np.int32]:
    """Histogram ``[layers, channels, nsym]`` of ``sym [layers, tokens, channels]``.

    Every symbol must be ``< nsym`` (the quantizer guarantees it).
    """
    if sym.ndim != 3 or sym.dtype != np.uint8:
        raise CacheGenError("count_symbols expects uint8 [layers, tokens, channels]")
    if sym.size and int(sym.max()) >= nsym:
        raise CacheGenError(f"symbol {int(sym.max())} out of range [0, {nsym})")
    return _count(np.ascontiguousarray(sym), nsym)


def cdf_from_counts(counts: npt.NDArray[np.integer], lp: int) -> npt.NDArray[np.int32]:
    """LMCache's CDF ``[..., lp]`` (int32 holding uint16 values) from histograms ``[..., n]``.

    ``n <= lp - 1``; missing trailing symbols count as 0. Every row must have the same total.
    """
    n = counts.shape[-1]
    if n > lp - 1:
        raise CacheGenError(f"{n} symbols do not fit a CDF of {lp} entries")
    cum = np.zeros((*counts.shape[:-1], lp), dtype=np.int64)
    np.cumsum(counts, axis=-1, out=cum[..., 1 : n + 1])
    if n + 1 < lp:
        cum[..., n + 1 :] = cum[..., n : n + 1]
    total = cum[..., -1:]
    if total.size and (int(total.min()) <= 0 or int(total.max()) > MAX_TOKENS):
        raise CacheGenError(f"histogram totals must be in [1, {MAX_TOKENS}]")
    top = PRECISION_TOP - (lp - 1)
    cdf = (top * cum) // total + np.arange(lp, dtype=np.int64)
    return cdf.astype(np.int32)


def check_cdf(cdf: npt.NDArray[np.integer]) -> None:
    """Raise unless every row starts at 0, strictly increases and stays within 16 bits."""
    if cdf.shape[-1] < 2:
        raise CacheGenError("a CDF needs at least 2 entries")
    if bool((cdf[..., 0] != 0).any()):
        raise CacheGenError("cdf[..., 0] must be 0")
    if bool((np.diff(cdf, axis=-1) < 1).any()):
        raise CacheGenError("cdf must be strictly increasing")
    if int(cdf.max()) > PRECISION_TOP:
        raise CacheGenError("cdf values must be <= 0xFFFF")
