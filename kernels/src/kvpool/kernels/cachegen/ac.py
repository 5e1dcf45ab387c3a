"""CacheGen's arithmetic coder, bit-compatible with LMCache's ``encode_fast_new``/``decode``.

Why this module exists: LMCache codes every (layer, channel) of a KV chunk as its own
bitstream with a 32-bit integer arithmetic coder (Mark Nelson's design, ported from torchac),
16-bit CDFs and sub-chunks of at most 256 tokens that share one CDF. This is the same coder
on the CPU, compiled with numba and run over all streams in one call (no per-symbol Python),
with output buffers sized for the worst case (LMCache's fixed 256-byte buffer silently
truncates) and a decoder that never reads outside its stream.

Encoder state ``low = 0, high = 0xFFFFFFFF``; per symbol ``s`` with ``span = high-low+1``:
``high = low - 1 + (span*c_high >> 16)``, ``low = low + (span*c_low >> 16)`` (mod 2^32),
``c_high = 0x10000`` for the last symbol ``Lp-2``; renormalise with E1/E2 (emit a bit plus
pending bits) and E3 (count a pending bit); terminate with ``pending += 1`` and one bit
(0 if ``low < 2^30``); bits MSB-first, zero-padded to a byte. The decoder starts from the first
four bytes big-endian, reads bytes past the end of its stream as zeros and stops after the
last symbol.

Layout used by both functions: ``sym [streams, tokens]`` (stream = layer * channels +
channel), ``cdf [streams, Lp]``, and a payload made of sub-chunk 0's streams in order, then
sub-chunk 1's, and so on; ``lengths [subchunks, streams]`` in bytes.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from numba import njit
from numba.cpython.unsafe.numbers import leading_zeros

from kvpool.kernels.cachegen.errors import CacheGenError

_M32 = 0xFFFFFFFF
_HALF = 0x80000000
_QTR = 0x40000000
_3QTR = 0xC0000000


def worst_case_bytes(ntokens: int) -> int:
    """Upper bound of one stream's size: < 16.01 bits per symbol, termination and padding."""
    return (ntokens * 17 + 40) // 8 + 2


def padded_cdf(cdf: npt.NDArray[np.integer]) -> tuple[npt.NDArray[np.int64], int]:
    """``cdf [streams, Lp]`` padded to ``P + 1`` columns (``P`` a power of two >= Lp - 1).

    Columns from ``Lp - 1`` on hold ``0x10000``: the search below then never returns a symbol
    past ``Lp - 2`` and ``row[s + 1]`` is LMCache's ``c_high`` for every ``s``.
    """
    nsym = cdf.shape[1] - 1
    steps = max(1, (nsym - 1).bit_length())
    out = np.full((cdf.shape[0], (1 << steps) + 1), 0x10000, dtype=np.int64)
    out[:, :nsym] = cdf[:, :nsym]
    return out, steps


@njit(cache=True, nogil=True, inline="always")
def _put(
    out: npt.NDArray[np.uint8], pos: int, acc: int, nacc: int, v: int, n: int
) -> tuple[int, int, int]:
    acc = (acc << n) | v
    nacc += n
    while nacc >= 8:
        nacc -= 8
        out[pos] = (acc >> nacc) & 0xFF
        pos += 1
    acc &= (1 << nacc) - 1
    return pos, acc, nacc


@njit(cache=True, nogil=True, inline="always")
def _get(
    data: npt.NDArray[np.uint8], p: int, end: int, buf: int, nbuf: int, n: int
) -> tuple[int, int, int, int]:
    while nbuf < n:
        b = int(data[p]) if p < end else 0
        p += 1
        buf = (buf << 8) | b
        nbuf += 8
    nbuf -= n
    v = (buf >> nbuf) & ((1 << n) - 1)
    buf &= (1 << nbuf) - 1
    return v, p, buf, nbuf


@njit(cache=True, nogil=True, inline="always")
def _clz32(x: int) -> int:
    if x == 0:
        return 32
    return int(leading_zeros(np.uint64(x))) - 32  # type: ignore[call-arg]


