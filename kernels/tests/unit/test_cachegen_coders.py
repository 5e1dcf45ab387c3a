"""Properties of the CacheGen CDF, the arithmetic coder and PAC (reference notes §6.2, §6.3).

Bit-compatibility is checked against LMCache 0.5.6's own CPU implementation (its numba
``encode_fast_new`` / ``decode_fast_prefsum`` / ``calculate_cdf`` torch fallbacks, which
mirror the CUDA kernels), in both directions.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt
import pytest
import torch

from kvpool.kernels.cachegen import ac, pac
from kvpool.kernels.cachegen.cdf import cdf_from_counts, check_cdf, count_symbols

LP = 33


def _laplace(
    rng: np.random.Generator, shape: tuple[int, ...], top: int = 30
) -> npt.NDArray[np.uint8]:
    v = np.round(rng.laplace(top / 2, 2.0, size=shape))
    return np.clip(v, 0, top).astype(np.uint8)


def _model(sym3: npt.NDArray[np.uint8]) -> npt.NDArray[np.int32]:
    return cdf_from_counts(count_symbols(sym3, LP - 1), LP).reshape(-1, LP)


def test_cdf_validity_and_lmcache_equality() -> None:
    from lmcache.v1.platform.torch_ops.cachegen_kernels import calculate_cdf

    rng = np.random.default_rng(0)
    sym = _laplace(rng, (3, 200, 24))
    sym[1, :, 3] = 0
    sym[2, :, 4] = 30
    cdf = _model(sym)
    check_cdf(cdf)
    assert bool((cdf[:, 0] == 0).all()) and bool((cdf[:, -1] == 0xFFFF).all())
    assert int(np.diff(cdf, axis=1).min()) >= 1
    theirs = calculate_cdf(torch.from_numpy(sym.astype(np.int8)), LP - 1)
    assert np.array_equal(theirs.numpy().view(np.uint16).reshape(-1, LP), cdf)


def _cases(
    rng: np.random.Generator,
) -> list[tuple[str, npt.NDArray[np.uint8], npt.NDArray[np.uint8] | None]]:
    n_list = [1, 2, 7, 255, 256, 257, 1000]
    out: list[tuple[str, npt.NDArray[np.uint8], npt.NDArray[np.uint8] | None]] = []
    for n in n_list:
        out.append((f"uniform{n}", rng.integers(0, 31, size=(6, n), dtype=np.uint8), None))
        out.append((f"laplace{n}", _laplace(rng, (6, n)), None))
    out.append(("const0", np.zeros((2, 300), np.uint8), None))
    out.append(("const_top", np.full((2, 300), LP - 2, np.uint8), None))
    # symbols the CDF never saw (width 1 each) still code losslessly
    model = _laplace(rng, (4, 64))
    out.append(("unseen", rng.integers(0, LP - 1, size=(4, 300), dtype=np.uint8), model))
    return out


def test_ac_lossless_deterministic_and_near_entropy() -> None:
    rng = np.random.default_rng(1)
    for name, sym, model_src in _cases(rng):
        src = sym if model_src is None else model_src
        cdf = _model(src[:, :, None])
        payload, lengths = ac.encode_streams(sym, cdf)
        assert np.array_equal(ac.decode_streams(payload, lengths, cdf, sym.shape[1]), sym), name
        again, _ = ac.encode_streams(sym, cdf)
        assert np.array_equal(again, payload), name
        # size within the 16-bit model's ideal code length + termination and padding
        width = np.diff(np.concatenate([cdf, np.full((cdf.shape[0], 1), 0x10000)], 1), axis=1)
        for g in range(sym.shape[0]):
            for k in range(lengths.shape[0]):
                part = sym[g, k * 256 : (k + 1) * 256]
                ideal = float(-np.log2(width[g, part] / 65536.0).sum())
                assert 8 * lengths[k, g] <= ideal * 1.01 + 16, (name, g, k)


def test_ac_random_access_and_subchunk_invariance() -> None:
    rng = np.random.default_rng(2)
    sym = _laplace(rng, (5, 700, 8))
    cdf = _model(sym)
    payload, lengths = ac.encode_streams(sym, cdf)
    flat = np.ascontiguousarray(sym.transpose(0, 2, 1)).reshape(40, 700)
    offs = np.concatenate([[0], np.cumsum(lengths.reshape(-1))])
    g, k = 29, 1  # decode one stream of one sub-chunk on its own
    one = payload[offs[k * 40 + g] : offs[k * 40 + g + 1]]
    got = ac.decode_streams(one, np.array([[len(one)]]), cdf[g : g + 1], 256)
    assert np.array_equal(got[0], flat[g, 256:512])
    for sub in (1, 64, 700, 4096):
        p2, l2 = ac.encode_streams(sym, cdf, sub)
        assert np.array_equal(ac.decode_streams(p2, l2, cdf, 700, sub, channels=8), sym)


def test_ac_bytes_equal_lmcache_both_ways() -> None:
    from lmcache.v1.platform.torch_ops.cachegen_kernels import (
        decode_fast_prefsum,
        encode_fast_new,
    )

    rng = np.random.default_rng(3)
    sym = _laplace(rng, (4, 256, 16))
    sym[0, :, 0] = 0
    sym[3, :, 15] = LP - 2
    cdf = _model(sym)
    cdf16 = torch.from_numpy(cdf.astype(np.uint16).view(np.int16).reshape(4, 16, LP))
    buf = torch.zeros((4, 16, 256), dtype=torch.uint8)
    lens = torch.zeros((4, 16), dtype=torch.int32)
    encode_fast_new(cdf16, torch.from_numpy(sym.astype(np.int8)), buf, lens)
    payload, lengths = ac.encode_streams(sym, cdf)
    assert np.array_equal(lengths[0], lens.numpy().reshape(-1))
    theirs = np.concatenate(
        [buf.numpy().reshape(64, 256)[g, : lens.view(-1)[g]] for g in range(64)]
    )
    assert np.array_equal(payload, theirs)
    # LMCache decodes our bytes, and we decode LMCache's
    out = torch.zeros((4, 256, 16), dtype=torch.uint8)
    decode_fast_prefsum(
        cdf16, torch.from_numpy(payload), torch.from_numpy(np.cumsum(lengths[0])), out
    )
    assert np.array_equal(out.numpy(), sym)
    assert np.array_equal(ac.decode_streams(theirs, lengths, cdf, 256, channels=16), sym)


def test_ac_overflows_lmcache_buffer_but_not_ours() -> None:
    """A 4096-token CDF with rare symbols clustered in one sub-chunk: > 8 bits per symbol."""
    sym = np.full((1, 4096), 15, np.uint8)
    sym[0, :248] = np.repeat(np.arange(31, dtype=np.uint8), 8)
    cdf = _model(sym[:, :, None])
    payload, lengths = ac.encode_streams(sym, cdf)
    assert lengths[0, 0] > 256  # LMCache's fixed 256-byte stream buffer would truncate
    assert np.array_equal(ac.decode_streams(payload, lengths, cdf, 4096), sym)


def _pac_counts(rng: np.random.Generator, streams: int, tokens: int) -> npt.NDArray[np.int32]:
    sym = _laplace(rng, (streams, tokens))
    return count_symbols(sym[:, :, None], 31).reshape(streams, 31)


def test_pac_code_properties() -> None:
    rng = np.random.default_rng(4)
    counts = _pac_counts(rng, 64, 500)
    counts[0] = 0
    counts[0, 7] = 500  # a single seen symbol
    counts[1] = 1  # every symbol seen once
    counts[1, 0] = 470
    lens = pac.code_lengths(counts)
    low, _dsym, dlen = pac.code_tables(lens)
    seen = counts > 0
    assert bool((lens[seen] >= 1).all()) and bool((lens[seen] <= 8).all())
    assert bool((lens[~seen] == pac.UNENCODABLE).all())
    for g in range(counts.shape[0]):
        sizes = {s: 1 << (8 - int(lens[g, s])) for s in np.flatnonzero(seen[g])}
        assert sum(sizes.values()) <= 256  # Kraft
        slots = np.zeros(256, np.int64)
        for s, size in sizes.items():
            lo = int(low[g, s])
            assert lo % size == 0  # dyadic alignment
            slots[lo : lo + size] += 1
        assert int(slots.max()) <= 1  # disjoint intervals == prefix-free code
        if seen[g].sum() > 1:
            assert sum(sizes.values()) == 256  # the line is fully used
        assert bool((dlen[g][slots == 0] == 0).all())


def test_pac_lossless_ascend_parameters_and_padding_rule() -> None:
    rng = np.random.default_rng(5)
    for layers in (1, 4):
        for channels in (32, 128):
            for tokens in (20, 256, 1000):
                sym = _laplace(rng, (layers, tokens, channels))
                counts = count_symbols(sym, 31).reshape(-1, 31)
                lens = pac.code_lengths(counts)
                payload, lengths = pac.encode_streams(sym, lens)
                got = pac.decode_streams(payload, lengths, lens, tokens, channels=channels)
                assert np.array_equal(got, sym)
                # fixed code: a stream is exactly ceil(sum of code lengths / 8) bytes
                flat = np.ascontiguousarray(sym.transpose(0, 2, 1)).reshape(-1, tokens)
                g = rng.integers(0, flat.shape[0])
                bits = int(lens[g, flat[g, :256]].astype(np.int64).sum())
                assert lengths[0, g] == math.ceil(bits / 8)


def test_pac_bits_between_entropy_and_8() -> None:
    rng = np.random.default_rng(6)
    counts = _pac_counts(rng, 32, 2048)
    lens = pac.code_lengths(counts).astype(np.float64)
    p = counts / counts.sum(1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        entropy = -np.where(p > 0, p * np.log2(p), 0.0).sum(1)
    avg = np.where(counts > 0, p * lens, 0.0).sum(1)
    assert bool((avg >= entropy - 1e-9).all()) and bool((avg <= 8).all())


def test_pac_rejects_unencodable_and_corrupt() -> None:
    rng = np.random.default_rng(7)
    sym = _laplace(rng, (3, 300))
    lens = pac.code_lengths(count_symbols(sym[:, :, None], 31).reshape(3, 31))
    bad = sym.copy()
    bad[1, 5] = int(np.flatnonzero(lens[1] == pac.UNENCODABLE)[0])
    with pytest.raises(pac.CacheGenError, match="cannot encode"):
        pac.encode_streams(bad, lens)
    payload, lengths = pac.encode_streams(sym, lens)
    cut = lengths.copy()
    cut[0, 0] -= 1  # drop stream 0's last byte: it ends before its symbols do
    trimmed = np.delete(payload, int(lengths[0, 0]) - 1)
    with pytest.raises(pac.CacheGenError, match="corrupt"):
        pac.decode_streams(trimmed, cut, lens, 300)
    with pytest.raises(pac.CacheGenError, match="add up"):
        pac.decode_streams(payload[1:], lengths, lens, 300)
    single = np.full((1, 31), pac.UNENCODABLE, np.uint8)
    single[0, 4] = 1  # code "0" owns slots 0..127; a byte 0xFF lands on no code
    with pytest.raises(pac.CacheGenError, match="corrupt"):
        pac.decode_streams(np.full(2, 0xFF, np.uint8), np.array([[2]]), single, 10)
    overfull = np.full((1, 31), 1, np.uint8)
    with pytest.raises(pac.CacheGenError, match="Kraft"):
        pac.code_tables(overfull)


def test_pac_stream_is_the_concatenated_fixed_codes() -> None:
    """Pins the bit layout: codes MSB-first, back to back, zero-padded to a whole byte."""
    rng = np.random.default_rng(8)
    sym = _laplace(rng, (2, 37))
    lens = pac.code_lengths(count_symbols(sym[:, :, None], 31).reshape(2, 31))
    low, _, _ = pac.code_tables(lens)
    payload, lengths = pac.encode_streams(sym, lens)
    bits = ""
    for g in range(2):
        stream = "".join(
            format(int(low[g, s]) >> (8 - int(lens[g, s])), f"0{int(lens[g, s])}b") for s in sym[g]
        )
        bits += stream + "0" * (-len(stream) % 8)
    assert lengths.sum() * 8 == len(bits)
    assert bytes(payload) == int(bits, 2).to_bytes(len(bits) // 8, "big")
