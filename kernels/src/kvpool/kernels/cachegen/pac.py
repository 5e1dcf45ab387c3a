"""PAC: a power-of-2 aligned, fixed code per (layer, channel), decoded by table lookup.

Why this module exists: LMCache-Ascend replaced CacheGen's serial arithmetic coder with PAC
because a fixed code per stream vectorises and decodes with a table. The Ascend kernel is
not public-format compatible with anything (16-bit words, byte-swapped), so this is our own
variant with the same properties (reference notes §2, §6.3):

* every symbol seen in a stream's histogram gets a code of 1..8 bits; its interval
  ``[low_s, low_s + 2^(8-len_s))`` on a 256-slot line is dyadic (``low_s`` is a multiple of
  its size) and ``code_s = low_s >> (8 - len_s)``; the intervals are disjoint (Kraft <= 1),
  so the code is prefix-free and one 8-bit peek decodes a symbol through a 256-entry table;
* unseen symbols get the sentinel length 9 (unencodable): encoding one is an error;
* lengths: Shannon lengths ``ceil(log2(T / count))`` clamped to [1, 8], lengthened if the
  clamp overfills the line, then shortened greedily (most frequent symbol first) while the
  line has room; codes are assigned canonically (by length, then symbol), so the container
  only stores the lengths;
* a stream is its codes concatenated MSB-first and zero-padded to a whole byte: its length
  is exactly ``ceil(sum(len) / 8)`` bytes, which the decoder checks.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from numba import njit

from kvpool.kernels.cachegen.ac import as_streams, stream_offsets
from kvpool.kernels.cachegen.errors import CacheGenError

UNENCODABLE = 9
MAX_LEN = 8
SLOTS = 1 << MAX_LEN


@njit(cache=True, nogil=True)
def _lengths(counts: npt.NDArray[np.int32], out: npt.NDArray[np.uint8]) -> None:
    nstreams, n = counts.shape
    order = np.empty(n, dtype=np.int64)
    for g in range(nstreams):
        row = counts[g]
        total = 0
        for s in range(n):
            total += row[s]
        used = 0
        for s in range(n):
            c = row[s]
            if c == 0:
                out[g, s] = UNENCODABLE
                continue
            ln = 1
            while ln < MAX_LEN and (c << ln) < total:
                ln += 1
            out[g, s] = ln
            used += 1 << (MAX_LEN - ln)
        while used > SLOTS:  # lengthen the least frequent code that can still grow
            best = -1
            for s in range(n):
                if (
                    row[s] > 0
                    and out[g, s] < MAX_LEN
                    and (best < 0 or row[s] < row[best] or (row[s] == row[best] and s > best))
                ):
                    best = s
            used -= 1 << (MAX_LEN - out[g, best] - 1)
            out[g, best] += 1
        # most frequent first (stable by symbol): shorten while the 256-slot line has room
        m = 0
        for s in range(n):
            if row[s] > 0:
                order[m] = s
                m += 1
        for i in range(1, m):
            j = i
            while j > 0 and row[order[j - 1]] < row[order[j]]:
                order[j - 1], order[j] = order[j], order[j - 1]
                j -= 1
        changed = True
        while changed:
            changed = False
            for i in range(m):
                s = order[i]
                ln = out[g, s]
                if ln > 1 and used + (1 << (MAX_LEN - ln)) <= SLOTS:
                    used += 1 << (MAX_LEN - ln)
                    out[g, s] = ln - 1
                    changed = True


def code_lengths(counts: npt.NDArray[np.integer]) -> npt.NDArray[np.uint8]:
    """PAC code lengths ``[streams, nsym]`` (1..8, or 9 = unencodable) from histograms."""
    if counts.ndim != 2:
        raise CacheGenError("code_lengths expects counts [streams, nsym]")
    if counts.shape[1] > SLOTS:
        raise CacheGenError(f"PAC codes at most {SLOTS} symbols, got {counts.shape[1]}")
    out = np.empty(counts.shape, dtype=np.uint8)
    _lengths(np.ascontiguousarray(counts, dtype=np.int32), out)
    return out


@njit(cache=True, nogil=True)
def _tables(
    lens: npt.NDArray[np.uint8],
    low: npt.NDArray[np.int64],
    dsym: npt.NDArray[np.uint8],
    dlen: npt.NDArray[np.uint8],
) -> int:
    nstreams, n = lens.shape
    for g in range(nstreams):
        pos = 0
        for ln in range(1, MAX_LEN + 1):
            size = 1 << (MAX_LEN - ln)
            for s in range(n):
                if lens[g, s] == ln:
                    if pos + size > SLOTS:
                        return g  # Kraft sum > 1
                    low[g, s] = pos
                    for j in range(pos, pos + size):
                        dsym[g, j] = s
                        dlen[g, j] = ln
                    pos += size
    return -1


def code_tables(
    lens: npt.NDArray[np.uint8],
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.uint8], npt.NDArray[np.uint8]]:
    """Canonical codes from lengths: ``(low [streams, nsym], dec_sym, dec_len [streams, 256])``.

    ``low[g, s]`` is the symbol's interval start on the 256-slot line (-1 if unencodable);
    ``dec_len == 0`` marks a slot no code owns. Raises if lengths are invalid or overfull.
    """
    if lens.ndim != 2 or lens.shape[1] > SLOTS:
        raise CacheGenError("PAC lengths must be [streams, nsym <= 256]")
    bad = (lens == 0) | (lens > UNENCODABLE)
    if bool(bad.any()):
        raise CacheGenError("PAC code lengths must be 1..8 or 9 (unencodable)")
    low = np.full(lens.shape, -1, dtype=np.int64)
    dsym = np.zeros((lens.shape[0], SLOTS), dtype=np.uint8)
    dlen = np.zeros((lens.shape[0], SLOTS), dtype=np.uint8)
    g = _tables(np.ascontiguousarray(lens), low, dsym, dlen)
    if g >= 0:
        raise CacheGenError(
            f"PAC code lengths of stream {g} overfill the 256-slot line (Kraft > 1)"
        )
    return low, dsym, dlen


@njit(cache=True, nogil=True)
def _encode(
    sym: npt.NDArray[np.uint8],
    lens: npt.NDArray[np.uint8],
    low: npt.NDArray[np.int64],
    sub: int,
    out: npt.NDArray[np.uint8],
    lengths: npt.NDArray[np.int64],
) -> int:
    nl, ntok, nc = sym.shape
    nstreams = nl * nc
    nsub = lengths.shape[0]
    pos = 0
    for k in range(nsub):
        t0 = k * sub
        t1 = min(ntok, t0 + sub)
        for g in range(nstreams):
            gl = g // nc
            gc = g - gl * nc
            start = pos
            acc = 0
            nacc = 0
            for t in range(t0, t1):
                s = sym[gl, t, gc]
                ln = int(lens[g, s])
                if ln > MAX_LEN:
                    return -1 - g
                acc = (acc << ln) | (low[g, s] >> (MAX_LEN - ln))
                nacc += ln
                if nacc >= 8:
                    nacc -= 8
                    out[pos] = (acc >> nacc) & 0xFF
                    pos += 1
                    acc &= (1 << nacc) - 1
            if nacc > 0:
                out[pos] = (acc << (8 - nacc)) & 0xFF
                pos += 1
            lengths[k, g] = pos - start
    return pos


@njit(cache=True, nogil=True)
def _decode(
    payload: npt.NDArray[np.uint8],
    offsets: npt.NDArray[np.int64],
    dsym: npt.NDArray[np.uint8],
    dlen: npt.NDArray[np.uint8],
    sub: int,
    out: npt.NDArray[np.uint8],
) -> int:
    nl, ntok, nc = out.shape
    nstreams = nl * nc
    nsub = (ntok + sub - 1) // sub
    for k in range(nsub):
        t0 = k * sub
        t1 = min(ntok, t0 + sub)
        for g in range(nstreams):
            gl = g // nc
            gc = g - gl * nc
            p = offsets[k * nstreams + g]
            end = offsets[k * nstreams + g + 1]
            first = p
            srow = dsym[g]
            lrow = dlen[g]
            buf = 0
            nbuf = 0
            for t in range(t0, t1):
                while nbuf < 8:
                    b = int(payload[p]) if p < end else 0
                    p += 1
                    buf = ((buf << 8) | b) & 0xFFFFFFFFFFFF
                    nbuf += 8
                idx = (buf >> (nbuf - 8)) & 0xFF
                ln = int(lrow[idx])
                if ln == 0:
                    return k * nstreams + g
                out[gl, t, gc] = srow[idx]
                nbuf -= ln
            used = (p - first) * 8 - nbuf
            if (used + 7) // 8 != end - first:
                return k * nstreams + g
    return -1


def encode_streams(
    sym: npt.NDArray[np.uint8], lens: npt.NDArray[np.uint8], sub: int = 256
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64]]:
    """PAC-code ``sym`` (``[streams, tokens]`` or ``[layers, tokens, channels]``) with code
    lengths ``[streams, nsym]``; returns ``(payload, lengths [subchunks, streams])``."""
    sym3 = np.ascontiguousarray(as_streams(sym))
    nl, ntok, nc = sym3.shape
    if lens.ndim != 2 or lens.shape[0] != nl * nc:
        raise CacheGenError(f"PAC lengths must be [{nl * nc}, nsym], got {lens.shape}")
    if sub < 1:
        raise CacheGenError(f"sub-chunk size must be >= 1, got {sub}")
    if sym3.size and int(sym3.max()) >= lens.shape[1]:
        raise CacheGenError(f"symbol {int(sym3.max())} >= nsym {lens.shape[1]}")
    low, _, _ = code_tables(lens)
    nsub = (ntok + sub - 1) // sub
    out = np.empty(max(1, ntok) * nl * nc + nsub * nl * nc, dtype=np.uint8)
    lengths = np.zeros((nsub, nl * nc), dtype=np.int64)
    n = _encode(sym3, np.ascontiguousarray(lens), low, sub, out, lengths)
    if n < 0:
        raise CacheGenError(f"stream {-1 - n} holds a symbol its PAC code cannot encode")
    return out[:n].copy(), lengths


def decode_streams(
    payload: npt.NDArray[np.uint8],
    lengths: npt.NDArray[np.integer],
    lens: npt.NDArray[np.uint8],
    ntokens: int,
    sub: int = 256,
    channels: int | None = None,
) -> npt.NDArray[np.uint8]:
    """Inverse of :func:`encode_streams`; raises :class:`CacheGenError` on a corrupt stream.

    Returns ``[streams, ntokens]``, or ``[layers, ntokens, channels]`` when ``channels`` is given.
    """
    _, dsym, dlen = code_tables(lens)
    nstreams = lens.shape[0]
    nc = 1 if channels is None else channels
    if nc < 1 or nstreams % nc:
        raise CacheGenError(f"{nstreams} streams do not split into {nc} channels")
    nsub = (ntokens + sub - 1) // sub
    offsets = stream_offsets(lengths, nsub, nstreams, payload.shape[0])
    out = np.empty((nstreams // nc, ntokens, nc), dtype=np.uint8)
    bad = _decode(payload, offsets, dsym, dlen, sub, out)
    if bad >= 0:
        raise CacheGenError(
            f"PAC stream {bad % nstreams} of sub-chunk {bad // nstreams} is corrupt"
        )
    return out[:, :, 0] if channels is None else out
