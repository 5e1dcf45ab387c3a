"""Properties of paged KV gather/scatter (reference notes §6.6), on CPU.

Covers: round-trip into a fresh cache touching only the given slots; gather∘scatter identity;
negative slots skipped in both directions; multi-layer equals per-layer and chunked transfers;
every engine layout gathers the same logical KV; slot math through a block table; duplicate
slots rejected; bit-exact copies for fp32/fp16/bf16/fp8-as-uint8 (compared as integer views so
NaN payloads count); clear errors for shapes that do not fit.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.kernels.layouts import (
    LayoutError,
    chunk_to_paged,
    paged_to_chunk,
    slot_mapping_from_block_table,
)

NB, BS, H, D, L = 6, 4, 2, 8, 3
LAYOUTS = ["flash_nhd", "flash_hnd", "flashinfer_nhd", "flashinfer_hnd"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.uint8]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view for bit-exact comparison."""
    return {1: t.view(torch.uint8), 2: t.view(torch.int16), 4: t.view(torch.int32)}[
        t.element_size()
    ]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(_bits(a.contiguous().clone()), _bits(b.contiguous().clone()))


def _rand(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.uint8:  # fp8 stored as raw bytes
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    raw = torch.randint(-(2**15), 2**15 - 1, shape, dtype=torch.int32, generator=gen)
    if dtype == torch.float32:
        return raw.to(torch.int32).view(torch.float32)  # any bit pattern, NaNs included
    return raw.to(torch.int16).view(dtype)


def _physical(logical: torch.Tensor, layout: str) -> torch.Tensor:
    """Store a logical [2, NB, BS, H, D] cache in the physical layout (contiguous)."""
    perm = {
        "flash_nhd": (0, 1, 2, 3, 4),
        "flash_hnd": (0, 1, 3, 2, 4),
        "flashinfer_nhd": (1, 0, 2, 3, 4),
        "flashinfer_hnd": (1, 0, 3, 2, 4),
    }[layout]
    return logical.permute(*perm).contiguous()


def _caches(
    layout: str, dtype: torch.dtype, seed: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    logical = [_rand((2, NB, BS, H, D), dtype, gen) for _ in range(L)]
    return logical, [_physical(c, layout) for c in logical]


def _expected_gather(logical: list[torch.Tensor], slots: list[int]) -> torch.Tensor:
    out = torch.stack([c.reshape(2, NB * BS, H * D) for c in logical], dim=1)  # [2, L, S, HD]
    return out[:, :, torch.tensor(slots)]


slot_lists = st.lists(st.integers(0, NB * BS - 1), min_size=1, max_size=NB * BS, unique=True)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=15, deadline=None)
@given(slots=slot_lists, seed=st.integers(0, 1000))
def test_gather_matches_reference_and_scatter_round_trips(
    layout: str, dtype: torch.dtype, slots: list[int], seed: int
) -> None:
    logical, caches = _caches(layout, dtype, seed)
    sm = torch.tensor(slots, dtype=torch.int64)
    chunk = torch.empty((2, L, len(slots), H * D), dtype=dtype)
    paged_to_chunk(caches, sm, chunk, layout=layout)  # type: ignore[arg-type]
    assert _same(chunk, _expected_gather(logical, slots))

    # scatter into a fresh random cache: slots reproduce the source, other rows untouched
    _, fresh = _caches(layout, dtype, seed + 1)
    before = [f.clone() for f in fresh]
    chunk_to_paged(chunk, fresh, sm, layout=layout)  # type: ignore[arg-type]
    again = torch.empty_like(chunk)
    paged_to_chunk(fresh, sm, again, layout=layout)  # type: ignore[arg-type]
    assert _same(again, chunk)
    untouched = sorted(set(range(NB * BS)) - set(slots))
    if untouched:
        um = torch.tensor(untouched)
        a = torch.empty((2, L, len(untouched), H * D), dtype=dtype)
        b = torch.empty_like(a)
        paged_to_chunk(fresh, um, a, layout=layout)  # type: ignore[arg-type]
        paged_to_chunk(before, um, b, layout=layout)  # type: ignore[arg-type]
        assert _same(a, b)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_negative_slots_are_skipped_both_ways(layout: str) -> None:
    logical, caches = _caches(layout, torch.float16, 3)
    sm = torch.tensor([5, -1, 7, -1, 0])
    chunk = torch.full((2, L, 5, H * D), 7.0, dtype=torch.float16)
    paged_to_chunk(caches, sm, chunk, layout=layout)  # type: ignore[arg-type]
    assert torch.all(chunk[:, :, 1] == 7.0) and torch.all(chunk[:, :, 3] == 7.0)
    assert _same(chunk[:, :, [0, 2, 4]], _expected_gather(logical, [5, 7, 0]))

    _, fresh = _caches(layout, torch.float16, 4)
    snapshot = [f.clone() for f in fresh]
    chunk_to_paged(chunk, fresh, sm, layout=layout)  # type: ignore[arg-type]
    got = torch.empty((2, L, 3, H * D), dtype=torch.float16)
    paged_to_chunk(fresh, torch.tensor([5, 7, 0]), got, layout=layout)  # type: ignore[arg-type]
    assert _same(got, chunk[:, :, [0, 2, 4]])
    others = torch.tensor([s for s in range(NB * BS) if s not in (5, 7, 0)])
    a = torch.empty((2, L, others.numel(), H * D), dtype=torch.float16)
    b = torch.empty_like(a)
    paged_to_chunk(fresh, others, a, layout=layout)  # type: ignore[arg-type]
    paged_to_chunk(snapshot, others, b, layout=layout)  # type: ignore[arg-type]
    assert _same(a, b)


def test_multi_layer_equals_single_layer_and_chunked() -> None:
    _, caches = _caches("flash_nhd", torch.float32, 5)
    sm = torch.tensor(random.Random(0).sample(range(NB * BS), 20))
    whole = torch.empty((2, L, 20, H * D))
    paged_to_chunk(caches, sm, whole)
    for layer in range(L):
        one = torch.empty((2, 20, H * D))
        paged_to_chunk([caches[layer]], sm, one, fmt="KV_2TD")
        assert _same(one, whole[:, layer])
    parts = [
        torch.empty((2, L, 8, H * D)),
        torch.empty((2, L, 8, H * D)),
        torch.empty((2, L, 4, H * D)),
    ]
    for i, part in enumerate(parts):
        paged_to_chunk(caches, sm[i * 8 : i * 8 + part.size(2)], part)
    assert _same(torch.cat(parts, dim=2), whole)


def test_gather_scatter_of_a_unique_slot_chunk_is_identity() -> None:
    gen = torch.Generator().manual_seed(9)
    kv = torch.randn((2, L, 10, H * D), generator=gen)
    caches = [torch.zeros((2, NB, BS, H, D)) for _ in range(L)]
    sm = torch.tensor(random.Random(1).sample(range(NB * BS), 10))
    chunk_to_paged(kv, caches, sm)
    back = torch.empty_like(kv)
    paged_to_chunk(caches, sm, back)
    assert _same(back, kv)


def test_all_layouts_gather_identical_kv() -> None:
    logical, _ = _caches("flash_nhd", torch.bfloat16, 11)
    sm = torch.tensor([3, 9, 17, 2])
    results = []
    for layout in LAYOUTS:
        out = torch.empty((2, L, 4, H * D), dtype=torch.bfloat16)
        paged_to_chunk([_physical(c, layout) for c in logical], sm, out, layout=layout)  # type: ignore[arg-type]
        results.append(out)
    assert all(_same(r, results[0]) for r in results)


def test_non_contiguous_flash_cache_view_works() -> None:
    big = torch.randn((2, NB * 2, BS, H, D))
    view = big[:, ::2]  # strided, not contiguous
    sm = torch.tensor([0, 5, 11])
    out = torch.empty((2, 1, 3, H * D))
    paged_to_chunk([view], sm, out)
    assert _same(out[:, 0], view.reshape(2, NB * BS, H * D)[:, sm])


def test_slot_math_through_a_block_table() -> None:
    logical, caches = _caches("flash_nhd", torch.float32, 13)
    table = torch.tensor([4, 1, 5])  # non-contiguous blocks of one request
    positions = torch.arange(0, 10)
    sm = slot_mapping_from_block_table(table, positions, BS)
    assert sm.tolist() == [int(table[p // BS]) * BS + p % BS for p in range(10)]
    out = torch.empty((2, L, 10, H * D))
    paged_to_chunk(caches, sm, out)
    for p in range(10):
        blk, off = int(table[p // BS]), p % BS
        assert _same(out[:, 0, p], logical[0][:, blk, off].reshape(2, H * D))


def test_mla_round_trip() -> None:
    gen = torch.Generator().manual_seed(2)
    caches = [torch.randn((NB, BS, 24), generator=gen) for _ in range(L)]
    sm = torch.tensor([1, -1, 22, 7])
    out = torch.zeros((1, L, 4, 24))
    paged_to_chunk(caches, sm, out, layout="mla", fmt="KV_MLA_FMT")
    assert _same(out[0, 2, 2], caches[2].view(-1, 24)[22])
    assert torch.all(out[:, :, 1] == 0)
    fresh = [torch.zeros((NB, BS, 24)) for _ in range(L)]
    chunk_to_paged(out, fresh, sm, layout="mla", fmt="KV_MLA_FMT")
    assert _same(fresh[1].view(-1, 24)[7], caches[1].view(-1, 24)[7])
    assert fresh[0].count_nonzero() == 3 * 24  # only the three valid slots were written


def test_duplicate_slots_on_scatter_are_rejected() -> None:
    caches = [torch.zeros((2, NB, BS, H, D)) for _ in range(L)]
    with pytest.raises(LayoutError, match="duplicate slots"):
        chunk_to_paged(torch.ones((2, L, 3, H * D)), caches, torch.tensor([4, 4, 1]))
    assert all(c.count_nonzero() == 0 for c in caches)  # nothing half-written


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"out_shape": (2, L, 2, H * D), "slots": [1, 2, 3]}, "chunk shape"),
        ({"out_shape": (2, L, 1, H * D), "slots": [NB * BS]}, "out of range"),
        ({"out_shape": (2, L, 1, H * D), "slots": [1], "dtype": torch.float16}, "dtype"),
        ({"out_shape": (2, L, 1, H * D), "slots": [1], "fmt": "KV_MLA_FMT"}, "MLA"),
        ({"out_shape": (2, 1, H * D), "slots": [1], "fmt": "KV_2TD"}, "one layer"),
    ],
)
def test_mismatches_raise_clear_errors(kwargs: dict[str, object], message: str) -> None:
    caches = [torch.zeros((2, NB, BS, H, D)) for _ in range(L)]
    out = torch.empty(kwargs["out_shape"], dtype=kwargs.get("dtype", torch.float32))  # type: ignore[call-overload]
    with pytest.raises(LayoutError, match=message):
        paged_to_chunk(caches, torch.tensor(kwargs["slots"]), out, fmt=kwargs.get("fmt", "KV_2LTD"))  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", DTYPES)
def test_whole_block_chunks_take_the_block_path_and_stay_exact(dtype: torch.dtype) -> None:
    logical, caches = _caches("flash_nhd", dtype, 21)
    blocks = [4, 0, 5]
    slots = [b * BS + o for b in blocks for o in range(BS)]
    sm = torch.tensor(slots)
    out = torch.empty((2, L, len(slots), H * D), dtype=dtype)
    paged_to_chunk(caches, sm, out)
    assert _same(out, _expected_gather(logical, slots))
    _, fresh = _caches("flash_nhd", dtype, 22)
    before = [f.clone() for f in fresh]
    chunk_to_paged(out, fresh, sm)
    for f, b, c in zip(fresh, before, caches, strict=True):
        for blk in range(NB):
            want = c[:, blk] if blk in blocks else b[:, blk]
            assert _same(f[:, blk], want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_chunks_at_unaligned_offsets_copy_exactly(dtype: torch.dtype) -> None:
    """A chunk that is a view into a pooled buffer at an odd element offset cannot be
    reinterpreted as 16- or 8-byte words; the copy must still be exact (found in review)."""
    logical, caches = _caches("flash_nhd", dtype, 31)
    blocks = [2, 0]
    slots = [b * BS + o for b in blocks for o in range(BS)]
    sm = torch.tensor(slots)
    n = 2 * L * len(slots) * H * D
    pool = torch.zeros(n + 1, dtype=dtype)
    out = pool[1:].view(2, L, len(slots), H * D)
    paged_to_chunk(caches, sm, out)
    assert _same(out, _expected_gather(logical, slots))
    _, fresh = _caches("flash_nhd", dtype, 32)
    chunk_to_paged(out, fresh, sm)
    back = torch.empty((2, L, len(slots), H * D), dtype=dtype)
    paged_to_chunk(fresh, sm, back)
    assert _same(back, out)
