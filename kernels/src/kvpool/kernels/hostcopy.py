"""Many small host-memory copies in one call: the CPU engine of the batched gather/scatter.

Why this module exists: a paged KV scatter on the CPU is thousands of small copies (one per
run of consecutive slots, per layer, per K/V; 4,096 block copies of 8 KiB for the KV of 8K
tokens of the demo model). aten has no fast scatter of whole rows: ``index_copy_`` and
``index_put_`` move one element per inner step (1-3 GB/s here, against ~10 GB/s for a plain
copy), and one Python call per copy costs more than the copy. This module takes a copy plan
(source address, destination address, byte count per copy, built with vectorised torch ops
by :mod:`kvpool.kernels.layouts`) and runs it in numba-compiled loops that release the GIL,
split across a few threads by bytes, so the scatter approaches memcpy.

Raw addresses are only safe because the caller checked every bound first: the plan builder
in :mod:`.layouts` validates shapes, contiguity, devices and slot ranges before it computes
a single address, and nothing here is exported for other callers.
"""

from __future__ import annotations

import itertools
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt
from numba import carray, njit, types  # type: ignore[attr-defined]
from numba.core import cgutils
from numba.extending import intrinsic

I64 = npt.NDArray[np.int64]

# Below this many bytes per thread a second thread costs more than it saves: handing work to
# a helper thread costs a wake-up, and on a busy box a time slice (milliseconds).
MIN_BYTES_PER_THREAD = 8 * 2**20
MAX_THREADS = max(1, min(os.cpu_count() or 1, 8))

_pool: ThreadPoolExecutor | None = None


def _as_pointer_typing(typingctx: Any, address: Any) -> Any:
    """An int64 address as a void pointer (for ``numba.carray``)."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return types.voidptr(address), codegen


_as_pointer: Any = intrinsic(_as_pointer_typing)


@njit(cache=True, nogil=True)
def _copy_words(src: I64, dst: I64, nbytes: I64, lo: int, hi: int) -> None:  # pragma: no cover
    for i in range(lo, hi):
        n = nbytes[i] // 8
        s = carray(_as_pointer(src[i]), (n,), np.int64)
        d = carray(_as_pointer(dst[i]), (n,), np.int64)
        for k in range(n):
            d[k] = s[k]


@njit(cache=True, nogil=True)
def _copy_bytes(src: I64, dst: I64, nbytes: I64, lo: int, hi: int) -> None:  # pragma: no cover
    for i in range(lo, hi):
        n = nbytes[i]
        s = carray(_as_pointer(src[i]), (n,), np.uint8)
        d = carray(_as_pointer(dst[i]), (n,), np.uint8)
        for k in range(n):
            d[k] = s[k]


def _executor() -> ThreadPoolExecutor:
    global _pool  # noqa: PLW0603 (one lazily created pool per process)
    if _pool is None:
        _pool = ThreadPoolExecutor(MAX_THREADS - 1 or 1, thread_name_prefix="kvpool-hostcopy")
    return _pool


def thread_count(total_bytes: int, threads: int | None = None) -> int:
    """Threads a plan of ``total_bytes`` is split across: ``threads`` (default: the cores,
    at most 8), fewer when each would move under ``MIN_BYTES_PER_THREAD``."""
    limit = MAX_THREADS if threads is None else max(1, threads)
    return max(1, min(limit, total_bytes // MIN_BYTES_PER_THREAD))


def warm_up() -> None:
    """Compile (or load from numba's cache) both kernels now, so the first retrieve of a
    worker does not pay for it (seconds on a cold cache)."""
    a, b = np.arange(2, dtype=np.int64), np.zeros(2, dtype=np.int64)
    src = np.array([a.ctypes.data], dtype=np.int64)
    dst = np.array([b.ctypes.data], dtype=np.int64)
    _copy_words(src, dst, np.array([8], dtype=np.int64), 0, 1)
    _copy_bytes(src, dst, np.array([8], dtype=np.int64), 0, 1)
    if b[0] != a[0]:
        raise RuntimeError("hostcopy kernels failed their warm-up copy")


def run(src: I64, dst: I64, nbytes: I64, *, threads: int | None = None) -> None:
    """Copy ``nbytes[i]`` bytes from address ``src[i]`` to ``dst[i]`` for every ``i``.

    The ranges must be valid, and no destination may overlap another copy's source or
    destination (the plans of :mod:`.layouts` never do). Splits the plan across threads by
    bytes; each part runs without the GIL.
    """
    count = int(src.shape[0])
    if count == 0:
        return
    words = not bool(((src | dst | nbytes) & 7).any())
    kernel = _copy_words if words else _copy_bytes
    total = int(nbytes.sum())
    parts = min(thread_count(total, threads), count)
    if parts == 1:
        kernel(src, dst, nbytes, 0, count)
        return
    bounds = np.searchsorted(np.cumsum(nbytes), [total * k // parts for k in range(1, parts)])
    edges = [0, *(int(b) + 1 for b in bounds), count]
    edges = sorted(set(min(e, count) for e in edges))
    pool = _executor()
    futures = [
        pool.submit(kernel, src, dst, nbytes, lo, hi) for lo, hi in itertools.pairwise(edges[1:])
    ]
    kernel(src, dst, nbytes, edges[0], edges[1])
    for future in futures:
        future.result()
