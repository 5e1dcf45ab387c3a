"""The CacheGen container: an explicit, versioned binary layout, safe to parse from anywhere.

Why this module exists: LMCache ships CacheGen output as ``pickle.dumps`` of CUDA tensors,
which needs a GPU to load and runs arbitrary code on untrusted bytes. This layout is plain
data, little-endian, every size bounded and checked before anything is allocated, and every
failure is a :class:`CacheGenError`.

Layout (version 1)::

    offset  size  field
    0       4     magic b"KVCG"
    4       2     version (1)
    6       1     coder: 1 = arithmetic coding (LMCache-compatible), 2 = PAC
    7       1     dtype: 1 = float16, 2 = bfloat16, 3 = float32
    8       4     num_layers L             (1 .. 4096)
    12      4     num_tokens T             (1 .. 65535)
    16      4     channels C = heads*dim   (1 .. 65536; 2*L*C <= 2^21)
    20      2     sub-chunk tokens         (1 .. 4096; LMCache uses 256)
    22      1     Lp = max(bins) + 1       (CDF entries)
    23      1     reserved, 0
    24      4     meta_raw_len             (must equal the size the header implies, <= 256 MiB)
    28      4     meta_zlen                (zlib-compressed metadata)
    32      8     payload_len
    40      2L    bins per layer, u8: K layers 0..L-1 then V layers 0..L-1
    ..      meta_zlen   zlib(meta)
    ..      payload_len entropy-coded streams, sub-chunk major, then layer, then channel
    end-4   4     crc32 of every byte before it

``meta`` (before zlib) is: the per-(layer, token) scales ``[2, L, T]`` in the KV dtype; the
model per layer ``j`` of ``2L`` and channel, ``levels_j = 2*(bins_j//2 - 1) + 1`` entries
(AC: symbol histograms as u16 — the decoder rebuilds LMCache's CDF from them; PAC: code
lengths as u8, 9 = unencodable); then the stream byte lengths ``[subchunks, 2L, C]`` as u16.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvpool.kernels.cachegen.errors import CacheGenError
from kvpool.kernels.cachegen.quant import MAX_BINS, MIN_BINS

MAGIC = b"KVCG"
VERSION = 1
CODERS = {"ac": 1, "pac": 2}
DTYPES = {"float16": (1, 2), "bfloat16": (2, 2), "float32": (3, 4)}
MAX_LAYERS = 4096
MAX_TOKENS = 65535
MAX_CHANNELS = 65536
MAX_SUBCHUNK = 4096
MAX_STREAMS = 1 << 21  # 2 * layers * channels; Llama-3.1-405B has 516K
MAX_META = 256 << 20
ZLIB_MAX_RATIO = 1100  # deflate cannot expand more than ~1032:1
DEFAULT_MAX_ELEMENTS = 1 << 30
_FIXED = struct.Struct("<4sHBBIIIHBBIIQ")
_CRC = 4


@dataclass(frozen=True)
class Header:
    """The container's fixed fields, validated."""

    coder: str
    dtype: str
    num_layers: int
    num_tokens: int
    channels: int
    subchunk: int
    lp: int
    bins: tuple[int, ...]
    meta_raw_len: int
    meta_zlen: int
    payload_len: int

    @property
    def nsub(self) -> int:
        return (self.num_tokens + self.subchunk - 1) // self.subchunk

    @property
    def levels(self) -> list[int]:
        return [2 * (b // 2 - 1) + 1 for b in self.bins]

    @property
    def header_len(self) -> int:
        return _FIXED.size + 2 * self.num_layers

    @property
    def total_len(self) -> int:
        return self.header_len + self.meta_zlen + self.payload_len + _CRC

    def meta_layout(self) -> tuple[int, int, int]:
        """Byte sizes of (scales, model tables, stream lengths) in the raw metadata."""
        esize = DTYPES[self.dtype][1]
        scales = 2 * self.num_layers * self.num_tokens * esize
        per_level = 2 if self.coder == "ac" else 1
        tables = sum(self.levels) * self.channels * per_level
        lengths = self.nsub * 2 * self.num_layers * self.channels * 2
        return scales, tables, lengths


@dataclass(frozen=True)
class Parts:
    """A parsed container: the header and its sections as numpy arrays."""

    header: Header
    scales: npt.NDArray[np.uint8]  # raw KV-dtype bytes, [2, L, T] elements
    tables: list[npt.NDArray[np.integer]]  # per layer of 2L: [C, levels_j]
    lengths: npt.NDArray[np.uint16]  # [subchunks, 2L * C]
    payload: npt.NDArray[np.uint8]


def _name(table: dict[str, tuple[int, int]] | dict[str, int], code: int, what: str) -> str:
    for k, v in table.items():
        if (v[0] if isinstance(v, tuple) else v) == code:
            return k
    raise CacheGenError(f"unknown {what} id {code} in the container header")


def check_shape(num_layers: int, num_tokens: int, channels: int, max_elements: int) -> None:
    """Bounds shared by the encoder and the parser."""
    if not 1 <= num_layers <= MAX_LAYERS:
        raise CacheGenError(f"num_layers {num_layers} out of range [1, {MAX_LAYERS}]")
    if not 1 <= num_tokens <= MAX_TOKENS:
        raise CacheGenError(
            f"num_tokens {num_tokens} out of range [1, {MAX_TOKENS}]: split the chunk"
        )
    if not 1 <= channels <= MAX_CHANNELS:
        raise CacheGenError(f"channels {channels} out of range [1, {MAX_CHANNELS}]")
    if 2 * num_layers * channels > MAX_STREAMS:
        raise CacheGenError(
            f"2 x {num_layers} layers x {channels} channels exceeds {MAX_STREAMS} streams"
        )
    if 2 * num_layers * num_tokens * channels > max_elements:
        raise CacheGenError(
            f"KV of 2x{num_layers}x{num_tokens}x{channels} exceeds max_elements={max_elements}"
        )


def pack(
    header: Header,
    scales: bytes,
    tables: list[npt.NDArray[np.integer]],
    lengths: npt.NDArray[np.integer],
    payload: npt.NDArray[np.uint8],
) -> bytes:
    """Serialise one encoded chunk (the encoder has already validated its inputs)."""
    if lengths.size and int(lengths.max()) > 0xFFFF:
        raise CacheGenError("a stream exceeds 65535 bytes: use a smaller sub-chunk")
    ttype = np.dtype("<u2") if header.coder == "ac" else np.dtype("u1")
    raw = b"".join(
        [
            scales,
            *(np.ascontiguousarray(t, dtype=ttype).tobytes() for t in tables),
            np.ascontiguousarray(lengths, dtype="<u2").tobytes(),
        ]
    )
    if len(raw) != sum(header.meta_layout()):
        raise CacheGenError("internal error: metadata size does not match the header")
    if len(raw) > MAX_META:
        raise CacheGenError(f"metadata of {len(raw)} bytes exceeds {MAX_META}: split the chunk")
    meta = zlib.compress(raw, 6)
    fixed = _FIXED.pack(
        MAGIC,
        VERSION,
        CODERS[header.coder],
        DTYPES[header.dtype][0],
        header.num_layers,
        header.num_tokens,
        header.channels,
        header.subchunk,
        header.lp,
        0,
        len(raw),
        len(meta),
        payload.shape[0],
    )
    body = b"".join([fixed, bytes(header.bins), meta, payload.tobytes()])
    return body + struct.pack("<I", zlib.crc32(body))


def parse_header(
    data: bytes | bytearray | memoryview, max_elements: int = DEFAULT_MAX_ELEMENTS
) -> Header:
    """Validate and return the header; checks sizes against ``len(data)``, not the checksum."""
    buf = memoryview(data)
    if len(buf) < _FIXED.size + _CRC:
        raise CacheGenError(f"container too short: {len(buf)} bytes")
    (magic, version, coder, dtype, nl, nt, nc, sub, lp, reserved, raw_len, zlen, plen) = (
        _FIXED.unpack_from(buf, 0)
    )
    if magic != MAGIC:
        raise CacheGenError("not a CacheGen container (bad magic)")
    if version != VERSION:
        raise CacheGenError(f"container version {version} is not supported (this reads {VERSION})")
    if reserved != 0:
        raise CacheGenError("reserved header byte is not 0")
    check_shape(nl, nt, nc, max_elements)
    if not 1 <= sub <= MAX_SUBCHUNK:
        raise CacheGenError(f"sub-chunk {sub} out of range [1, {MAX_SUBCHUNK}]")
    if len(buf) < _FIXED.size + 2 * nl + _CRC:
        raise CacheGenError("container truncated inside the bin table")
    bins = tuple(buf[_FIXED.size : _FIXED.size + 2 * nl])
    if any(not MIN_BINS <= b <= MAX_BINS for b in bins):
        raise CacheGenError(f"bin counts must be in [{MIN_BINS}, {MAX_BINS}]")
    if lp != max(bins) + 1:
        raise CacheGenError(f"Lp {lp} != max(bins) + 1 = {max(bins) + 1}")
    header = Header(
        coder=_name(CODERS, coder, "coder"),
        dtype=_name(DTYPES, dtype, "dtype"),
        num_layers=nl,
        num_tokens=nt,
        channels=nc,
        subchunk=sub,
        lp=lp,
        bins=bins,
        meta_raw_len=raw_len,
        meta_zlen=zlen,
        payload_len=plen,
    )
    if raw_len > MAX_META or raw_len > ZLIB_MAX_RATIO * zlen + 1024:
        raise CacheGenError(f"metadata of {raw_len} bytes from {zlen} compressed is implausible")
    if raw_len != sum(header.meta_layout()):
        raise CacheGenError(
            f"metadata length {raw_len} != {sum(header.meta_layout())} implied by the header"
        )
    if header.total_len != len(buf):
        raise CacheGenError(
            f"container is {len(buf)} bytes but its header describes {header.total_len}"
        )
    return header


def parse(data: bytes | bytearray | memoryview, max_elements: int = DEFAULT_MAX_ELEMENTS) -> Parts:
    """Validate the whole container (sizes, checksum, metadata) and split it into sections."""
    header = parse_header(data, max_elements)
    buf = memoryview(data)
    body_len = len(buf) - _CRC
    (crc,) = struct.unpack_from("<I", buf, body_len)
    if zlib.crc32(buf[:body_len]) != crc:
        raise CacheGenError("checksum mismatch: the container is corrupt")
    mstart = header.header_len
    dec = zlib.decompressobj()
    try:
        raw = dec.decompress(buf[mstart : mstart + header.meta_zlen], header.meta_raw_len + 1)
    except zlib.error as exc:
        raise CacheGenError(f"metadata does not decompress: {exc}") from None
    if len(raw) != header.meta_raw_len or not dec.eof or dec.unused_data:
        raise CacheGenError("metadata section has the wrong size")
    n_scales, _, _ = header.meta_layout()
    arr = np.frombuffer(raw, dtype=np.uint8)
    scales = arr[:n_scales]
    pos = n_scales
    tables: list[npt.NDArray[np.integer]] = []
    ttype = np.dtype("<u2") if header.coder == "ac" else np.dtype("u1")
    for lev in header.levels:
        n = lev * header.channels * ttype.itemsize
        tables.append(arr[pos : pos + n].view(ttype).reshape(header.channels, lev))
        pos += n
    lengths = arr[pos:].view("<u2").reshape(header.nsub, 2 * header.num_layers * header.channels)
    pstart = mstart + header.meta_zlen
    payload = np.frombuffer(buf[pstart : pstart + header.payload_len], dtype=np.uint8)
    return Parts(header, scales, tables, lengths, payload)
