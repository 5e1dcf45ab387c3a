"""Fuzzing the CacheGen container parser: mutated and truncated containers never crash or hang.

Two kinds of damage: raw (the checksum catches it, so this covers the framing), and damage
followed by a recomputed checksum, which drives the bytes past the checksum into the header,
metadata and stream validation, and into the numba decoders. Every outcome must be either a
tensor of the declared shape or a :class:`CacheGenError`. The example count is bounded.
"""

from __future__ import annotations

import struct
import zlib
from functools import cache

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.kernels.cachegen import CacheGenError, decode, encode

_SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


@cache
def _blobs() -> tuple[bytes, ...]:
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 2, 40, 16, generator=g).to(torch.float16)
    kv[1, 0, 3] = 0.0
    return (
        encode(kv, coder="ac", subchunk=16),
        encode(kv, coder="pac", subchunk=16),
        encode(kv.to(torch.float32), coder="ac", key_bins=[8, 64], value_bins=[16, 4]),
    )


def _check(data: bytes) -> None:
    try:
        out = decode(data, max_elements=1 << 22)
    except CacheGenError:
        return
    assert out.dim() == 4 and out.shape[0] == 2
    assert bool(torch.isfinite(out.float()).all())


def _recrc(data: bytes) -> bytes:
    body = data[:-4] if len(data) >= 4 else data
    return body + struct.pack("<I", zlib.crc32(body))


_edit = st.tuples(st.integers(min_value=0, max_value=10**6), st.integers(0, 255))


@_SETTINGS
@given(which=st.integers(0, 2), edits=st.lists(_edit, min_size=1, max_size=6), fix=st.booleans())
def test_mutated_containers(which: int, edits: list[tuple[int, int]], fix: bool) -> None:
    data = bytearray(_blobs()[which])
    for pos, val in edits:
        data[pos % len(data)] = val
    _check(_recrc(bytes(data)) if fix else bytes(data))


@_SETTINGS
@given(which=st.integers(0, 2), cut=st.integers(min_value=0, max_value=10**6), fix=st.booleans())
def test_truncated_containers(which: int, cut: int, fix: bool) -> None:
    data = _blobs()[which]
    short = data[: cut % len(data)]
    _check(_recrc(short) if fix else short)


@_SETTINGS
@given(
    which=st.integers(0, 2),
    field=st.sampled_from([8, 12, 16, 20, 22, 24, 28, 32, 40]),
    val=st.integers(0, 2**32 - 1),
)
def test_header_fields(which: int, field: int, val: int) -> None:
    data = bytearray(_blobs()[which])
    width = {20: 2, 22: 1, 32: 8, 40: 1}.get(field, 4)
    data[field : field + width] = (val % (1 << (8 * width))).to_bytes(width, "little")
    _check(_recrc(bytes(data)))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    layers=st.integers(1, 3),
    tokens=st.integers(1, 40),
    channels=st.integers(1, 9),
    bins=st.lists(st.integers(4, 64), min_size=6, max_size=6),
    coder=st.sampled_from(["ac", "pac"]),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
    subchunk=st.integers(1, 300),
    seed=st.integers(0, 2**16),
)
def test_roundtrip_any_shape(
    layers: int,
    tokens: int,
    channels: int,
    bins: list[int],
    coder: str,
    dtype: torch.dtype,
    subchunk: int,
    seed: int,
) -> None:
    """Round trip within the quantizer's bound for arbitrary small shapes and parameters."""
    g = torch.Generator().manual_seed(seed)
    kv = (torch.randn(2, layers, tokens, channels, generator=g) * 3).to(dtype)
    kb, vb = bins[:layers], bins[3 : 3 + layers]
    blob = encode(kv, coder=coder, key_bins=kb, value_bins=vb, subchunk=subchunk)  # type: ignore[arg-type]
    out = decode(blob)
    assert out.shape == kv.shape and out.dtype == kv.dtype
    half = torch.tensor([b // 2 - 1 for b in kb + vb], dtype=torch.float32)
    xf = kv.float()
    scale = xf.abs().amax(dim=-1, keepdim=True)
    bound = scale / (2 * half.view(2, layers, 1, 1)) + 2.0**-7 * (xf.abs() + scale) + 1e-6
    assert bool(((xf - out.float()).abs() <= bound).all())


def test_metadata_recompressed_with_garbage() -> None:
    """Valid framing and zlib, nonsense tables: histograms that do not add up, bad lengths."""
    for blob in _blobs():
        nl = struct.unpack_from("<I", blob, 8)[0]
        (zlen,) = struct.unpack_from("<I", blob, 28)
        start = 40 + 2 * nl
        raw = bytearray(zlib.decompress(blob[start : start + zlen]))
        for i in range(0, len(raw), 7):
            raw[i] ^= 0x5A
        meta = zlib.compress(bytes(raw))
        head = bytearray(blob[:start])
        struct.pack_into("<I", head, 28, len(meta))
        _check(_recrc(bytes(head) + meta + blob[start + zlen :]))