@njit(cache=True, nogil=True)
def _encode(
    sym: npt.NDArray[np.uint8],
    cdf: npt.NDArray[np.int64],
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
            row = cdf[g]
            low = 0
            high = int(_M32)
            pending = 0
            acc = 0
            nacc = 0
            for t in range(t0, t1):
                s = int(sym[gl, t, gc])
                span = high - low + 1
                high = (low + ((span * row[s + 1]) >> 16) - 1) & _M32
                low = (low + ((span * row[s]) >> 16)) & _M32
                x = low ^ high
                if x < _HALF:  # E1/E2: the top nb bits of low and high agree
                    nb = _clz32(x)
                    bits = low >> (32 - nb)
                    b0 = bits >> (nb - 1)
                    pos, acc, nacc = _put(out, pos, acc, nacc, b0, 1)
                    while pending > 0:
                        n = min(pending, 32)
                        pos, acc, nacc = _put(out, pos, acc, nacc, (1 - b0) * ((1 << n) - 1), n)
                        pending -= n
                    if nb > 1:
                        pos, acc, nacc = _put(
                            out, pos, acc, nacc, bits & ((1 << (nb - 1)) - 1), nb - 1
                        )
                    low = (low << nb) & _M32
                    high = ((high << nb) | ((1 << nb) - 1)) & _M32
                # E3: low = 01..., high = 10... for the next m bit positions
                m = _clz32(~((low & ~high) << 1) & _M32)
                if m > 0:
                    pending += m
                    fm = ((1 << m) - 1) << (31 - m)
                    low = ((low ^ fm) << m) & _M32
                    high = (((high ^ fm) << m) | ((1 << m) - 1)) & _M32
            pending += 1
            b0 = 0 if low < _QTR else 1
            pos, acc, nacc = _put(out, pos, acc, nacc, b0, 1)
            while pending > 0:
                n = min(pending, 32)
                pos, acc, nacc = _put(out, pos, acc, nacc, (1 - b0) * ((1 << n) - 1), n)
                pending -= n
            if nacc > 0:
                pos, acc, nacc = _put(out, pos, acc, nacc, 0, 8 - nacc)
            lengths[k, g] = pos - start
    return pos


@njit(cache=True, nogil=True)
def _decode(
    payload: npt.NDArray[np.uint8],
    offsets: npt.NDArray[np.int64],
    cdf: npt.NDArray[np.int64],
    steps: int,
    sub: int,
    out: npt.NDArray[np.uint8],
) -> None:
    nl, ntok, nc = out.shape
    nstreams = nl * nc
    nsub = (ntok + sub - 1) // sub
    top = 1 << (steps - 1)
    for k in range(nsub):
        t0 = k * sub
        t1 = min(ntok, t0 + sub)
        for g in range(nstreams):
            gl = g // nc
            gc = g - gl * nc
            p = offsets[k * nstreams + g]
            end = offsets[k * nstreams + g + 1]
            row = cdf[g]
            buf = 0
            nbuf = 0
            value, p, buf, nbuf = _get(payload, p, end, buf, nbuf, 32)
            low = 0
            high = int(_M32)
            for t in range(t0, t1):
                span = high - low + 1
                count = ((((value - low) & _M32) + 1) * 0x10000 - 1) // span
                s = 0
                step = top
                while step > 0:  # largest s with row[s] <= count, no branch
                    s += step & -int(row[s + step] <= count)
                    step >>= 1
                out[gl, t, gc] = s
                if t == t1 - 1:
                    break
                high = (low + ((span * row[s + 1]) >> 16) - 1) & _M32
                low = (low + ((span * row[s]) >> 16)) & _M32
                # E1/E2 (nb bits) then E3 (m bits) without branches: a shift by 0 changes
                # nothing. The interval keeps span >= 2^30 after renormalisation and every
                # symbol has a CDF width >= 1, so nb + m <= 18 on any valid stream; the clamp
                # only bounds the bit buffer on a corrupt one (whose output means nothing).
                nb = _clz32(low ^ high)
                m = _clz32(~(((low << nb) & ~((high << nb) | ((1 << nb) - 1))) << 1) & _M32)
                m = min(m, 48 - nb)
                n = nb + m
                if nbuf < n:
                    while nbuf <= 56 - 8:
                        b = int(payload[p]) if p < end else 0
                        p += 1
                        buf = (buf << 8) | b
                        nbuf += 8
                nbuf -= n
                v = buf >> nbuf
                buf &= (1 << nbuf) - 1
                fm = ((1 << m) - 1) << (31 - m)
                ones = (1 << m) - 1
                low = ((((low << nb) & _M32) ^ fm) << m) & _M32
                high = ((high << nb) | ((1 << nb) - 1)) & _M32
                high = (((high ^ fm) << m) | ones) & _M32
                value = ((value << nb) | (v >> m)) & _M32
                value = (((value ^ fm) << m) | (v & ones)) & _M32


def as_streams(sym: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    """View ``[streams, tokens]`` as ``[streams, tokens, 1]``; pass 3-D arrays through."""
    if sym.ndim == 2:
        return sym[:, :, None]
    if sym.ndim != 3:
        raise CacheGenError("symbols must be [streams, tokens] or [layers, tokens, channels]")
    return sym


def stream_offsets(
    lengths: npt.NDArray[np.integer], nsub: int, nstreams: int, nbytes: int
) -> npt.NDArray[np.int64]:
    """Start offsets (plus the end) of every stream; raises unless they tile the payload."""
    if lengths.shape != (nsub, nstreams):
        raise CacheGenError(
            f"stream lengths have shape {lengths.shape}, expected ({nsub}, {nstreams})"
        )
    if lengths.size and int(lengths.min()) < 0:
        raise CacheGenError("stream lengths must be >= 0")
    offsets = np.zeros(nsub * nstreams + 1, dtype=np.int64)
    np.cumsum(lengths.reshape(-1), out=offsets[1:])
    if int(offsets[-1]) != nbytes:
        raise CacheGenError(
            f"stream lengths add up to {int(offsets[-1])} bytes, payload has {nbytes}"
        )
    return offsets


def encode_streams(
    sym: npt.NDArray[np.uint8], cdf: npt.NDArray[np.integer], sub: int = 256
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64]]:
    """Arithmetic-code ``sym`` (``[streams, tokens]`` or ``[layers, tokens, channels]``).

    ``cdf [streams, Lp]`` (stream = layer * channels + channel). Returns ``(payload uint8,
    lengths int64 [subchunks, streams])``. Symbols must be ``<= Lp - 2`` and every CDF row
    valid (see :func:`cdf.check_cdf`).
    """
    sym3 = np.ascontiguousarray(as_streams(sym))
    nl, ntok, nc = sym3.shape
    if cdf.ndim != 2 or cdf.shape[0] != nl * nc:
        raise CacheGenError(f"cdf must be [{nl * nc}, Lp], got {cdf.shape}")
    if sub < 1:
        raise CacheGenError(f"sub-chunk size must be >= 1, got {sub}")
    if sym3.size and int(sym3.max()) > cdf.shape[1] - 2:
        raise CacheGenError(f"symbol {int(sym3.max())} has no CDF entry (Lp = {cdf.shape[1]})")
    nsub = (ntok + sub - 1) // sub
    out = np.empty(nsub * nl * nc * worst_case_bytes(min(sub, max(ntok, 1))), dtype=np.uint8)
    lengths = np.zeros((nsub, nl * nc), dtype=np.int64)
    table, _ = padded_cdf(cdf)
    n = _encode(sym3, table, sub, out, lengths)
    return out[:n].copy(), lengths


def decode_streams(
    payload: npt.NDArray[np.uint8],
    lengths: npt.NDArray[np.integer],
    cdf: npt.NDArray[np.integer],
    ntokens: int,
    sub: int = 256,
    channels: int | None = None,
) -> npt.NDArray[np.uint8]:
    """Inverse of :func:`encode_streams`.

    Returns ``[streams, ntokens]``, or ``[layers, ntokens, channels]`` when ``channels`` is given.
    The decoder never reads outside a stream (bytes past its end read as zeros, as in
    LMCache), and always stops after ``ntokens`` symbols.
    """
    nstreams = cdf.shape[0]
    nc = 1 if channels is None else channels
    if nc < 1 or nstreams % nc:
        raise CacheGenError(f"{nstreams} streams do not split into {nc} channels")
    nsub = (ntokens + sub - 1) // sub
    offsets = stream_offsets(lengths, nsub, nstreams, payload.shape[0])
    out = np.empty((nstreams // nc, ntokens, nc), dtype=np.uint8)
    table, steps = padded_cdf(cdf)
    _decode(payload, offsets, table, steps, sub, out)
    return out[:, :, 0] if channels is None else out
