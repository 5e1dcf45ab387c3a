"""encode/decode of a KV chunk: quantize, model, entropy-code, and pack into the container.

Why this module exists: it is the one place that ties the quantizer, the two coders and the
container together, so the public API (``encode``/``decode`` in the package) is a pair of
pure functions from a ``KV_2LTD`` tensor to bytes and back. The quantizer runs in torch on
the KV's own device; the entropy coders run on the CPU (numba, all streams in one call).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
import numpy.typing as npt
import torch
from numba import njit

from kvpool.kernels.cachegen import ac, pac
from kvpool.kernels.cachegen.cdf import cdf_from_counts, count_symbols
from kvpool.kernels.cachegen.container import (
    DEFAULT_MAX_ELEMENTS,
    MAX_SUBCHUNK,
    Header,
    check_shape,
    pack,
    parse,
)
from kvpool.kernels.cachegen.errors import CacheGenError
from kvpool.kernels.cachegen.quant import check_bins, default_bins, level_table, quantize

Coder = Literal["ac", "pac"]
_TORCH_DTYPES = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
}
_BY_NAME = {v: k for k, v in _TORCH_DTYPES.items()}


def _check_kv(kv: torch.Tensor) -> str:
    if not isinstance(kv, torch.Tensor):
        raise CacheGenError(f"kv must be a torch.Tensor, got {type(kv).__name__}")
    if kv.dim() != 4 or kv.shape[0] != 2:
        raise CacheGenError(
            f"kv must be KV_2LTD [2, num_layers, num_tokens, hidden], got {tuple(kv.shape)}"
        )
    if kv.dtype not in _TORCH_DTYPES:
        raise CacheGenError(f"kv dtype {kv.dtype} unsupported: use float16, bfloat16 or float32")
    return _TORCH_DTYPES[kv.dtype]


def _scale_bytes(scale: torch.Tensor, dtype: torch.dtype) -> bytes:
    # scale = amax|x| is one of the input values, so the KV dtype stores it exactly.
    s = scale.to(dtype).contiguous().cpu()
    return s.view(torch.uint8).numpy().tobytes()


def encode(
    kv: torch.Tensor,
    *,
    coder: Coder = "ac",
    key_bins: Sequence[int] | None = None,
    value_bins: Sequence[int] | None = None,
    subchunk: int = 256,
) -> bytes:
    """Compress one KV chunk ``[2, num_layers, num_tokens, hidden]`` into a container."""
    dtype_name = _check_kv(kv)
    _, nl, nt, nc = kv.shape
    check_shape(nl, nt, nc, DEFAULT_MAX_ELEMENTS)
    if coder not in ("ac", "pac"):
        raise CacheGenError(f"coder must be 'ac' or 'pac', got {coder!r}")
    if not 1 <= subchunk <= MAX_SUBCHUNK:
        raise CacheGenError(f"subchunk {subchunk} out of range [1, {MAX_SUBCHUNK}]")
    dk, dv = default_bins(nl)
    kb = check_bins(dk if key_bins is None else key_bins, nl, "key_bins")
    vb = check_bins(dv if value_bins is None else value_bins, nl, "value_bins")
    bins = kb + vb
    lp = max(bins) + 1
    sym_t, scale = quantize(kv.reshape(2 * nl, nt, nc), bins)
    sym = np.ascontiguousarray(sym_t.cpu().numpy())
    counts = count_symbols(sym, lp - 1)  # [2L, C, lp-1]
    levels = [2 * (b // 2 - 1) + 1 for b in bins]
    tables: list[npt.NDArray[np.integer]]
    if coder == "ac":
        cdf = cdf_from_counts(counts, lp).reshape(2 * nl * nc, lp)
        payload, lengths = ac.encode_streams(sym, cdf, subchunk)
        tables = [counts[j, :, : levels[j]] for j in range(2 * nl)]
    else:
        lens = pac.code_lengths(counts.reshape(2 * nl * nc, lp - 1))
        payload, lengths = pac.encode_streams(sym, lens, subchunk)
        lens3 = lens.reshape(2 * nl, nc, lp - 1)
        tables = [lens3[j, :, : levels[j]] for j in range(2 * nl)]
    header = Header(
        coder=coder,
        dtype=dtype_name,
        num_layers=nl,
        num_tokens=nt,
        channels=nc,
        subchunk=subchunk,
        lp=lp,
        bins=tuple(bins),
        meta_raw_len=0,
        meta_zlen=0,
        payload_len=payload.shape[0],
    )
    return pack(header, _scale_bytes(scale, kv.dtype), tables, lengths, payload)


@njit(cache=True, nogil=True)
def _dequant(
    sym: npt.NDArray[np.uint8],
    lut: npt.NDArray[np.float32],
    scale: npt.NDArray[np.float32],
    out: npt.NDArray[np.float32],
) -> None:
    nl, nt, nc = sym.shape
    for j in range(nl):
        row = lut[j]
        for t in range(nt):
            s = scale[j, t]
            for c in range(nc):
                out[j, t, c] = row[sym[j, t, c]] * s


def decode(
    data: bytes | bytearray | memoryview,
    *,
    device: torch.device | str | None = None,
    max_elements: int = DEFAULT_MAX_ELEMENTS,
) -> torch.Tensor:
    """Decompress a container into ``[2, num_layers, num_tokens, hidden]`` in its dtype.

    Raises :class:`CacheGenError` for anything that is not a valid container, and refuses
    containers that would decode to more than ``max_elements`` values.
    """
    parts = parse(data, max_elements)
    h = parts.header
    nl2, nt, nc, lp = 2 * h.num_layers, h.num_tokens, h.channels, h.lp
    levels = h.levels
    lengths = parts.lengths.astype(np.int64)
    if h.coder == "ac":
        counts = np.zeros((nl2, nc, lp - 1), dtype=np.int64)
        for j, t in enumerate(parts.tables):
            counts[j, :, : levels[j]] = t
        if bool((counts.sum(axis=-1) != nt).any()):
            raise CacheGenError(f"symbol histograms must each add up to num_tokens={nt}")
        cdf = cdf_from_counts(counts, lp).reshape(nl2 * nc, lp)
        sym = ac.decode_streams(parts.payload, lengths, cdf, nt, h.subchunk, nc)
    else:
        lens = np.full((nl2, nc, lp - 1), pac.UNENCODABLE, dtype=np.uint8)
        for j, t in enumerate(parts.tables):
            lens[j, :, : levels[j]] = t
        sym = pac.decode_streams(
            parts.payload, lengths, lens.reshape(nl2 * nc, lp - 1), nt, h.subchunk, nc
        )
    top = np.asarray(levels, dtype=np.int64)
    if bool((sym.max(axis=(1, 2)) >= top).any()):
        raise CacheGenError("payload decodes to symbols outside the quantizer's range")
    dtype = _BY_NAME[h.dtype]
    scale = torch.from_numpy(parts.scales.copy()).view(dtype).to(torch.float32).reshape(nl2, nt)
    if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
        raise CacheGenError("scales must be finite and >= 0")
    lut = level_table(list(h.bins)).numpy()
    out = np.empty((nl2, nt, nc), dtype=np.float32)
    _dequant(sym, lut, scale.numpy(), out)
    kv = torch.from_numpy(out).to(dtype).view(2, h.num_layers, nt, nc)
    return kv if device is None else kv.to(device)
