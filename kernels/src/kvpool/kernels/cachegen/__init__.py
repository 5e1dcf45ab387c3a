"""CacheGen KV codec: LMCache's quantizer, an LMCache-compatible arithmetic coder, PAC, and an
explicit binary container.

Why this package exists: remote tiers and KV transfer between workers move chunks of
``[2, num_layers, num_tokens, hidden]`` KV (LMCache's ``KV_2LTD``). CacheGen makes them about
4x smaller than fp16; LMCache's own implementation is CUDA-only (its CPU fallback runs at
~10 MB/s) and pickles CUDA tensors. This one runs on the CPU, speaks a safe format, and its
arithmetic coder produces the same bytes as LMCache's for the same symbols and CDF.

Public API::

    from kvpool.kernels.cachegen import encode, decode, CacheGenError

    blob: bytes = encode(kv, coder="ac")       # or coder="pac"
    kv_hat: torch.Tensor = decode(blob)        # same shape and dtype as kv

* ``encode(kv, *, coder="ac"|"pac", key_bins=None, value_bins=None, subchunk=256)``:
  ``kv`` is float16/bfloat16/float32 ``[2, L, T, hidden]`` on any device, finite,
  ``T <= 65535``. Bins default to LMCache's table (:func:`default_bins`): below 10 layers 32
  everywhere, else K layers 0-9 and V layers 0-1 at 32 and the rest at 16; pass one count
  per layer (4..64) to override. ``subchunk`` is the tokens per bitstream (LMCache: 256).
* ``decode(data, *, device=None, max_elements=2**30)``: the reconstruction, on ``device``.
  Per element ``|x - x_hat| <= scale / (2 * MAX) + dtype rounding`` where
  ``scale = max |x|`` over the (layer, token) row and ``MAX = bins // 2 - 1``. An all-zero
  row decodes to exact zeros (LMCache yields NaN there).
* :func:`inspect` returns the validated :class:`Header` (sizes of metadata and payload).
* Every bad input or container raises :class:`CacheGenError` (a ``ValueError``); parsing
  never unpickles, never trusts a length, and never reads outside the buffer.

Coders: ``"ac"`` is LMCache's 16-bit-CDF arithmetic coder (``kvpool.kernels.cachegen.ac``);
``"pac"`` is a power-of-2 aligned prefix code per (layer, channel) with 8-bit table decode
(``kvpool.kernels.cachegen.pac``), a little larger and much faster to decode. The container
layout is documented in ``kvpool.kernels.cachegen.container``.
"""

from __future__ import annotations

from kvpool.kernels.cachegen.codec import decode, encode
from kvpool.kernels.cachegen.container import Header, parse_header
from kvpool.kernels.cachegen.errors import CacheGenError
from kvpool.kernels.cachegen.quant import default_bins, dequantize, quantize


def inspect(data: bytes | bytearray | memoryview) -> Header:
    """The validated header of a container (shape, dtype, coder, section sizes)."""
    return parse_header(data)


__all__ = [
    "CacheGenError",
    "Header",
    "decode",
    "default_bins",
    "dequantize",
    "encode",
    "inspect",
    "quantize",
]
