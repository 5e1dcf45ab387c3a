"""The batched gather/scatter (``chunks_to_paged`` / ``paged_to_chunks``) equals the
per-chunk functions bit for bit, whichever path runs (the host copy plan, split across threads
or not, or the per-chunk fallback for other layouts and non-contiguous tensors), and refuses
what the per-chunk functions refuse."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.kernels import hostcopy
from kvpool.kernels.layouts import (
    LayoutError,
    chunk_to_paged,
    chunks_to_paged,
    paged_to_chunk,
    paged_to_chunks,
)

NB, BS, H, D, L = 12, 4, 2, 8, 3
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.uint8]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return {1: t.view(torch.uint8), 2: t.view(torch.int16), 4: t.view(torch.int32)}[
        t.element_size()
    ]


def _rand(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    width = shape[-1] * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], width), dtype=torch.uint8, generator=gen)
    return raw.view(dtype)  # any bit pattern, NaNs included


def _caches(dtype: torch.dtype, gen: torch.Generator, h: int = H, d: int = D) -> list[torch.Tensor]:
    return [_rand((2, NB, BS, h, d), dtype, gen) for _ in range(L)]


def _slots(kind: str, sizes: list[int], gen: torch.Generator) -> torch.Tensor:
    total = sum(sizes)
    if kind == "blocks":  # whole blocks in random order, as a block manager hands them out
        blocks = torch.randperm(NB, generator=gen)[: -(-total // BS)]
        return (blocks[:, None] * BS + torch.arange(BS)).flatten()[:total]
    if kind == "sequential":
        return torch.arange(3, 3 + total)
    perm = torch.randperm(NB * BS, generator=gen)[:total]  # scattered tokens
    if kind == "masked":
        perm[::3] = -1
    return perm


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    kind=st.sampled_from(["blocks", "sequential", "scattered", "masked"]),
    sizes=st.lists(st.integers(1, 9), min_size=1, max_size=4),
    threads=st.sampled_from([1, 3]),
    seed=st.integers(0, 2**31),
)
def test_batched_equals_per_chunk(
    dtype: torch.dtype, kind: str, sizes: list[int], threads: int, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    slots = _slots(kind, sizes, gen)
    chunks = [_rand((2, L, n, H * D), dtype, gen) for n in sizes]
    base = _caches(dtype, gen)
    want = [c.clone() for c in base]
    got = [c.clone() for c in base]
    start = 0
    for chunk, n in zip(chunks, sizes, strict=True):
        chunk_to_paged(chunk, want, slots[start : start + n])
        start += n
    old = hostcopy.MIN_BYTES_PER_THREAD
    hostcopy.MIN_BYTES_PER_THREAD = 1  # split even tiny plans across threads
    try:
        chunks_to_paged(chunks, got, slots, threads=threads)
        outs_want = [_rand(tuple(c.shape), dtype, gen) for c in chunks]
        outs_got = [o.clone() for o in outs_want]
        paged_to_chunks(got, slots, outs_got, threads=threads)
    finally:
        hostcopy.MIN_BYTES_PER_THREAD = old
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(want, got, strict=True))
    start = 0
    for out, n in zip(outs_want, sizes, strict=True):
        paged_to_chunk(want, slots[start : start + n], out)
        start += n
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(outs_want, outs_got, strict=True))


def test_odd_row_bytes_take_the_byte_kernel() -> None:
    """fp8 rows of 3 bytes: the plan's sizes are not whole words."""
    gen = torch.Generator().manual_seed(1)
    caches = _caches(torch.uint8, gen, h=1, d=3)
    want = [c.clone() for c in caches]
    chunks = [_rand((2, L, 5, 3), torch.uint8, gen), _rand((2, L, 2, 3), torch.uint8, gen)]
    slots = torch.tensor([0, 1, 2, 9, 30, 31, 7])
    chunks_to_paged(chunks, caches, slots)
    chunk_to_paged(chunks[0], want, slots[:5])
    chunk_to_paged(chunks[1], want, slots[5:])
    assert all(torch.equal(a, b) for a, b in zip(want, caches, strict=True))


def test_other_layouts_and_views_fall_back_per_chunk() -> None:
    gen = torch.Generator().manual_seed(2)
    logical = _caches(torch.float32, gen)
    hnd = [c.permute(0, 1, 3, 2, 4).contiguous() for c in logical]
    chunks = [_rand((2, L, 4, H * D), torch.float32, gen) for _ in range(2)]
    slots = torch.arange(8)
    chunks_to_paged(chunks, hnd, slots, layout="flash_hnd")
    out = torch.empty(2, L, 8, H * D)
    paged_to_chunk(hnd, slots, out, layout="flash_hnd")
    assert torch.equal(_bits(out), _bits(torch.cat(chunks, dim=2)))
    strided = [_rand((2, L, 8, H * D), torch.float32, gen)[:, :, ::2] for _ in range(2)]
    chunks_to_paged(strided, logical, slots)  # non-contiguous chunks: per-chunk path
    got = [torch.empty(2, L, 4, H * D) for _ in range(2)]
    paged_to_chunks(logical, slots, got)
    assert all(
        torch.equal(_bits(a), _bits(b.contiguous())) for a, b in zip(got, strided, strict=True)
    )


def test_refusals() -> None:
    gen = torch.Generator().manual_seed(3)
    caches = _caches(torch.float32, gen)
    chunks = [_rand((2, L, 4, H * D), torch.float32, gen) for _ in range(2)]
    with pytest.raises(LayoutError, match="duplicate"):
        chunks_to_paged(chunks, caches, torch.tensor([0, 1, 2, 3, 3, 4, 5, 6]))
    with pytest.raises(LayoutError, match="out of range"):
        chunks_to_paged(chunks, caches, torch.tensor([0, 1, 2, 3, 4, 5, 6, NB * BS]))
    with pytest.raises(LayoutError, match="hold 8 tokens"):
        chunks_to_paged(chunks, caches, torch.arange(7))
    with pytest.raises(LayoutError, match="dtype"):
        chunks_to_paged([c.half() for c in chunks], caches, torch.arange(8))
    with pytest.raises(LayoutError, match="expected"):
        paged_to_chunks(caches, torch.arange(8), [torch.empty(2, L + 1, 4, H * D)] * 2)
    chunks_to_paged(chunks, caches, torch.tensor([-1] * 8))  # nothing valid: nothing written
